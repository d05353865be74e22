"""What the Keras families' ``model.fit`` tools share (Keras 3:
:mod:`~accum_optimizer.families.keras3_fit`; Keras 2, both families:
:mod:`~accum_optimizer.families.keras2_fit`): the flush at epoch end of
``FlushPartialWindow``, a mixin placed before the Keras package's
``Callback``; how ``CountedLoss`` resolves its loss and merges the masks.
The count a ``CountedLoss`` reports is
:func:`accum_optimizer.counting.micro_batch_count`. No Keras import.
"""

from __future__ import annotations

from typing import Any, Callable


class FlushAtEpochEnd:
    """``FlushPartialWindow``'s hooks: flush before the epoch's validation
    (``on_test_begin`` inside ``fit``), else at ``on_epoch_end``; once per
    epoch. Finds the ``AccumulatingOptimizer`` (of any family) as
    ``model.optimizer`` or its ``inner_optimizer`` (a ``LossScaleOptimizer``
    around it)."""

    def __init__(self) -> None:
        super().__init__()
        self._in_fit = False
        self._flushed = False

    def on_train_begin(self, logs: Any = None) -> None:
        self._optimizer()
        self._in_fit = True

    def on_train_end(self, logs: Any = None) -> None:
        self._in_fit = False

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._flushed = False

    def on_test_begin(self, logs: Any = None) -> None:
        if self._in_fit:
            self._flush()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._flush()

    def _flush(self) -> None:
        opt = self._optimizer()
        if not self._flushed and opt._window_built():  # (unbuilt: no step taken, no window)
            self._flushed = True
            self._run_flush(opt)

    def _run_flush(self, opt: Any) -> None:
        """Flush ``opt`` (the family's callback may run it otherwise)."""
        opt.flush()

    def _optimizer(self) -> Any:
        from accum_optimizer import AccumulatingOptimizer

        opt = self.model.optimizer
        for candidate in (opt, getattr(opt, "inner_optimizer", None)):
            if isinstance(candidate, AccumulatingOptimizer):
                return candidate
        raise ValueError(
            "FlushPartialWindow needs a model compiled with an AccumulatingOptimizer "
            f"(or a LossScaleOptimizer around one). The model's optimizer is {opt!r}."
        )


def resolve_loss(loss: Any, reduction: str | None, loss_class: type, get: Callable[[Any], Any],
                 wrap: Callable[..., Any], default_reduction: str, package: str) -> Any:
    """``CountedLoss``'s inner loss: ``loss`` itself (a ``loss_class``), what
    ``get`` resolves an identifier to, or a function wrapped by ``wrap(fn,
    reduction=..., name=...)`` (the package's ``LossFunctionWrapper``).

    Raises:
        ValueError: ``reduction`` given with a loss object of another one.
        TypeError: ``loss`` is not a loss, identifier or callable.
    """
    if isinstance(loss, loss_class):
        if reduction is not None and reduction != loss.reduction:
            raise ValueError(
                f"CountedLoss: `reduction` is only for a loss function; {loss.name!r} "
                f"has reduction={loss.reduction!r} (received reduction={reduction!r})."
            )
        return loss
    if isinstance(loss, (str, dict)):
        resolved = get(loss)
        if isinstance(resolved, loss_class):
            return resolved
        loss = resolved
    if callable(loss):
        return wrap(loss, reduction=reduction or default_reduction, name=getattr(loss, "__name__", None))
    raise TypeError(
        f"CountedLoss(loss): `loss` must be a {package}.losses.Loss, an identifier "
        f"{package}.losses.get resolves, or a function. Received {loss!r}."
    )


def merge_masks(in_mask: Any, out_mask: Any) -> Any:
    """The mask a Keras ``Loss.__call__`` applies: the prediction's and the
    losses' (both, when both have one)."""
    if in_mask is not None and out_mask is not None:
        return in_mask & out_mask
    return in_mask if in_mask is not None else out_mask
