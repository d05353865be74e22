"""A reference :class:`~accum_optimizer.core.state.Backend` in NumPy, to run
the framework-free core (:mod:`accum_optimizer.core`) without a framework.

* :class:`Variable`: a mutable variable, a small wrapper over an ``np.ndarray``
  (its shape and dtype fixed at creation, as a framework variable's).
* :class:`Sparse`: a sparse gradient (``values`` at the first-axis rows
  ``indices`` of a ``dense_shape`` tensor), as ``tf.IndexedSlices``.
* :class:`NumpyBackend`: every method of the protocol, eagerly: ``cond`` is a
  Python ``if``, ``after`` orders nothing (NumPy runs each op when called).
* :class:`RecordingSGD`: the inner optimizer, ``param -= lr·grad`` per
  variable whose gate is open, counting updates in ``iterations``; it records
  the window gradients and gates of every call.
* :func:`make_window`: a :class:`~accum_optimizer.core.state.WindowState`
  over such variables, with the fields its rules need.

Imports NumPy and ``accum_optimizer.core`` only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from accum_optimizer.core import Rules, WindowState, skip_counters


class Variable:
    """A mutable array of fixed shape and dtype (``value``: its ``np.ndarray``)."""

    def __init__(self, value: Any, dtype: Any = None) -> None:
        self.value = np.array(value, dtype=dtype)

    @property
    def shape(self) -> tuple:
        return self.value.shape

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    def set(self, value: Any) -> None:
        """``self = value`` in its own dtype (``value`` broadcast to its shape)."""
        self.value = np.array(np.broadcast_to(np.asarray(value).astype(self.dtype), self.shape))

    def __repr__(self) -> str:
        return f"Variable({self.value!r})"


class Sparse(NamedTuple):
    """A sparse gradient: ``values[k]`` is row ``indices[k]`` (rows may repeat:
    they add) of a tensor of shape ``dense_shape``."""

    values: np.ndarray
    indices: np.ndarray
    dense_shape: tuple

    def dense(self) -> np.ndarray:
        out = np.zeros(self.dense_shape, self.values.dtype)
        np.add.at(out, self.indices, self.values)
        return out


def array(x: Any) -> np.ndarray:
    """A variable's value, or ``x`` as an array."""
    return x.value if isinstance(x, Variable) else np.asarray(x)


def _values(grad: Any) -> np.ndarray:
    return grad.values if isinstance(grad, Sparse) else np.asarray(grad)


class NumpyBackend:
    """:class:`~accum_optimizer.core.state.Backend` over :class:`Variable` s.

    Args:
        apply_inner: ``apply_inner(window_grads, gates)``, the inner
            optimizer's one call per update (:meth:`RecordingSGD.apply`).
    """

    def __init__(self, apply_inner: Callable[[list, dict], Any]) -> None:
        self._apply_inner = apply_inner

    # -- the family's variables and inner optimizer
    def assign(self, variable: Variable, value: Any) -> None:
        variable.set(array(value))

    def assign_add(self, variable: Variable, value: Any) -> None:
        if isinstance(value, Sparse):
            np.add.at(variable.value, np.asarray(value.indices), value.values.astype(variable.dtype))
        else:
            variable.set(variable.value + np.asarray(value).astype(variable.dtype))

    def scatter_update(self, variable: Variable, indices: Any, updates: Any) -> None:
        variable.value[np.asarray(indices)] = np.asarray(updates).astype(variable.dtype)

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        return true_fn() if bool(array(pred)) else false_fn()

    def apply_inner(self, window_grads: list, gates: dict) -> Any:
        return self._apply_inner(window_grads, gates)

    def after(self, values: Any) -> Any:
        return contextlib.nullcontext()

    # -- values
    def read(self, variable: Any) -> np.ndarray:
        return np.array(array(variable))  # a copy: later writes do not change it

    def cast(self, value: Any, dtype: Any) -> np.ndarray:
        return array(value).astype(dtype)

    def dtype(self, value: Any) -> np.dtype:
        return array(value).dtype

    def constant(self, value: Any, dtype: Any) -> np.ndarray:
        return np.array(value, dtype=dtype)

    def add(self, x: Any, y: Any) -> np.ndarray:
        return np.add(array(x), array(y))

    def equal(self, x: Any, y: Any) -> np.ndarray:
        return np.equal(array(x), array(y))

    def greater(self, x: Any, y: Any) -> np.ndarray:
        return np.greater(array(x), array(y))

    def greater_equal(self, x: Any, y: Any) -> np.ndarray:
        return np.greater_equal(array(x), array(y))

    def less(self, x: Any, y: Any) -> np.ndarray:
        return np.less(array(x), array(y))

    def logical_and(self, x: Any, y: Any) -> np.ndarray:
        return np.logical_and(array(x), array(y))

    def maximum(self, x: Any, y: Any) -> np.ndarray:
        return np.maximum(array(x), array(y))

    def where(self, pred: Any, x: Any, y: Any) -> np.ndarray:
        return np.where(array(pred), array(x), array(y))

    def reduce_max(self, x: Any) -> np.ndarray:
        return np.max(array(x))

    def floormod(self, x: Any, y: Any) -> np.ndarray:
        return np.mod(array(x), y)

    def divide(self, x: Any, y: Any) -> np.ndarray:
        return np.true_divide(array(x), array(y))

    def ones_like(self, variable: Any) -> np.ndarray:
        return np.ones_like(array(variable))

    def zeros_like(self, variable: Any) -> np.ndarray:
        return np.zeros_like(array(variable))

    def fill_like(self, variable: Any, value: Any) -> np.ndarray:
        return np.full(array(variable).shape, value, array(variable).dtype)

    def unfoldable_zero(self, counter: Any) -> np.ndarray:
        return array(counter) * 0

    def piecewise(self, x: Any, boundaries: Sequence[int], values: Sequence[int]) -> np.ndarray:
        position = int(np.sum(np.asarray(boundaries) <= array(x))) - 1
        if position < 0:
            raise ValueError(f"piecewise: x={x} is below the first boundary {boundaries[0]}")
        return np.int64(values[position])

    def checked_positive(self, value: Any, message: str) -> np.ndarray:
        if not array(value) >= 1:
            raise ValueError(f"{message} (got {value})")
        return array(value)

    # -- gradients
    def all_finite(self, grads: Sequence[Any]) -> np.ndarray:
        return np.bool_(all(np.isfinite(_values(g)).all() for g in grads if g is not None))

    def scale(self, grad: Any, weight: Any) -> Any:
        if isinstance(grad, Sparse):
            return grad._replace(values=grad.values * array(weight).astype(grad.values.dtype))
        return grad * array(weight).astype(grad.dtype)

    def cast_gradient(self, grad: Any, dtype: Any) -> Any:
        if grad is None or dtype is None:
            return grad
        if isinstance(grad, Sparse):
            return grad._replace(values=grad.values.astype(dtype))
        return np.asarray(grad).astype(dtype)

    def is_sparse(self, grad: Any) -> bool:
        return isinstance(grad, Sparse)

    def sparse_indices(self, grad: Sparse) -> np.ndarray:
        return np.asarray(grad.indices)

    def touched(self, tracker: Any) -> np.ndarray:
        return np.flatnonzero(array(tracker) > 0).astype(np.int64)

    def gather_rows(self, variable: Any, rows: Any) -> np.ndarray:
        return np.array(array(variable)[np.asarray(rows)])

    def sparse(self, values: Any, rows: Any, like: Any) -> Sparse:
        return Sparse(np.asarray(values), np.asarray(rows), array(like).shape)

    def fill_rows_like(self, variable: Any, rows: Any, value: Any) -> np.ndarray:
        shape = (len(np.asarray(rows)),) + array(variable).shape[1:]
        return np.full(shape, value, array(variable).dtype)


class RecordingSGD:
    """The inner optimizer: ``param -= lr·grad`` (a sparse gradient: on its
    rows) for each variable whose gate is open, then ``iterations += 1``.

    Attributes:
        params: the model's variables (float32).
        iterations: int64 scalar :class:`Variable`, updates made (units: updates).
        calls: per call, ``(window_grads, gates)``: copies of the window
            gradients (arrays, or :class:`Sparse`) and the gates as Python bools.
    """

    def __init__(self, params: Sequence[Variable], lr: float = 1.0) -> None:
        self.params = list(params)
        self.lr = np.float32(lr)
        self.iterations = Variable(0, np.int64)
        self.calls: list = []

    def apply(self, window_grads: list, gates: dict) -> None:
        gates = {i: bool(array(g)) for i, g in gates.items()}
        self.calls.append(([g if isinstance(g, Sparse) else np.array(g) for g in window_grads], gates))
        for i, (param, grad) in enumerate(zip(self.params, window_grads)):
            if not gates.get(i, True):
                continue
            if isinstance(grad, Sparse):
                np.subtract.at(param.value, grad.indices, self.lr * grad.values.astype(param.dtype))
            else:
                param.set(param.value - self.lr * np.asarray(grad).astype(param.dtype))
        self.iterations.set(self.iterations.value + 1)


class Window(NamedTuple):
    """What :func:`make_window` builds: ``b``, ``state``, ``rules``, ``inner``."""

    b: NumpyBackend
    state: WindowState
    rules: Rules
    inner: RecordingSGD


def make_window(
    shapes: Sequence[tuple],
    rules: Rules,
    *,
    tracked: Sequence[bool] | None = None,
    combine: Sequence[str] | None = None,
    sparse_update: Sequence[bool] | None = None,
    accumulator_dtype: Any = np.float32,
    variable_dtype: Any = np.float32,
    lr: float = 1.0,
) -> Window:
    """A fresh window over zero-initialised float parameters of ``shapes``:
    float accumulators (``accumulator_dtype``), int64 counters, a float32
    ``window_weight``, the skip counters and ``updates`` its ``rules`` need,
    and a row tracker ``(shape[0],)`` for each variable ``tracked``."""
    params = [Variable(np.zeros(s), variable_dtype) for s in shapes]
    inner = RecordingSGD(params, lr)
    state = WindowState(
        acc_grads=[Variable(np.zeros(s), accumulator_dtype) for s in shapes],
        micro_steps=Variable(0, np.int64),
        grad_received=Variable(np.zeros(len(shapes)), np.int64),
        mini_step=Variable(0, np.int64),
        window_weight=Variable(0, np.float32),
        updates=inner.iterations,
        touched_rows=None if tracked is None else [
            Variable(np.zeros(s[0]), np.float32) if t else None for s, t in zip(shapes, tracked)
        ],
        sparse_update=sparse_update,
        variable_dtypes=None if accumulator_dtype == variable_dtype else [np.dtype(variable_dtype)] * len(shapes),
        combine=combine,
        **{name: Variable(0, np.int64) for name in skip_counters(rules.nonfinite)},
    )
    return Window(NumpyBackend(inner.apply), state, rules, inner)
