"""The route of the Keras 3 wrapper on JAX and torch: the window written
with ``keras.ops`` and ``keras.Variable.assign``, no TensorFlow.

Keras 3 runs an optimizer two ways, and so does this route:

* **Stateless** (JAX: ``model.fit`` and custom ``jax.jit`` loops call
  ``optimizer.stateless_apply(optimizer_variables, grads,
  trainable_variables)``): every write happens inside a
  ``keras.StatelessScope``, which records the new values. The window's
  ``cond`` (:meth:`KerasOpsBackend.cond`) is one ``keras.ops.cond``
  (``jax.lax.cond``) whose branches each run in their own
  ``StatelessScope`` and return the full state (the model's trainable
  variables, this optimizer's and the inner optimizer's), as Keras'
  ``LossScaleOptimizer.stateless_apply`` does. Only the branch taken runs:
  the inner update is not computed on accumulate-only micro-steps (Keras'
  built-in accumulation on JAX computes it on every micro-step and selects
  the old values afterwards, ``keras/src/backend/jax/optimizer.py``).
* **Stateful** (torch, and eager JAX: ``optimizer.apply(grads)``): the
  writes go to the variables at once, and ``cond`` is a Python ``if`` on
  the predicate's value. On torch that reads one boolean from the device
  per ``cond`` (a host synchronisation; Keras' own ``ops.cond`` on torch
  is the same Python ``if``).

The algorithm is :mod:`accum_optimizer.core`; what does not depend on the
framework is :mod:`accum_optimizer.families._accumulating`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import keras
from keras import ops

from accum_optimizer import core
from accum_optimizer.families import _accumulating
from accum_optimizer.families._accumulating import (
    shape_mismatch,
    variable_name,
    weight_shape_error,
    weight_type_error,
    weight_value_error,
)


def unconverted(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method as it is (AutoGraph, which :func:`accum_optimizer.families._tf2.unconverted`
    keeps out on TensorFlow, is TensorFlow's)."""
    return method


def is_traced(value: Any) -> bool:
    """Is ``value`` a value being traced (JAX under ``jit``/``grad``), whose
    content is known only when the step runs?"""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return isinstance(value, jax.core.Tracer)


def check_when_run(ok: Any, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` if the boolean scalar ``ok`` is false: at once for a
    concrete value; for a traced one (JAX), when the step runs, from a host
    callback (the step then fails with the message, and its new state is
    never committed)."""
    if not is_traced(ok):
        if not bool(ops.convert_to_numpy(ok)):
            raise error()
        return
    import jax

    def check(value: Any) -> None:
        if not bool(value):
            raise error()

    jax.debug.callback(check, ok)


def check_weight(weight: Any) -> Any:
    """Check a micro-step's ``weight`` (its count ``c``); return it as a
    float32 scalar, or ``None`` for ``None``. A concrete value is checked at
    once; a traced one (inside ``jax.jit``) when the step runs.

    Raises:
        TypeError: not a real number or numeric tensor.
        ValueError: not a scalar; negative, NaN or infinite.
    """
    if weight is None:
        return None
    bad_type = weight_type_error(weight)
    if isinstance(weight, (bool, str, bytes)):
        raise bad_type
    try:
        value = ops.convert_to_tensor(weight)
        dtype = keras.backend.standardize_dtype(value.dtype)
    except (TypeError, ValueError):
        raise bad_type from None
    if dtype == "bool" or not (keras.backend.is_float_dtype(dtype) or keras.backend.is_int_dtype(dtype)):
        raise bad_type
    if len(value.shape) != 0:
        raise weight_shape_error(tuple(value.shape))
    value = ops.cast(value, "float32")
    check_when_run(
        ops.logical_and(ops.isfinite(value), ops.greater_equal(value, 0.0)),
        lambda: weight_value_error("a traced value" if is_traced(weight) else weight),
    )
    return value


_STANDARD: dict = {}


def _standard(dtype: Any) -> str:
    """``keras.backend.standardize_dtype``, remembered per dtype (it parses
    a name on every call: a few microseconds, per variable per micro-step)."""
    try:
        return _STANDARD[dtype]
    except KeyError:
        _STANDARD[dtype] = name = keras.backend.standardize_dtype(dtype)
        return name
    except TypeError:  # unhashable
        return keras.backend.standardize_dtype(dtype)


def _tensor(value: Any) -> Any:
    """``value`` as a backend tensor (as it is if it is one)."""
    return value if ops.is_tensor(value) else ops.convert_to_tensor(value)


def _torch_no_grad() -> Any:
    import torch

    return torch.no_grad


_TORCH = keras.backend.backend() == "torch"
_IN_PLACE = {"assign": "copy_", "assign_add": "add_", "assign_sub": "sub_"}


def _available(dtype: Any) -> Any:
    """``dtype``, or int32 for int64 on JAX without 64-bit types (its
    default: what Keras' own integer variables hold there; asking for int64
    would only warn and truncate)."""
    if dtype == "int64" and keras.backend.backend() == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            return "int32"
    return dtype


class KerasOpsBackend:
    """:class:`~accum_optimizer.core.state.Backend` over ``keras.Variable`` s
    with ``keras.ops``, for the JAX and torch backends (dense gradients only:
    Keras 3 has no sparse gradients there).

    Args:
        apply_inner: ``apply_inner(window_grads, gates)``, the family's one
            call of its inner optimizer.
        state: returns every variable a ``cond`` branch may write (the
            model's trainable variables, the wrapper's and the inner
            optimizer's): what a traced ``cond`` threads through its branches.
        writer: the optimizer whose ``assign(variable, value)`` and
            ``assign_add(variable, value)`` make every write (the wrapper:
            Keras' optimizers write through their own ``assign*``).
    """

    def __init__(self, apply_inner: Callable[[list, dict], Any], state: Callable[[], Sequence[Any]],
                 writer: Any) -> None:
        self._apply_inner = apply_inner
        self._state = state
        self._writer = writer

    # -- the family's variables and inner optimizer
    def assign(self, variable: Any, value: Any) -> Any:
        self._writer.assign(variable, value)

    def assign_add(self, variable: Any, value: Any) -> Any:
        self._writer.assign_add(variable, value)

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """``true_fn()`` if ``pred`` else ``false_fn()``, for branches that
        write variables. A concrete ``pred`` (torch, eager JAX): a Python
        ``if``. A traced one (JAX): one ``keras.ops.cond`` whose branches each
        run in a ``keras.StatelessScope`` seeded with the current values of
        the whole state and return the new values of all of it, which are
        then assigned here (into the enclosing ``StatelessScope``)."""
        if not is_traced(pred):
            true_fn() if bool(ops.convert_to_numpy(pred)) else false_fn()
            return None
        state = list(self._state())
        current = [v.value for v in state]

        def branch(fn: Callable[[], Any]) -> Callable[[], list]:
            def run() -> list:
                with keras.StatelessScope(state_mapping=list(zip(state, current))) as scope:
                    fn()
                return [scope.get_current_value(v) for v in state]

            return run

        for variable, value in zip(state, ops.cond(pred, branch(true_fn), branch(false_fn))):
            self._writer.assign(variable, value)
        return None

    def apply_inner(self, window_grads: list, gates: dict) -> Any:
        return self._apply_inner(window_grads, gates)

    def after(self, values: Any) -> Any:
        # Writes happen in program order (torch, eager JAX) or are threaded
        # through the StatelessScope in that order (traced JAX).
        return contextlib.nullcontext()

    # -- values
    @staticmethod
    def read(variable: Any) -> Any:
        return ops.convert_to_tensor(variable)

    @staticmethod
    def cast(value: Any, dtype: Any) -> Any:
        return ops.cast(value, _available(dtype))

    @staticmethod
    def dtype(value: Any) -> Any:
        return _standard(value.dtype)

    @staticmethod
    def constant(value: Any, dtype: Any) -> Any:
        return ops.convert_to_tensor(value, dtype=_available(dtype))

    @staticmethod
    def maximum(x: Any, y: Any) -> Any:
        return ops.maximum(ops.convert_to_tensor(x), y)

    where = staticmethod(ops.where)
    equal = staticmethod(ops.equal)
    greater = staticmethod(ops.greater)
    greater_equal = staticmethod(ops.greater_equal)
    less = staticmethod(ops.less)
    logical_and = staticmethod(ops.logical_and)
    floormod = staticmethod(ops.mod)  # floored, Python's %: the sign of the divisor
    divide = staticmethod(ops.divide)

    @staticmethod
    def ones_like(variable: Any) -> Any:
        return ops.ones(tuple(variable.shape), dtype=variable.dtype)

    @staticmethod
    def zeros_like(variable: Any) -> Any:
        return ops.zeros(tuple(variable.shape), dtype=variable.dtype)

    @staticmethod
    def reduce_max(x: Any) -> Any:
        return ops.max(x)

    def fill_like(self, variable: Any, value: Any) -> Any:
        return ops.full(tuple(variable.shape), ops.cast(value, variable.dtype), dtype=variable.dtype)

    def unfoldable_zero(self, counter: Any) -> Any:
        # (TensorFlow's graph optimizer folds a constant zero the size of an
        # accumulator into a resident constant; XLA and torch do not.)
        return ops.convert_to_tensor(0, dtype=self.dtype(counter))

    def piecewise(self, x: Any, boundaries: Sequence[int], values: Sequence[int]) -> Any:
        bounds = ops.convert_to_tensor(list(boundaries), dtype=self.dtype(x))
        position = ops.sum(ops.cast(ops.less_equal(bounds, x), "int32")) - 1
        return ops.take(ops.convert_to_tensor(list(values), dtype=self.dtype(x)), position)

    def checked_positive(self, value: Any, message: str) -> Any:
        check_when_run(ops.greater_equal(value, 1), lambda: ValueError(message))
        return value

    # -- gradients
    def all_finite(self, grads: Sequence[Any]) -> Any:
        flags = [ops.all(ops.isfinite(g)) for g in grads if g is not None]
        if not flags:
            return ops.convert_to_tensor(True)
        return ops.all(ops.stack(flags)) if len(flags) > 1 else flags[0]

    def scale(self, grad: Any, weight: Any) -> Any:
        return ops.multiply(grad, ops.cast(weight, grad.dtype))

    def cast_gradient(self, grad: Any, dtype: Any) -> Any:
        if dtype is None or grad is None or self.dtype(grad) == _standard(dtype):
            return grad
        return ops.cast(grad, dtype)

    def is_sparse(self, grad: Any) -> bool:
        return False

    def _no_sparse(self, *args: Any) -> Any:  # pragma: no cover - is_sparse is always False
        raise NotImplementedError(f"Keras 3 on {keras.backend.backend()} has no sparse gradients.")

    sparse_indices = touched = gather_rows = sparse = fill_rows_like = scatter_update = _no_sparse


class DeviceBackend(KerasOpsBackend):
    """:class:`KerasOpsBackend` for accumulators with one slice per device
    (shape ``(devices, *variable.shape)``, sharded over the batch axis of a
    ``keras.distribution`` mesh: :class:`accum_optimizer.OneReductionPerWindow`).
    Each micro-step adds each device's own partial gradient into its slice
    (no communication); the update reads the slices' sum (one all-reduce,
    inside the update's branch) or, for ``"max"`` state, their maximum."""

    @staticmethod
    def read_window(acc: Any, combine: str) -> Any:
        value = ops.convert_to_tensor(acc)
        return ops.max(value, axis=0) if combine == "max" else ops.sum(value, axis=0)


class Accumulating(_accumulating.Accumulating):
    """The JAX and torch route of the Keras 3 wrapper (see the module)."""

    def _device_count(self) -> int | None:
        """The devices of the per-device accumulators (``use_device_accumulators``), else ``None``."""
        devices = self._window.context.get("device_accumulators")
        return None if devices is None else devices[1]

    def _check_weight(self, weight: Any) -> Any:
        return check_weight(weight)

    def _state_variables(self) -> list:
        return list(self._build_order) + list(self.variables)

    def _backend(self) -> KerasOpsBackend:
        kind = KerasOpsBackend if self._device_count() is None else DeviceBackend
        return kind(self._apply_inner, self._state_variables, self)

    # Every write of the window goes through these (Keras' optimizers write
    # through their own `assign*`, which Keras' tests patch). On torch they
    # write the variable's tensor in place (one pass, no new tensor, none of
    # keras.Variable.assign's checks per write), as Keras' own torch
    # optimizers do (torch._foreach_add_ on v.value); elsewhere Keras'.
    def _write(self, method: str, variable: Any, value: Any) -> None:
        if _TORCH:
            with _torch_no_grad()():
                getattr(variable.value, _IN_PLACE[method])(_tensor(value))
            return
        getattr(super(), method)(variable, ops.cast(value, variable.dtype))

    def assign(self, variable: Any, value: Any) -> None:
        """``variable = value`` (cast to the variable's dtype)."""
        self._write("assign", variable, value)

    def assign_add(self, variable: Any, value: Any) -> None:
        """``variable += value`` (cast to the variable's dtype)."""
        self._write("assign_add", variable, value)

    def assign_sub(self, variable: Any, value: Any) -> None:
        """``variable -= value`` (cast to the variable's dtype)."""
        self._write("assign_sub", variable, value)

    def _gate_cond(self) -> Callable[[Any, Callable[[], Any], Callable[[], Any]], Any]:
        return self._backend().cond

    def _open_gates(self, gates: dict) -> dict | None:
        # torch and eager JAX: the gates are values (read with one host
        # synchronisation); under jax.jit they are traced, and gated by cond.
        if any(is_traced(g) for g in gates.values()):
            return None
        opened = ops.convert_to_numpy(ops.stack([ops.convert_to_tensor(g) for g in gates.values()]))
        if not opened.any() and len(gates) == len(self._build_order):
            return None  # (no variable to update: never on a window that holds a micro-step)
        return {i: bool(o) for i, o in zip(gates, opened)}

    def _checked_gradients(self, grads: Sequence[Any], variables: list) -> list:
        checked = []
        devices = self._device_count()
        lead = () if devices is None else (devices,)
        for g, v in zip(grads, variables):
            if g is not None:
                if not ops.is_tensor(g):
                    g = ops.convert_to_tensor(g, dtype=v.dtype)
                if tuple(g.shape) != lead + tuple(v.shape):
                    raise shape_mismatch(tuple(g.shape), lead + tuple(v.shape), variable_name(v))
            checked.append(g)
        return checked

    def _pass_through(self, grads: list, variables: list, weight: Any) -> Any:
        if self._device_count() is not None:  # (N = 1: each micro-step is its own window)
            grads = [None if g is None else ops.sum(g, axis=0) for g in grads]
        return super()._pass_through(grads, variables, weight)

    def _enter_window(self, grads: list, weight: Any = None) -> Any:
        # One program for every device (JAX's SPMD under keras.distribution):
        # one replica, whose gradients XLA has already reduced (or, with
        # per-device accumulators, each device's partial gradient, reduced
        # once at the update: DeviceBackend.read_window).
        return self._micro_step(grads, core.ONE_REPLICA, weight)

    def _record_skipped_micro_step(self) -> None:
        self._micro_step([None] * len(self._build_order), core.ONE_REPLICA, finite=False)

    # -- what the TF route does with tf.distribute, here nothing
    def _remember_strategy(self) -> None:
        pass

    def _check_strategy_at_build(self) -> None:
        pass

    def _outside_functions(self) -> Any:
        return contextlib.nullcontext()

    def _colocated_with(self, reference: Any) -> Any:
        return contextlib.nullcontext()

    def _build_for_loading(self, model: Any) -> None:
        model.optimizer.build(model.trainable_variables)

    # ------------------------------------------------------------ stateless
    def _stateless(self, run: Callable[[], Any], optimizer_variables: Sequence[Any],
                   trainable_variables: Sequence[Any], what: str) -> tuple[list, list]:
        if not self.built:
            raise ValueError(
                f"To call `{what}`, {type(self).__name__} must be built (its variables "
                "created): call `optimizer.build(trainable_variables)` first."
            )
        variables, order = list(self.variables), list(self._build_order)
        for given, expected, argument, of in (
            (optimizer_variables, variables, "optimizer_variables", "optimizer.variables"),
            (trainable_variables, order, "trainable_variables", "the variables the optimizer was built with"),
        ):
            if len(given) != len(expected):
                raise ValueError(
                    f"`{argument}` must hold one value per entry of {of} ({len(expected)}); "
                    f"received {len(given)}."
                )
        mapping = list(zip(order, trainable_variables)) + list(zip(variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            run()
        return [scope.get_current_value(v) for v in order], [scope.get_current_value(v) for v in variables]

    def stateless_apply(self, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                        trainable_variables: Sequence[Any], weight: Any = None) -> tuple[list, list]:
        """One micro-step without touching any variable (JAX ``jit`` code):
        :meth:`apply` on the given values.

        Args:
            optimizer_variables: one array per entry of :attr:`variables`.
            grads: one gradient (or ``None``) per trainable variable, in the
                order the optimizer was built with.
            trainable_variables: one array per trainable variable, same order.
            weight: the micro-batch's count (see :meth:`apply`).

        Returns:
            ``(trainable_variables, optimizer_variables)``, their new values.
            Between updates the trainable values and the inner optimizer's
            come back unchanged.

        Raises:
            ValueError: not built; a list has the wrong length; as :meth:`apply`.
        """
        return self._stateless(
            lambda: self.apply(grads, weight=weight), optimizer_variables, trainable_variables, "stateless_apply"
        )

    def stateless_flush(self, optimizer_variables: Sequence[Any],
                        trainable_variables: Sequence[Any]) -> tuple[list, list]:
        """:meth:`flush` on the given values (JAX ``jit`` code); returns
        ``(trainable_variables, optimizer_variables)`` as
        :meth:`stateless_apply` does."""
        return self._stateless(self.flush, optimizer_variables, trainable_variables, "stateless_flush")

    def flush(self) -> None:
        """The partial window, if any, applied now as one update divided by
        its own count (never by N), as on TensorFlow: ``iterations`` + 1,
        ``micro_steps`` unchanged, ``mini_step`` back to 0. Writes the
        variables, so call it where they hold the state: ``model.fit``'s
        callbacks (``accum_optimizer.FlushPartialWindow`` at each epoch's
        end), a torch loop, eager JAX. In a JAX ``jit`` function use
        :meth:`stateless_flush`.

        Raises:
            ValueError: called before the optimizer is built.
        """
        if not self._accumulates:
            return None
        self._check_flushable()
        self._flush_window(core.ONE_REPLICA)
        return None
