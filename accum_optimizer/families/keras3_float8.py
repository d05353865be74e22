"""Float8 training under the Keras 3 wrapper (``model.quantize("float8")``).

A float8 layer's scales and amax histories are variables with
``overwrite_with_gradient=True``: Keras overwrites them with their
"gradient" (a new value), outside ``update_step``. Across a window:

* they are combined by element-wise maximum (:func:`combine`: the window's
  maximum is the large batch's) and overwritten once per update;
* one without a value in the window keeps its own (:func:`kept_values`:
  Keras' overwrite runs past the gates);
* the loss of each micro-batch is divided by the window's N
  (:func:`scaled`, from ``scale_loss``), so that the output gradients the
  float8 layers record are in the large batch's units; the next ``apply``
  multiplies the other gradients back by N (:func:`unscaled`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import keras

from accum_optimizer import core, counting

_LOSS_SCALED = threading.local()
"""``record``: (the optimizer, the graph) of the last :func:`scaled` that
divided by N, until its ``apply`` takes it (:func:`unscaled`)."""


def overwritten(variable: Any) -> bool:
    """Does Keras overwrite ``variable`` with its gradient (float8 state)?"""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def window_length(opt: Any) -> Any:
    """N of ``opt``'s current window (int, or an int tensor under a
    schedule) if :func:`scaled` divides by it: built, accumulating,
    ``reduction="mean"`` and some float8 state; else ``None``."""
    if not (opt.built and opt._accumulates and opt.reduction == "mean"):
        return None
    if not any(overwritten(v) for v in opt._build_order):
        return None
    return core.window_length(opt._backend(), opt._rules(), opt._window_state())


def scaled(opt: Any, loss: Any) -> Any:
    """``loss`` (a scalar tensor) divided by the window's N where
    :func:`window_length` gives one (recorded for the next ``apply``), else
    ``loss``."""
    steps = window_length(opt)
    if steps is None:
        return loss
    _LOSS_SCALED.record = (weakref.ref(opt), counting._graph())
    return keras.ops.divide(loss, keras.ops.cast(steps, loss.dtype))


def unscaled(opt: Any, grads: list, variables: Sequence[Any]) -> list:
    """``grads`` multiplied back by the N that :func:`scaled` divided this
    train step's loss by (same thread and graph; taken once), float8 state
    excepted (a value, not a gradient); ``grads`` as they are otherwise."""
    record = getattr(_LOSS_SCALED, "record", None)
    if record is None or record[0]() is not opt or not any(record[1] is g for g in counting._graphs()):
        return grads
    _LOSS_SCALED.record = None
    steps = window_length(opt)
    if steps is None:
        return grads
    b = opt._backend()
    return [g if g is None or overwritten(v) else b.scale(g, steps) for g, v in zip(grads, variables)]


def combine(variables: Sequence[Any]) -> list | None:
    """``WindowState.combine``: ``"max"`` for float8 state, ``"reduction"``
    for the rest, if ``variables`` hold any float8 state; else ``None``."""
    rule = ["max" if overwritten(v) else "reduction" for v in variables]
    return rule if "max" in rule else None


def kept_values(window_grads: list, gates: dict, variables: Sequence[Any]) -> list:
    """The window's gradients, where a float8 state variable had no value in
    the window (its gate false), its own value instead."""
    window_grads = list(window_grads)
    for i, gate in gates.items():
        v = variables[i]
        if overwritten(v):
            window_grads[i] = keras.ops.where(gate, window_grads[i], v.value)
    return window_grads
