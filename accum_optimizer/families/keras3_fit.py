"""Keras 3 tools for windows that equal any large batch.

* :class:`CountedLoss`: wraps a Keras loss; computes it exactly as Keras does
  and reports the count its mean was taken over to the
  ``AccumulatingOptimizer`` of the same train step, which weights the
  micro-step by it. ``model.compile(loss=CountedLoss("sparse_categorical_crossentropy"))``.
* :class:`FlushPartialWindow`: a callback that applies the partial window at
  every epoch end (``AccumulatingOptimizer.flush``).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from accum_optimizer import counting
from accum_optimizer._compat import keras3 as compat
from accum_optimizer.families import _fit

if not str(keras.__version__).startswith("3."):  # Keras 2.x is `keras` on TF <= 2.15
    raise ImportError(f"{__name__} needs Keras 3; `import keras` is Keras {keras.__version__} here.")

_OPS = counting.KerasOps(ops)
_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")


@keras.saving.register_keras_serializable(package="accum_optimizer")
class CountedLoss(keras.losses.Loss):
    """A Keras loss that also reports its micro-batch's count ``c``.

    ``CountedLoss(loss)`` returns exactly what ``loss`` returns (the same
    ``call``, mask and ``sample_weight`` handling and reduction: Keras'
    ``reduce_weighted_values``), and reports to the ``AccumulatingOptimizer``
    of the same train step the count ``c`` that the mean was taken over, so
    that the window applies ``Σ cᵢ·gᵢ / Σ cᵢ``: the gradient of the same
    loss over the window's samples taken at once, whatever the micro-batch
    sizes, masks and sample weights. The count follows from the loss's own
    ``reduction`` (``keras/src/losses/loss.py``, Keras 3.15):

    * ``"sum_over_batch_size"`` (Keras' default) and ``"mean"``: the number
      of loss elements (samples, or samples × timesteps for per-token
      losses); with a mask (``Embedding(mask_zero=True)``, ``Masking``), the
      unmasked ones. Sample weights scale the terms, not the divisor, as in
      Keras.
    * ``"mean_with_sample_weight"``: the sum of the sample weights (times
      the mask); without sample weights, the number of elements.
    * ``"sum"``: 1 per micro-step; the optimizer must use
      ``reduction="sum"`` (the window's gradient is then the sum over all
      its samples, as the large batch's).

    Args:
        loss: a ``keras.losses.Loss`` instance, an identifier that
            ``keras.losses.get`` resolves (``"mse"``,
            ``"sparse_categorical_crossentropy"``) or a function
            ``fn(y_true, y_pred) -> per-sample losses`` (then with
            ``reduction``).
        reduction: only for a function ``loss``: Keras' reduction, default
            ``"sum_over_batch_size"``.
        name: default: the inner loss's name.

    One counted loss per model: with several outputs, count the one whose
    reduction the large batch uses (two reports in one train step raise
    ``ValueError`` at ``apply``). The count of a micro-batch under
    ``tf.distribute`` is its replica's; the optimizer sums them over
    replicas once per update.

    Raises:
        ValueError: ``reduction`` ``None``/``"none"`` (not a scalar loss) or
            unknown; a ``"sum"`` loss with a ``"mean"`` optimizer (at
            ``apply``).
        TypeError: ``loss`` is not a loss, identifier or callable.
    """

    def __init__(self, loss: Any, reduction: str | None = None, name: str | None = None, dtype: Any = None):
        inner = _resolve_loss(loss, reduction)
        if inner.reduction not in _REDUCTIONS:
            raise ValueError(
                f"CountedLoss needs a scalar loss reduction, one of {_REDUCTIONS}. "
                f"Received {inner.name!r} with reduction={inner.reduction!r}."
            )
        super().__init__(name=name or inner.name, reduction=inner.reduction, dtype=dtype or inner.dtype)
        self.inner_loss = inner

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        # keras.losses.Loss.__call__ (Keras 3.15), with the count beside it.
        in_mask = compat.keras_mask(y_pred)
        inner = self.inner_loss
        with keras.name_scope(self.name):
            y_pred = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=inner.dtype), y_pred)
            y_true = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=inner.dtype), y_true)
            losses = inner.call(y_true, y_pred)
            mask = _fit.merge_masks(in_mask, compat.keras_mask(losses))
            value = compat.loss_helpers().reduce_weighted_values(
                losses, sample_weight=sample_weight, mask=mask, reduction=inner.reduction, dtype=inner.dtype
            )
            count = micro_batch_count(losses, sample_weight, mask, inner.reduction, inner.dtype)
        counting.report_count(count, inner.reduction, self.name, self)
        return value

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.inner_loss.call(y_true, y_pred)

    def get_config(self) -> dict:
        return {"loss": keras.saving.serialize_keras_object(self.inner_loss), "name": self.name}

    @classmethod
    def from_config(cls, config: dict) -> "CountedLoss":
        config = dict(config)
        config["loss"] = keras.saving.deserialize_keras_object(config["loss"])
        return cls(**config)


def micro_batch_count(losses: Any, sample_weight: Any, mask: Any, reduction: str, dtype: Any) -> Any:
    """float32 scalar: the count ``c`` of one micro-batch, such that Keras'
    reduced loss is ``Σ(terms) / c`` (see :class:`CountedLoss`). Keras 3's
    merge of the mask and the sample weights (``apply_mask``) and rank
    alignment (``squeeze_or_expand_to_same_rank``), as in
    ``reduce_weighted_values``, decide the shape it divides by; the count
    itself is :func:`accum_optimizer.counting.micro_batch_count`."""
    if reduction == "sum":
        return counting.micro_batch_count(None, None, None, reduction, _OPS)
    values = ops.convert_to_tensor(losses, dtype=dtype)
    weights = None if sample_weight is None else ops.convert_to_tensor(sample_weight, dtype=dtype)
    keras_loss = compat.loss_helpers()
    weights = keras_loss.apply_mask(weights, mask, dtype=values.dtype, reduction=reduction)
    if weights is not None:
        weights = ops.cast(weights, values.dtype)
        values, weights = keras_loss.squeeze_or_expand_to_same_rank(values, weights)
        values = values * weights
    return counting.micro_batch_count(values, weights, mask, reduction, _OPS)


def _resolve_loss(loss: Any, reduction: str | None) -> keras.losses.Loss:
    return _fit.resolve_loss(loss, reduction, keras.losses.Loss, keras.losses.get,
                                 lambda *a, **k: compat.loss_function_wrapper()(*a, **k),
                                 "sum_over_batch_size", "keras")


class FlushPartialWindow(_fit.FlushAtEpochEnd, keras.callbacks.Callback):
    """Apply the partial window at the end of every epoch, so that each
    epoch ends on an update (``AccumulatingOptimizer.flush``).

    ``model.fit(x, y, batch_size=B, callbacks=[FlushPartialWindow()])`` with
    an ``AccumulatingOptimizer`` of N trains like ``fit(x, y,
    batch_size=N*B)``: each epoch's last window, of fewer than N
    micro-batches, is applied normalised by what it holds, as the large
    batch's smaller last batch is. Without it the partial window carries
    over into the next epoch (the default).

    When ``fit`` validates, the flush happens before validation
    (``on_test_begin``), so the epoch's validation sees the weights the
    large batch would have; otherwise at ``on_epoch_end``. Put it before
    callbacks that read the weights at epoch end (``ModelCheckpoint``,
    ``BackupAndRestore``): Keras runs callbacks in list order.

    Finds the ``AccumulatingOptimizer`` as ``model.optimizer`` or its
    ``inner_optimizer`` (a ``LossScaleOptimizer`` around it, as ``compile``
    adds under ``"mixed_float16"``).

    Raises:
        ValueError: (at ``on_train_begin``) the model's optimizer has no
            ``AccumulatingOptimizer``.
    """
