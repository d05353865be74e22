"""What every ``keras.optimizers``-style wrapper shares, on any framework:
Keras 3 (on TensorFlow, JAX or torch), the Keras 2 new optimizer API, and
legacy ``OptimizerV2``/tensorflow-addons.

:class:`Accumulating` is a mixin placed before the family's optimizer base
class (the way tensorflow-addons' ``AveragedOptimizerWrapper`` overrides its
own hooks and delegates). It holds, once: the window's state record and
rules, the build order of the variables, the trace-time choice of the
window's normaliser (:meth:`Accumulating._weighted`), the micro-step's
checks and its route to the pass-through (N = 1) or the window, per-variable
gating of the inner update with one lock for all replicas
(:meth:`Accumulating._gated`), the flush of a partial window.

A *route* subclass supplies what depends on the framework:
:mod:`accum_optimizer.families._tf2` (TensorFlow: ``tf.function``,
``tf.distribute``, ``tf.compat.v1`` graphs) and
:mod:`accum_optimizer.families._keras_ops` (Keras 3 on JAX and torch:
``keras.ops``, ``stateless_apply``). A family supplies: its variables
(``build``), the one call of its inner optimizer (``_update_inner``), its
gate patches (``_install_gates``), its saving. The algorithm is
:mod:`accum_optimizer.core`. Nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Sequence

from accum_optimizer import _args, core, counting

_GATE_LOCK = threading.Lock()


def variable_name(variable: Any) -> str:
    """``keras.Variable.path``, or a ``tf.Variable``'s name."""
    return getattr(variable, "path", None) or variable.name


def shape_mismatch(gradient_shape: tuple, variable_shape: tuple, name: str) -> ValueError:
    """The error of a gradient whose shape is not its variable's."""
    return ValueError(
        f"Gradient shape {gradient_shape} does not match the shape {variable_shape} "
        f"of variable {name!r}; each gradient must have its variable's shape."
    )


def weight_type_error(weight: Any) -> TypeError:
    """The error of a micro-step ``weight`` that is not a real number."""
    return TypeError(
        "`weight` must be a scalar >= 0 (the micro-batch's count: samples, "
        f"sum of sample weights or unmasked tokens). Received weight={weight!r} "
        f"of type {type(weight).__name__}."
    )


def weight_shape_error(shape: tuple) -> ValueError:
    """The error of a micro-step ``weight`` that is not a scalar."""
    return ValueError(f"`weight` must be a scalar (one count per micro-step). Received a value of shape {shape}.")


def weight_value_error(received: Any) -> ValueError:
    """The error of a micro-step ``weight`` that is negative, NaN or infinite."""
    return ValueError(f"`weight` must be finite and >= 0 (the micro-batch's count). Received weight={received!r}.")


def no_gradients(grads: Sequence[Any], variables: Sequence[Any], name_of: Callable[[Any], str]) -> None:
    """Raise ValueError if every gradient is ``None``."""
    if all(g is None for g in grads):
        raise ValueError(f"No gradients provided for any variable: {[name_of(v) for v in variables]}.")



class Accumulating(_args.Constructor):
    """The shared part of the Keras 3 (any backend), Keras 2 and legacy wrappers.

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

    def _micro_step_weight(self, weight: Any) -> Any:
        """A micro-step's checked ``weight``: the one given, else the count a
        counted loss reported in this train step (``CountedLoss`` in ``fit``:
        :mod:`accum_optimizer.counting`), else ``None`` (unweighted).

        Raises:
            ValueError, TypeError: as the route's ``_check_weight``;
                ValueError as :func:`accum_optimizer.counting.reported_count`.
        """
        if weight is None:
            weight = counting.reported_count(self.reduction)
        return self._check_weight(weight)

    # ------------------------------------------------- the route's hooks
    def _check_weight(self, weight: Any) -> Any:
        """``weight`` checked and converted (``None`` stays ``None``)."""
        raise NotImplementedError

    def _backend(self) -> Any:
        """The :class:`~accum_optimizer.core.Backend` of this micro-step."""
        raise NotImplementedError

    def _checked_gradients(self, grads: Sequence[Any], variables: list) -> list:
        """``grads`` converted as the inner optimizer takes them, their
        shapes checked against ``variables`` (raise ``ValueError``)."""
        raise NotImplementedError

    def _enter_window(self, grads: list, weight: Any = None) -> Any:
        """The window's micro-step with ``grads`` in build order."""
        raise NotImplementedError

    def _step_result(self, parts: Any, name: str | None) -> Any:
        """What ``apply_gradients`` returns for a micro-step's ``parts``."""
        return None

    def _after_inner_update(self, window_grads: list) -> None:
        """Called after each call of the inner optimizer."""

    def _writer(self) -> Any:
        """The optimizer whose ``assign``/``assign_add`` write the window's
        variables (Keras 3: the wrapper itself, as Keras' optimizers write
        through their own), or ``None``: the route writes the variables."""
        return None

    def _gate_cond(self) -> Any:
        """The ``cond(pred, true_fn, false_fn)`` that gates the inner
        optimizer's per-variable writes; ``None``: the framework's own."""
        return None

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

    def _link_followers(self, variables: Sequence[Any]) -> None:
        """At build: the layers whose windows end with this optimizer's
        (``accum_optimizer.layers.BatchNormalization`` over ``variables``),
        for ``WindowState.followers``; none for the pass-through (N = 1)."""
        if self._accumulates:
            from accum_optimizer.layers import _link

            self._set_untracked("_window_followers", _link.follow(
                self, variables, eager_micro_step=self.__dict__.get("_eager_micro_step_build", False)))

    def _executing_eagerly(self) -> bool:
        """Does the current micro-step run eagerly (not traced)?"""
        return False

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
            followers=tuple(self.__dict__.get("_window_followers", ())),
            combine=self._combine(),
        )

    def _combine(self) -> list | None:
        """Per variable in build order, its ``WindowState.combine`` rule, or
        ``None``: every variable's window is its gradient's."""
        return None

    def _rules(self, weighted: bool | None = None) -> core.Rules:
        return core.Rules(
            self.gradient_accumulation_steps, self.reduction, getattr(self, "nonfinite", "propagate"), weighted
        )

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
        then the pass-through or the window. Returns the route's result
        (its op, ``name``, where a TF graph is built; else ``None``).

        Raises:
            ValueError: a gradient's shape differs from its variable's, every
                gradient is ``None``, a variable is unknown, or (TF) called in
                cross-replica context.
        """
        variables = list(variables)
        grads = self._checked_gradients(grads, variables)
        no_gradients(grads, variables, variable_name)
        self._before_micro_step(grads, variables)
        if not self._window_built():
            # (the layers linked at this build know it is a micro-step's, and whether eager)
            self._set_untracked("_eager_micro_step_build", self._executing_eagerly())
            try:
                self._build_on_first_use(variables)
            finally:
                self._set_untracked("_eager_micro_step_build", False)
        self._check_known(variables)
        if not self._accumulates:
            return self._step_result(self._pass_through(grads, variables, weight), name)
        return self._step_result(self._enter_window(self._in_build_order(grads, variables), weight), name)

    def _before_micro_step(self, grads: list, variables: list) -> None:
        """The family's own checks or warnings of a micro-step's gradients."""

    def _build_on_first_use(self, variables: list) -> None:
        self.build(variables)

    def _pass_through(self, grads: list, variables: list, weight: Any) -> Any:
        """N = 1: the inner update with this micro-step's gradients."""
        return core.pass_through(
            self._backend(), self.micro_steps, grads,
            lambda g: self._update_inner(g, variables), self.reduction, weight,
        )

    def _micro_step(self, grads: list, replicas: core.Replicas, weight: Any = None, finite: Any = None) -> list:
        """The window's micro-step; returns the ops and outputs it made (what
        a TF graph groups into the micro-step's op)."""
        b, state = self._backend(), None
        trackers = self.__dict__.get("_row_trackers") or []
        for i, g in enumerate(grads):  # remembered across traces (see `_window_state`)
            if i < len(trackers) and trackers[i] is not None and g is not None and b.is_sparse(g):
                self.__dict__.setdefault("_sparse_seen", set()).add(i)
        state = self._window_state()
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
        """The one call of the inner optimizer with the window's gradients.

        Where every gate is known now (:meth:`_open_gates`), the variables
        whose gate is closed are left out of the call, as Keras leaves out a
        variable whose gradient is ``None``: the inner optimizer's own code
        then skips their update, slots, weight decay and constraint, whatever
        route it takes (torch's optimizers update all variables at once,
        without ``update_step``). Otherwise the inner optimizer's
        per-variable mutations run under a ``cond`` on each gate
        (:meth:`_gated`)."""
        opened = self._open_gates(gates) if gates else None
        if opened is not None:
            kept = [i for i in range(len(window_grads)) if opened.get(i, True)]
            applied = self._update_inner([window_grads[i] for i in kept], [self._build_order[i] for i in kept])
        else:
            with self._gated(gates):
                applied = self._update_inner(window_grads, self._build_order)
        self._after_inner_update(window_grads)
        return applied  # (its op, ordered by the caller in a v1 graph)

    def _open_gates(self, gates: dict) -> dict | None:
        """``{index: bool}``, each gate's value, where all of them are known
        when the update is built (not symbolic) and at least one is open;
        else ``None`` (the gates are applied by :meth:`_gated`)."""
        return None

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
    def _check_flushable(self) -> None:
        """Raise ``ValueError`` before the optimizer is built."""
        if not self._window_built():
            raise ValueError(
                "AccumulatingOptimizer.flush() before the optimizer is built: it holds no "
                "window yet, so there is nothing to flush. Build it first "
                "(opt.build(model.trainable_variables)), or take a micro-step "
                "(apply_gradients, or model.fit)."
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
            if _is_float(v.dtype) != _is_float(value.dtype):
                return False
        return True

    fitting = [layout for layout in layouts if fits(layout)]
    return fitting[0] if fitting else (layouts[0] if layouts else variables)


def _is_float(dtype: Any) -> bool:
    """A float dtype (TF's ``DType``, Keras' name, NumPy's, bfloat16 too)?"""
    return "float" in (getattr(dtype, "name", None) or str(dtype))


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
