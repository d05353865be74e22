"""What every ``keras.optimizers``-style wrapper shares, on any framework:
Keras 3 (on TensorFlow, JAX or torch), the Keras 2 new optimizer API, and
legacy ``OptimizerV2``/tensorflow-addons.

:class:`AccumulatingBase` is a mixin placed before the family's optimizer base
class (the way tensorflow-addons' ``AveragedOptimizerWrapper`` overrides its
own hooks and delegates). It holds, once: the window's state record and
rules, the build order of the variables, the trace-time choice of the
window's normaliser (:meth:`AccumulatingBase._weighted`), the micro-step's
checks and its route to the pass-through (N = 1) or the window, per-variable
gating of the inner update with one lock for all replicas
(:meth:`accum_optimizer.families._window.Window.gated`), the flush of a partial window.

A *route* subclass supplies what depends on the framework:
:mod:`accum_optimizer.families._tf_route` (TensorFlow: ``tf.function``,
``tf.distribute``, ``tf.compat.v1`` graphs) and
:mod:`accum_optimizer.families._keras_ops_route` (Keras 3 on JAX and torch:
``keras.ops``, ``stateless_apply``). A family supplies: its variables
(``build``), the one call of its inner optimizer (``_update_inner``), its
gate patches (``_install_gates``), its saving. The algorithm is
:mod:`accum_optimizer.core`. Nothing here imports a framework.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from accum_optimizer import _args, core, counting
from accum_optimizer.core import layout

from accum_optimizer.families import _window


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



class AccumulatingBase(_args.Constructor):
    """The shared part of the Keras 3 (any backend), Keras 2 and legacy wrappers.

    Attributes it reads, set by the family: ``inner_optimizer``,
    ``gradient_accumulation_steps``, ``reduction``, ``nonfinite``, the
    window's variables (``micro_steps``, ``acc_grads``, ``grad_received``,
    ``mini_step``, ``window_weight``, the skip counters where kept). What
    is not a variable is the window's (``self._window``, a
    :class:`~accum_optimizer.families._window.Window`), given at build: the
    build order (:meth:`_set_build_order`) and the row trackers.
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

    # ------------------------------------------------- the family's hooks
    def _hooks(self) -> _window.Hooks:
        return _window.Hooks(self._key_of, self._update_inner, self._install_gates)

    def _key_of(self, variable: Any) -> Any:
        """How the inner optimizer keys ``variable`` (hashable)."""
        raise NotImplementedError

    def _update_inner(self, grads: list, variables: list) -> Any:
        """The one call of the inner optimizer at an update."""
        raise NotImplementedError

    def _install_gates(self, gates: dict) -> Callable[[], None]:
        """Gate the inner optimizer's per-variable writes (see
        :class:`~accum_optimizer.families._window.Hooks`); returns the remover."""
        raise NotImplementedError

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
        return self._window.built

    @property
    def _build_order(self) -> list:
        """The trainable variables in build order (the accumulators' order)."""
        return self._window.build_order

    @property
    def _row_trackers(self) -> list:
        """Per variable in build order, its row tracker or ``None``."""
        return self._window.row_trackers

    def _check_known(self, variables: Sequence[Any]) -> None:
        """Raise ValueError for a variable the optimizer was not built with."""
        for v in self._window.unknown(variables)[:1]:
            raise ValueError(
                f"Unknown variable: {variable_name(v)!r}. This optimizer can only be "
                "called for the variables it was originally built with. When working "
                "with a new set of variables, create a new optimizer instance (or "
                "call `optimizer.build(all_variables)` with every variable before "
                "the first step)."
            )

    def _set_build_order(self, variables: Sequence[Any]) -> None:
        self._window.set_build_order(variables)

    def _link_followers(self, variables: Sequence[Any]) -> None:
        """At build: the layers whose windows end with this optimizer's
        (``accum_optimizer.layers.BatchNormalization`` over ``variables``),
        for ``WindowState.followers``; none for the pass-through (N = 1)."""
        if self._accumulates:
            from accum_optimizer.layers import _link

            self._window.followers = tuple(_link.follow(self, variables, eager_micro_step=self._window.eager_build))

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

    def _window_state(self) -> core.WindowState:
        rows = self._window.seen_trackers()
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
            followers=self._window.followers,
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
        (:meth:`~accum_optimizer.families._window.Window.weighted`)."""
        return self._window.weighted(weight, replicas)

    # ------------------------------------------------------- the micro-step
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
            self._window.eager_build = self._executing_eagerly()
            try:
                self._build_on_first_use(variables)
            finally:
                self._window.eager_build = False
        self._check_known(variables)
        if not self._accumulates:
            return self._step_result(self._pass_through(grads, variables, weight), name)
        return self._step_result(self._enter_window(self._window.in_build_order(grads, variables), weight), name)

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
        b = self._backend()
        self._window.note_sparse(grads, b.is_sparse)  # (remembered across traces)
        rules = self._rules(self._weighted(weight, replicas.count))
        return self._window.micro_step(b, self._window_state(), rules, grads, replicas, weight, finite,
                                       resumes=self._resumes_position)

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
        (:meth:`~accum_optimizer.families._window.Window.gated`)."""
        opened = self._open_gates(gates) if gates else None
        if opened is not None:
            kept = [i for i in range(len(window_grads)) if opened.get(i, True)]
            applied = self._window.hooks.update_inner(
                [window_grads[i] for i in kept], [self._build_order[i] for i in kept])
        else:
            with self._window.gated(gates):
                applied = self._window.hooks.update_inner(window_grads, self._build_order)
        self._after_inner_update(window_grads)
        return applied  # (its op, ordered by the caller in a v1 graph)

    def _open_gates(self, gates: dict) -> dict | None:
        """``{index: bool}``, each gate's value, where all of them are known
        when the update is built (not symbolic) and at least one is open;
        else ``None`` (the gates are applied by ``Window.gated``)."""
        return None

    # --------------------------------------------------------- saved state
    # The family's name in accum_optimizer.core.layout (LAYOUTS, BUILDS),
    # and its saved order.
    _LAYOUT_NAME: str
    _LAYOUT: layout.Layout

    # Appended to the error of state that fits no layout.
    _RESTORE_HINT = ""

    def _saved_blocks(self) -> dict:
        """``{block name: variables}``, every block of :attr:`_LAYOUT`: the
        wrapper's own (``"own"``), the inner optimizer's (``"inner"``) and the
        optional trailing blocks (``self._window.blocks``)."""
        raise NotImplementedError

    def _saved_variables(self) -> list:
        """The variables in the order saved state lists them."""
        return layout.ordered(self._LAYOUT, self._saved_blocks())

    def _model_being_loaded(self) -> Any:
        """The model whose ``load_weights`` is restoring this optimizer, or ``None``."""
        return None

    def _ready_to_restore(self, state: Any) -> bool:
        """Before restoring ``state``: build the optimizer where its model is
        being loaded (as its first train step would); unbuilt otherwise
        (called directly, with no model), keep ``state`` (``{key: array}``)
        for :meth:`build` and return ``False``."""
        import numpy as np

        if not self._window_built():
            model = self._model_being_loaded()
            if model is not None:
                self._build_for_loading(model)
        if self._window_built():
            return True
        self._window.deferred = {k: np.asarray(state[k]) for k in state.keys()}
        return False

    def _restore(self, saved: Sequence[Any], name: str) -> list:
        """Assign ``saved`` (arrays, the order of :meth:`_saved_variables`) to
        the variables of the layout they fit: the current one, or one saved
        by an older version or another configuration without some of the
        optional trailing blocks (``self._window.blocks``, see
        :func:`accum_optimizer.core.layout.fitting`). State saved without the window's position is
        at ``micro_steps % N`` (:meth:`_forget_position`); without row
        trackers, every row of a restored accumulator that is non-zero is
        marked. Returns the variables assigned.

        Raises:
            ValueError: no layout has as many variables as ``saved``, or a
                shape differs.
        """
        blocks = self._window.blocks
        variables = layout.fitting(self._LAYOUT, self._saved_blocks(), saved)
        if len(saved) != len(variables):
            raise ValueError(
                f"Cannot restore optimizer '{name}': the saved state must hold one array per variable of "
                f"the optimizer's variables (or of an earlier layout's): expected {len(variables)}, received "
                f"{len(saved)}. Was it saved with a different inner optimizer, gradient_accumulation_steps, "
                f"nonfinite policy or model?{self._RESTORE_HINT}"
            )
        assign_all(variables, saved, variable_name)
        restored = {id(v) for v in variables}
        if blocks.get("window") and id(blocks["window"][0]) not in restored:
            self._forget_position()
        trackers = blocks.get("trackers")
        if trackers and id(trackers[-1]) not in restored:
            mark_rows_of_restored_accumulators(self.acc_grads, self._row_trackers)
        return variables

    def _forget_position(self) -> None:
        """After restoring state saved without the window's position (by
        versions before it): mark it unknown, for
        :func:`accum_optimizer.core.resume_position` to derive
        (``micro_steps % N``), now where the family does not resume lazily
        (``_resumes_position``), else at the next micro-step or flush."""
        self.mini_step.assign(core.UNKNOWN_POSITION)
        self.window_weight.assign(0.0)
        if not self._resumes_position:
            with self._outside_functions():
                core.resume_position(self._backend(), self._window_state(), self._rules())

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
        rules = self._rules(self._window.weights_seen)
        return self._window.flush(self._backend(), self._window_state(), rules, replicas,
                                  resumes=self._resumes_position)


def make_window(opt: AccumulatingBase, var_list: Sequence[Any], make: Callable[[layout.Spec, Any], Any]) -> dict:
    """Make the window's variables, in the order of the family's
    :data:`~accum_optimizer.core.layout.BUILDS` entry
    (:func:`~accum_optimizer.core.layout.window_specs`), each by
    ``make(spec, variable)`` (``variable``: the trainable variable of an
    accumulator or tracker, else ``None``), and set them: each counter,
    ``grad_received``, ``mini_step`` and ``window_weight`` as an attribute
    of its name, ``acc_grads`` (build order), the row trackers and the
    optional blocks on the window. Returns what
    :func:`~accum_optimizer.core.layout.collect` gives."""
    var_list = list(var_list)
    specs = layout.window_specs(layout.BUILDS[opt._LAYOUT_NAME], [tuple(v.shape) for v in var_list],
                                core.skip_counters(opt.nonfinite), opt._accumulates)
    state = layout.collect(specs, [make(s, None if s.index is None else var_list[s.index]) for s in specs],
                           len(var_list))
    for spec in specs:
        if spec.index is None:
            setattr(opt, spec.name, state[spec.name])
    opt.acc_grads = [a for a in state["acc_grad"] if a is not None]
    opt._window.row_trackers = state["touched_rows"] if opt._accumulates else []
    for name in opt._window.blocks:
        opt._window.blocks[name] = state["blocks"].get(name, [])
    return state


def mark_rows_of_restored_accumulators(acc_grads: Sequence[Any], trackers: Sequence[Any]) -> None:
    """State saved without row trackers (by a version before them): mark
    every row whose restored accumulator is non-zero, so that the window
    in progress loses nothing when it closes."""
    import numpy as np

    for acc, tracker in zip(acc_grads, trackers):
        if tracker is None:
            continue
        value = np.asarray(acc.numpy())
        touched = np.any(value.reshape(value.shape[0], -1) != 0, axis=1)
        tracker.assign(touched.astype("float16"))


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
