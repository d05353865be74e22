"""The window algorithm's :class:`~accum_optimizer.core.state.Backend` in
``keras.ops``, for Keras 3 on JAX and torch (no TensorFlow), and the checks
of that route (:mod:`accum_optimizer.families._keras_ops_route`).

* :class:`KerasOpsBackend`: writes through the wrapper's ``assign*`` (Keras'
  optimizers write through their own), ``cond`` as ``keras.ops.cond`` whose
  branches return the full state under a ``StatelessScope`` (JAX), or a
  Python ``if`` on the predicate's value (torch, eager JAX);
* :class:`DeviceBackend`: the same with one accumulator slice per device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import keras
from keras import ops

from accum_optimizer.families._accumulating import (
    weight_shape_error,
    weight_type_error,
    weight_value_error,
)


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


def torch_tensor(value: Any) -> Any:
    """``value`` as a backend tensor (as it is if it is one)."""
    return value if ops.is_tensor(value) else ops.convert_to_tensor(value)


def torch_no_grad() -> Any:
    import torch

    return torch.no_grad


ON_TORCH = keras.backend.backend() == "torch"
IN_PLACE = {"assign": "copy_", "assign_add": "add_", "assign_sub": "sub_"}


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
    add = staticmethod(ops.add)
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
