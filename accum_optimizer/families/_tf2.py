"""What the three ``tf.function`` families share: Keras 3 on TensorFlow,
the Keras 2 new optimizer API, and legacy ``OptimizerV2``/tensorflow-addons.

:class:`Accumulating` is a mixin placed before the family's optimizer base
class (the way tensorflow-addons' ``AveragedOptimizerWrapper`` overrides its
own hooks and delegates). It holds, once for the three:

* the micro-step's route under ``tf.distribute``: one ``merge_call`` per
  micro-step, the window's ``cond`` in cross-replica context, each replica
  adding into its own (``ON_READ``) accumulators, and on updates handing its
  local window gradient to the inner optimizer, whose all-reduce is the one
  cross-replica reduction of the window (:meth:`Accumulating._enter_window`);
* the pass-through at N = 1, :meth:`Accumulating.flush`, the trace-time
  choice of the window's normaliser (:meth:`Accumulating._weighted`);
* per-variable gating of the inner update, with one lock for all replicas
  (:meth:`Accumulating._gated`); what is gated is the family's (its
  compatibility module patches the inner optimizer's per-variable hooks);
* schedule (de)serialization and the argument checks of ``__init__``.

A family supplies: its variables (``build``), the one call of its inner
optimizer (``_update_inner``), its gate patches (``_install_gates``), its
saving. The algorithm is :mod:`accum_optimizer.core`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer import _args, core, counting
from accum_optimizer._compat import tf as tf_compat
from accum_optimizer.families._tf1_graph import TF1Backend
from accum_optimizer.families._tf import (
    TFBackend,
    as_gradients,
    check_gradient_shapes,
    check_strategy,
    check_weight,
    control_inputs,
    local_value,
    no_gradients,
    shape_checked,
    tf_variable,
    variable_name,
)

_GATE_LOCK = threading.Lock()


def replicas_of(distribution: Any) -> core.Replicas:
    """:class:`~accum_optimizer.core.Replicas` of a strategy, reached from
    cross-replica context (inside ``merge_call``)."""

    def each(fn: Callable[..., Any], *args: Any) -> Any:
        return distribution.extended.call_for_each_replica(fn, args=args)

    def all_replicas(flag: Any) -> Any:
        # The skipping policies' one scalar all-reduce per micro-step.
        bad = distribution.reduce(tf.distribute.ReduceOp.SUM, each(_nonfinite_count, flag), axis=None)
        return tf.equal(bad, 0.0)

    return core.Replicas(distribution.num_replicas_in_sync, each, all_replicas)


def _nonfinite_count(flag: Any) -> Any:
    return tf.cast(tf.logical_not(flag), tf.float32)


def check_replica_context() -> None:
    """Raise ValueError in cross-replica context (a micro-step is a replica's)."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "AccumulatingOptimizer.apply() / apply_gradients() must be called "
            "in a replica context (e.g. inside strategy.run), not cross-replica context."
        )


def replicas_in_sync() -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync


class TF2Backend(TFBackend):
    """The TF2 families' backend: scattered variables leave copy-on-read mode."""

    def scattered(self, variable: Any) -> None:
        tf_compat.disable_copy_on_read(variable)


class TF2GraphBackend(TF1Backend, TF2Backend):
    """The TF2 families' backend in a ``tf.compat.v1`` graph (legacy
    optimizers in TF1-style code, Keras 2's graph-mode ``fit``), where no op
    runs unless fetched: every write returns its op, ordered explicitly, and
    the micro-step's op groups them (:class:`TF1Backend`)."""


def in_v1_graph() -> bool:
    """Building a ``tf.compat.v1`` graph (not eagerly, not inside a
    ``tf.function``): nothing runs that is not fetched or ordered."""
    return not tf.executing_eagerly() and not tf.inside_function()


def step_op(parts: Any, name: str | None = None) -> Any:
    """The op of one micro-step or flush, made of ``parts`` (the ops and
    outputs it made): ``None`` eagerly; inside a ``tf.function`` an op (the
    writes are ordered by automatic control dependencies), so that a caller
    that returns an op from a ``cond`` branch (Keras 2's
    ``LossScaleOptimizer``) gets one."""
    if tf.executing_eagerly():
        return None
    return tf.group(*control_inputs(parts), name=name)


class Accumulating(_args.Constructor):
    """The shared part of the Keras 3 (TF), Keras 2 and legacy wrappers.

    Attributes it reads, set by the family: ``inner_optimizer``,
    ``gradient_accumulation_steps``, ``reduction``, ``nonfinite``, the
    window's variables (``micro_steps``, ``acc_grads``, ``grad_received``,
    ``mini_step``, ``window_weight``, the skip counters where kept) and, set
    untracked at build, ``_build_order`` (the trainable variables in build
    order), ``_row_trackers`` (per variable, a row tracker or ``None``).
    """

    # False: every window is dense, as before the row trackers (which still
    # exist and are saved). Not API: benchmarks/sparse.py flips it to measure
    # the dense window next to the sparse one.
    _sparse_windows = True
    # Whether `mini_step` may be "unknown" (-1) and must be derived before a
    # micro-step (families whose checkpoints restore lazily, by name).
    _resumes_position = False

    def _hands_slices(self) -> bool:
        """Does a sparse window reach the inner optimizer as slices (else:
        dense, only the touched rows being zeroed afterwards)?"""
        return True

    def _before_base(self, args: _args.Arguments) -> None:
        if _args.accumulates(args.steps, args.nonfinite):  # (the pass-through goes wherever its inner goes)
            check_strategy()

    def _check_strategy_at_build(self) -> None:
        """At build, under the strategy the variables live in (an optimizer
        created outside a strategy's scope and built inside it): refuse the
        strategies that cannot accumulate (:func:`check_strategy`)."""
        if self._accumulates:
            check_strategy()

    def _micro_step_weight(self, weight: Any) -> Any:
        """A micro-step's checked ``weight``: the one given, else the count a
        counted loss reported in this train step (``CountedLoss`` in ``fit``:
        :mod:`accum_optimizer.counting`), else ``None`` (unweighted).

        Raises:
            ValueError, TypeError: as :func:`~accum_optimizer.families._tf.check_weight`;
                ValueError as :func:`accum_optimizer.counting.reported_count`.
        """
        if weight is None:
            weight = counting.reported_count(self.reduction)
        return check_weight(weight)

    # -------------------------------------------------------------- state
    def _window_built(self) -> bool:
        return "_build_order" in self.__dict__

    def _index_of(self, variable: Any) -> int:
        """``variable``'s position in build order."""
        return self._build_index[self._key_of(variable)]

    def _is_known(self, variable: Any) -> bool:
        return self._key_of(variable) in self._build_index

    def _check_known(self, variables: Sequence[Any]) -> None:
        """Raise ValueError for a variable the optimizer was not built with."""
        for v in variables:
            if not self._is_known(v):
                raise ValueError(
                    f"Unknown variable: {variable_name(v)!r}. This optimizer can only be "
                    "called for the variables it was originally built with. When working "
                    "with a new set of variables, create a new optimizer instance (or "
                    "call `optimizer.build(all_variables)` with every variable before "
                    "the first step)."
                )

    def _set_build_order(self, variables: Sequence[Any]) -> None:
        self._set_untracked("_build_order", list(variables))
        self._set_untracked("_build_index", {self._key_of(v): i for i, v in enumerate(variables)})

    @property
    def _accumulates(self) -> bool:
        """Whether micro-steps go through windows (else: the pass-through)."""
        return _args.accumulates(self.gradient_accumulation_steps, getattr(self, "nonfinite", "propagate"))

    # -- what is the inner optimizer's
    @property
    def iterations(self) -> Any:
        """Updates taken: the inner optimizer's int64 ``iterations``."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable: Any) -> None:
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (getter and setter; a
        variable, or its schedule)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def _set_untracked(self, name: str, value: Any) -> None:
        """An attribute that neither Keras nor TensorFlow tracks (written
        past their ``__setattr__``)."""
        self.__dict__[name] = value

    def _window_state(self) -> core.WindowState:
        trackers = self.__dict__.get("_row_trackers") or []
        seen = self.__dict__.get("_sparse_seen", ())
        rows = [t if i in seen else None for i, t in enumerate(trackers)]
        n = len(self._build_order)
        return core.WindowState(
            acc_grads=self.acc_grads,
            micro_steps=self.micro_steps,
            grad_received=self.grad_received,
            mini_step=self.mini_step,
            window_weight=self.window_weight,
            updates=self.inner_optimizer.iterations,
            touched_rows=rows if rows and self._sparse_windows else None,
            sparse_update=[self._hands_slices()] * n,
            variable_dtypes=[v.dtype for v in self._build_order],
            skipped_micro_steps=getattr(self, "skipped_micro_steps", None),
            skipped_windows=getattr(self, "skipped_windows", None),
            window_poisoned=getattr(self, "window_poisoned", None),
        )

    def _rules(self, weighted: bool | None = None) -> core.Rules:
        return core.Rules(
            self.gradient_accumulation_steps, self.reduction, getattr(self, "nonfinite", "propagate"), weighted
        )

    def _backend(self) -> TF2Backend:
        if in_v1_graph():
            return TF2GraphBackend(self._apply_inner)
        return TF2Backend(self._apply_inner)

    def _weighted(self, weight: Any, replicas: int) -> bool:
        """Trace-time: may this window's counts differ between replicas?

        Once any micro-step is traced with a weight, every window closed
        afterwards sums the counts over replicas (one scalar reduction per
        update); before, each replica divides by its own micro-step count,
        with no reduction. A traced close of the second kind that later meets
        weighted micro-steps would divide wrongly under a multi-replica
        strategy, so that order raises.

        Raises:
            ValueError: a weighted micro-step after an unweighted close was
                traced under a multi-replica strategy.
        """
        flags = self.__dict__
        if weight is not None and not flags.get("_weights_seen"):
            if replicas > 1 and flags.get("_unweighted_close_traced"):
                raise ValueError(
                    "AccumulatingOptimizer got a weighted micro-step (weight= or a "
                    "CountedLoss) after a train step without weights was traced "
                    f"under a {replicas}-replica strategy; that step's update would "
                    "normalise by the micro-step count. Use weights in every train "
                    "step of this optimizer (weight=1 counts like none)."
                )
            flags["_weights_seen"] = True
        weighted = bool(flags.get("_weights_seen"))
        if not weighted:
            flags["_unweighted_close_traced"] = True
        return weighted

    # ------------------------------------------------------- the micro-step
    def _in_build_order(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """The gradients placed in build order; variables absent from this
        call get ``None`` (no contribution this micro-step)."""
        full = [None] * len(self._build_order)
        for g, v in zip(grads, variables):
            full[self._index_of(v)] = g
        return full

    def _take_micro_step(self, grads: Sequence[Any], variables: Sequence[Any], weight: Any,
                         name: str | None = None) -> Any:
        """One micro-step of ``grads`` for ``variables`` (any order, a
        subset of the build's): checked, the optimizer built on first use,
        then the pass-through or the window. Returns its op (``name``)
        where a graph is built, ``None`` eagerly (:func:`step_op`).

        Raises:
            ValueError: a gradient's shape differs from its variable's, every
                gradient is ``None``, a variable is unknown, or called in
                cross-replica context.
        """
        grads, variables = as_gradients(grads, variables), list(variables)
        check_gradient_shapes(grads, variables, variable_name)
        no_gradients(grads, variables, variable_name)
        check_replica_context()
        self._before_micro_step(grads, variables)
        if not self._window_built():
            self._build_on_first_use(variables)
        self._check_known(variables)
        if not self._accumulates:
            return step_op(self._pass_through(grads, variables, weight), name)
        return step_op(self._enter_window(self._in_build_order(grads, variables), weight), name)

    def _before_micro_step(self, grads: list, variables: list) -> None:
        """The family's own checks or warnings of a micro-step's gradients."""

    def _build_on_first_use(self, variables: list) -> None:
        with tf.init_scope():
            self.build(variables)

    def _pass_through(self, grads: list, variables: list, weight: Any) -> Any:
        """N = 1: the inner update with this micro-step's gradients."""
        return core.pass_through(
            self._backend(), self.micro_steps, grads,
            lambda g: self._update_inner(g, variables), self.reduction, weight,
        )

    def _enter_window(self, grads: list, weight: Any = None) -> Any:
        """Take one micro-step with ``grads`` (build order), in replica context.

        Under any strategy the ``cond`` that picks update steps runs in
        cross-replica context, inside one ``merge_call`` (as Keras'
        ``LossScaleOptimizer`` does): a replica-context ``cond`` cannot hold
        the update, because the inner optimizer's ``iterations`` (and
        ``grad_received``) are ``ONLY_FIRST_REPLICA`` variables, every update
        of which in replica context is a ``merge_call``, which fails inside a
        ``cond`` (the crash of Keras' built-in accumulation). That holds for
        strategies that otherwise need no ``merge_call`` (MirroredStrategy
        under XLA on GPUs) too, so they take the same path.

        Raises:
            ValueError: called in cross-replica context.
        """
        checked = shape_checked(grads, self._build_order, variable_name)
        if not tf.distribute.has_strategy():
            return self._micro_step(checked, core.ONE_REPLICA, weight)
        return tf.distribute.get_replica_context().merge_call(
            self._cross_replica_step, args=(checked,), kwargs={"weight": weight}
        )

    def _cross_replica_step(self, distribution: Any, grads: list, finite: Any = None, weight: Any = None) -> Any:
        # Once, in cross-replica context, for all replicas (`grads` holds
        # per-replica values; which are None is the same in every replica).
        return self._micro_step(grads, replicas_of(distribution), weight, finite)

    def _micro_step(self, grads: list, replicas: core.Replicas, weight: Any = None, finite: Any = None) -> list:
        """The window's micro-step; returns the ops and outputs it made (what
        :func:`step_op` groups in a graph)."""
        trackers = self.__dict__.get("_row_trackers") or []
        for i, g in enumerate(grads):  # remembered across traces (see `_window_state`)
            if i < len(trackers) and trackers[i] is not None and isinstance(local_value(g), tf.IndexedSlices):
                self.__dict__.setdefault("_sparse_seen", set()).add(i)
        b, state = self._backend(), self._window_state()
        rules = self._rules(self._weighted(weight, replicas.count))
        resumed = None
        if self._resumes_position:
            with b.after(grads):
                resumed = core.resume_position(b, state, rules, replicas=replicas)
        with b.after(resumed):  # (explicit in a v1 graph; automatic in a tf.function)
            out = core.micro_step(b, state, rules, grads, replicas=replicas, weight=weight, finite=finite)
        return [*getattr(b, "made", ()), resumed, out]

    # --------------------------------------------------------- the update
    def _apply_inner(self, window_grads: list, gates: dict) -> Any:
        with self._gated(gates):
            applied = self._update_inner(window_grads, self._build_order)
        # The inner optimizer scatter-updated the variables of sparse
        # windows: keep their next reads (the forward passes) from copying.
        for g, v in zip(window_grads, self._build_order):
            if isinstance(g, tf.IndexedSlices):
                tf_compat.disable_copy_on_read(v)
        return applied  # (its op, ordered by the caller in a v1 graph)

    @contextlib.contextmanager
    def _gated(self, gates: dict):
        """Skip, per variable, the inner update of variables that had no
        gradient in the window.

        ``gates`` (from :func:`accum_optimizer.core.micro_step`) holds, for
        each variable without a gradient on this micro-step, a boolean that
        is true iff it had one earlier in the window. The family's
        ``_install_gates`` makes the inner optimizer's per-variable
        mutations of those variables run under a ``cond`` on it; global
        state (``iterations``, EMA over all variables) moves once per
        update, as in the large-batch reference.

        Under ``MirroredStrategy`` every replica runs this at once (in its
        own thread) around the same inner optimizer: the first replica to
        enter installs the gates, the last to leave removes them (the gates
        are equal in every replica: ``grad_received`` is mirrored).
        """
        if not gates:
            yield
            return
        with _GATE_LOCK:
            depth = self.__dict__.get("_gate_depth", 0)
            if depth == 0:
                self._set_untracked("_remove_gates", self._install_gates(gates))
            self._set_untracked("_gate_depth", depth + 1)
        try:
            yield
        finally:
            with _GATE_LOCK:
                self._set_untracked("_gate_depth", self._gate_depth - 1)
                if self._gate_depth == 0:
                    remove = self._remove_gates
                    self._set_untracked("_remove_gates", None)
                    remove()

    def _gate_keys(self, gates: dict, key: Callable[[Any], Any]) -> dict:
        """``gates`` keyed by ``key(variable)`` instead of build-order index."""
        return {key(self._build_order[i]): g for i, g in gates.items()}

    # ------------------------------------------------------ partial window
    @tf.autograph.experimental.do_not_convert
    def flush(self) -> Any:
        """Apply the current, partial window now as one update, if it holds
        at least one micro-step; a no-op on an empty window.

        The update is normalised by what the window holds (``"mean"``: its
        micro-steps, or the sum of their counts when weighted; never by N),
        exactly what a large batch of the window's samples would apply; then
        a new window starts. ``iterations`` moves by one, ``micro_steps``
        does not, and ``mini_step`` (the window's position) restarts at 0.
        Works eagerly and inside ``tf.function``, with or without a
        ``tf.distribute`` strategy (call it where you would call ``fit``, in
        cross-replica context); runs in the strategy the optimizer was
        created under. Lightning's forced step at epoch end divides by N
        instead (Lightning#19987); this one does not.
        ``accum_optimizer.FlushPartialWindow`` calls it at every epoch end.

        A window that a skipping policy marked non-finite is discarded, as
        its closing micro-step would; a window whose counts sum to 0 applies
        nothing.

        Returns:
            In a ``tf.compat.v1`` graph (TF1-style code, where nothing runs
            unless fetched): the op that flushes, to ``sess.run`` at the end
            of an epoch (as the TF1 family's ``flush``). Otherwise ``None``:
            the flush has run.

        Raises:
            ValueError: called inside ``strategy.run`` (replica context), or
                before the optimizer is built.
        """
        if not self._accumulates:
            return tf.no_op() if in_v1_graph() else None
        if not self._window_built():
            raise ValueError(
                "AccumulatingOptimizer.flush() before the optimizer is built: it holds no "
                "window yet, so there is nothing to flush. Build it first "
                "(opt.build(model.trainable_variables)), or take a micro-step "
                "(apply_gradients, or model.fit)."
            )
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            raise ValueError(
                "AccumulatingOptimizer.flush() must be called in cross-replica "
                "context (outside strategy.run), like model.fit."
            )
        if in_v1_graph():
            with strategy_scope(self):
                return step_op(self._flush_step())
        function = self.__dict__.get("_flush_function")
        if function is None:
            # (One function per optimizer: tf.function's retracing warning
            # would count one shared bound method across instances.)
            function = tf.function(lambda: self._flush_step(), autograph=False)
            self._set_untracked("_flush_function", function)
        with strategy_scope(self):
            function()

    def _flush_step(self) -> Any:
        if not tf.distribute.has_strategy():
            return self._flush_window(core.ONE_REPLICA)
        return tf.distribute.get_strategy().run(
            lambda: tf.distribute.get_replica_context().merge_call(
                lambda d: self._flush_window(replicas_of(d))
            )
        )

    def _flush_window(self, replicas: core.Replicas) -> list:
        b, state = self._backend(), self._window_state()
        rules = self._rules(bool(self.__dict__.get("_weights_seen")))
        resumed = None
        if self._resumes_position:
            resumed = core.resume_position(b, state, rules, replicas=replicas)
        with b.after(resumed):
            out = core.flush(b, state, rules, replicas=replicas)
        return [*getattr(b, "made", ()), resumed, out]

    def _remember_strategy(self) -> None:
        """The strategy in scope at construction (the default strategy if
        none): ``flush`` runs in it (callbacks run outside its scope), and
        the accumulators are placed beside their variables by it."""
        self._set_untracked("_strategy", tf.distribute.get_strategy())


def strategy_scope(owner: Any) -> Any:
    """The scope of the strategy ``owner`` was created under, unless a
    strategy is in scope already."""
    strategy = owner.__dict__.get("_strategy")
    if strategy is None or tf.distribute.has_strategy():
        return contextlib.nullcontext()
    return strategy.scope()


def colocated_with(owner: Any, reference: Any) -> Any:
    """Place variables created in this context beside ``reference`` (by the
    strategy ``owner`` was created under)."""
    strategy = owner.__dict__.get("_strategy") or tf.distribute.get_strategy()
    return strategy.extended.colocate_vars_with(tf_variable(reference))


def outside_functions() -> Any:
    """Eager context even while a ``tf.function`` is being traced."""
    return tf.init_scope()


# ---------------------------------------------------------------- saving
def build_for_loading(model: Any) -> None:
    """Build ``model``'s optimizer for ``model.load_weights`` as its first
    train step would: the state loaded is then restored at once."""
    with model.distribute_strategy.scope(), outside_functions():
        model.optimizer.build(model.trainable_variables)


def saved_layout(variables: Sequence[Any], blocks: Sequence[Sequence[Any]], saved: Sequence[Any]) -> list:
    """The variables that the ``saved`` arrays fill, in order: ``variables``,
    or the layout of a save by an older version or another configuration,
    which lacks some of the optional trailing ``blocks`` (each a run of
    ``variables``, in their order at its end).

    Of the layouts of the right length, the first whose variables match the
    arrays in shape and in dtype kind (integer counters, float values); the
    first of the right length if none matches (the caller's shape check
    then names the culprit); ``variables`` if none has the right length (the
    caller raises)."""
    import itertools

    import numpy as np

    variables = list(variables)
    base = variables[: len(variables) - sum(len(b) for b in blocks)]
    layouts = []
    for keep in itertools.product((True, False), repeat=len(blocks)):
        layout = base + [v for k, b in zip(keep, blocks) if k for v in b]
        if len(layout) == len(saved):
            layouts.append(layout)

    def fits(layout: list) -> bool:
        for v, value in zip(layout, saved):
            value = np.asarray(value)
            if tuple(v.shape) != value.shape:
                return False
            if tf.as_dtype(v.dtype).is_floating != np.issubdtype(value.dtype, np.floating):
                return False
        return True

    fitting = [layout for layout in layouts if fits(layout)]
    return fitting[0] if fitting else (layouts[0] if layouts else variables)


def assign_all(variables: Sequence[Any], weights: Sequence[Any], name_of: Callable[[Any], str]) -> None:
    """Assign ``weights`` to ``variables`` after checking them all.

    Raises:
        ValueError: the number or a shape does not match.
    """
    import numpy as np

    if len(weights) != len(variables):
        raise ValueError(
            f"`weights` must have one array per optimizer variable: expected "
            f"{len(variables)}, received {len(weights)}."
        )
    for variable, weight in zip(variables, weights):
        if tuple(variable.shape) != tuple(np.shape(weight)):
            raise ValueError(
                f"Optimizer variable {name_of(variable)!r} has shape "
                f"{tuple(variable.shape)}; received a weight of shape "
                f"{tuple(np.shape(weight))}."
            )
    for variable, weight in zip(variables, weights):
        variable.assign(np.asarray(weight))


# --------------------------------------------------------- serialization
def serialize_schedule(package: Any, steps: Any) -> Any:
    """``gradient_accumulation_steps`` for ``get_config``: an int or a dict
    as is (JSON makes its keys strings, which the constructor accepts); a
    callable registered with ``package`` (``saving.register_keras_serializable``):
    a function, or an object of a class with ``get_config``/``from_config``.
    ValueError for any other callable."""
    if isinstance(steps, (int, dict)):
        return steps
    function = inspect.isroutine(steps)
    registered = steps if function else type(steps)  # an object: its class is registered
    if not function and not (callable(getattr(steps, "get_config", None)) and hasattr(registered, "from_config")):
        problem = "an object without get_config() and from_config(), which Keras cannot save"
    elif package.saving.get_registered_object(package.saving.get_registered_name(registered)) is not registered:
        problem = f"not a registered Keras object (its {'function' if function else 'class'} is not registered)"
    else:
        return package.saving.serialize_keras_object(steps)
    raise ValueError(
        f"Cannot serialize AccumulatingOptimizer: its gradient_accumulation_steps is {steps!r}, {problem}. "
        "Accepted: an int, a dict schedule {first_update: N, ...} (serialized as is), or a function or a class "
        f"with get_config() and from_config() registered with @{package.__name__}.saving.register_keras_serializable()."
    )


def deserialize_schedule(package: Any, config: dict, custom_objects: Any = None) -> dict:
    """``config`` with a serialized callable schedule (a dict with
    ``"class_name"``, from :func:`serialize_schedule`) turned back into it."""
    steps = config.get("gradient_accumulation_steps")
    if isinstance(steps, dict) and "class_name" in steps:
        config = dict(config)
        config["gradient_accumulation_steps"] = package.saving.deserialize_keras_object(
            steps, custom_objects=custom_objects
        )
    return config
