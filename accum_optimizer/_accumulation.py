"""The accumulation algorithm, in one place.

Every adapter (the Keras 3 optimizer in :mod:`accum_optimizer.keras_optimizer`
today; Keras 2, tensorflow-addons and TF1 graph code later) runs the same
micro-step, written here once against a small :class:`StateOps` protocol:

1. ``acc_grads[i] += grads[i]`` for every gradient that is not ``None``
   (a scatter-add for sparse ``tf.IndexedSlices`` gradients, never a
   densification), and ``grad_received[i] = 1`` for those variables.
2. ``micro_steps += 1``.
3. If ``micro_steps % gradient_accumulation_steps == 0`` (the last micro-step of
   a window), hand ``window_gradient(acc_grads[i])`` to the inner optimizer
   once, gated per variable by ``grad_received[i]``, then zero ``acc_grads``
   (:func:`reset`) and ``grad_received``. Otherwise do nothing else: the model weights and
   every inner-optimizer variable stay bitwise untouched.

The names follow optax's ``MultiSteps``: ``acc_grads`` are the accumulator
slots, ``micro_steps`` counts micro-steps (optax's ``mini_step`` is
``micro_steps % gradient_accumulation_steps``), and the inner optimizer's
``iterations`` counts updates (optax's ``gradient_step``).

The functions are pure in the sense that all state lives in the variables
passed in; what "assign" and "cond" mean is the adapter's business, so the
same code runs eagerly, inside ``tf.function``, under XLA and in each replica
of a ``tf.distribute`` strategy.
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol, Sequence

REDUCTIONS = ("mean", "sum")


class StateOps(Protocol):
    """What the algorithm needs from a backend adapter.

    ``assign_add`` must turn a sparse value (``tf.IndexedSlices``) into a
    scatter-add on the variable; that is what keeps sparse accumulation
    sparse. Keras 3's ``Optimizer.assign_add`` does exactly this on the
    TensorFlow backend.
    """

    def assign(self, variable: Any, value: Any) -> None: ...

    def assign_add(self, variable: Any, value: Any) -> None: ...


def validate_gradient_accumulation_steps(value: Any) -> int:
    """Return ``value`` as an ``int`` >= 1 or raise.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` and ``float`` are
            rejected even when integral, since ``True`` or ``4.0`` is almost
            always a mistake).
        ValueError: if ``value`` < 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "`gradient_accumulation_steps` must be a positive int (the number "
            "of micro-steps per update). Received: gradient_accumulation_steps="
            f"{value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(
            "`gradient_accumulation_steps` must be an int >= 1 (1 means no "
            "accumulation). Received: gradient_accumulation_steps="
            f"{value!r}."
        )
    return int(value)


def validate_reduction(value: Any) -> str:
    """Return ``value`` if it is one of :data:`REDUCTIONS`, else raise ValueError."""
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}: 'mean' applies the "
            "average of the window's micro-batch gradients (equivalent to one "
            "batch of N*B samples when the loss is a mean over the batch), "
            "'sum' applies their sum. Received: reduction="
            f"{value!r}."
        )
    return value


def is_update_step(micro_steps: Any, gradient_accumulation_steps: int, ops: Any) -> Any:
    """Boolean scalar: does the micro-step just counted close a window?

    ``micro_steps`` is the count *after* incrementing (int64 scalar tensor).
    ``ops`` is ``keras.ops`` (or any namespace with ``equal`` and ``mod``).
    """
    return ops.equal(ops.mod(micro_steps, gradient_accumulation_steps), 0)


def window_gradient(acc: Any, gradient_accumulation_steps: int, reduction: str, ops: Any) -> Any:
    """The gradient one update applies, from one accumulator slot.

    ``mean``: ``acc / N``. For a loss that is a mean over its micro-batch of B
    samples this is exactly the gradient of the mean loss over the N*B samples
    of the window (micro-steps where the variable had no gradient contribute
    zero, as the missing samples' terms do in the large batch).
    ``sum``: ``acc``, the recipe of summing micro-batch gradients.
    """
    if reduction == "sum" or gradient_accumulation_steps == 1:
        return acc
    return ops.divide(acc, ops.cast(gradient_accumulation_steps, acc.dtype))


def accumulate(
    state_ops: StateOps,
    acc_grads: Sequence[Any],
    grads: Sequence[Any],
) -> None:
    """Step 1: ``acc_grads[i] += grads[i]`` for each gradient that is not None."""
    for acc, grad in zip(acc_grads, grads):
        if grad is not None:
            state_ops.assign_add(acc, grad)


def received_mask(grads: Sequence[Any]) -> list[int]:
    """Which variables got a gradient this micro-step (a trace-time constant)."""
    return [0 if g is None else 1 for g in grads]


def count_micro_step(
    state_ops: StateOps,
    micro_steps: Any,
    grad_received: Any,
    mask: Sequence[int],
    ops: Any,
) -> None:
    """Step 2: ``micro_steps += 1`` and ``grad_received |= mask``."""
    state_ops.assign_add(micro_steps, ops.cast(1, micro_steps.dtype))
    if all(mask):
        state_ops.assign(grad_received, ops.ones_like(grad_received))
    elif any(mask):
        state_ops.assign(
            grad_received,
            ops.maximum(grad_received, ops.convert_to_tensor(mask, dtype=grad_received.dtype)),
        )


def runtime_zero(micro_steps: Any, ops: Any) -> Any:
    """A scalar 0 that graph optimizers cannot fold into a constant.

    ``assign(acc, zeros(shape))`` with a constant 0 gets constant-folded by
    TensorFlow's graph optimizer into a constant as large as the accumulator,
    which the traced function then keeps alive: one more copy of the
    parameters, resident for good (measured on a 244 MiB embedding table).
    ``max(min(micro_steps, 0), 0)`` is 0 for every integer but is only known
    when the step runs.
    """
    return ops.maximum(ops.minimum(micro_steps, 0), 0)


def reset(state_ops: StateOps, acc_grads: Sequence[Any], zero: Any, ops: Any) -> None:
    """Step 3b: zero the accumulator slots (``zero`` from :func:`runtime_zero`)."""
    for acc in acc_grads:
        state_ops.assign(acc, ops.full(acc.shape, ops.cast(zero, acc.dtype)))


