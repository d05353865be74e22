"""Keras 2 tools for windows that equal any large batch, for both Keras 2
families (the new optimizer API and legacy ``OptimizerV2``/tensorflow-addons),
with the Keras 3 tools' names and behaviour
(:mod:`~accum_optimizer.families.keras3_fit`):

* ``CountedLoss``: wraps a Keras 2 loss; computes it exactly as Keras 2
  does (its own ``Loss.__call__``) and reports the count its mean was taken
  over (:func:`accum_optimizer.counting.micro_batch_count`) to the
  ``AccumulatingOptimizer`` of the same train step.
* ``FlushPartialWindow``: applies the partial window at every epoch end
  (:class:`~accum_optimizer.families._fit.FlushAtEpochEnd`).

One class of each per Keras 2 package (``tf_keras``, or the ``keras`` 2.x
of TF <= 2.15), a subclass of that package's ``losses.Loss`` /
``callbacks.Callback`` (its ``compile`` and ``fit`` accept nothing else),
built by :func:`counted_loss_class` and :func:`flush_partial_window_class`;
``from accum_optimizer import CountedLoss, FlushPartialWindow`` gives the
active Keras' (``tf.keras``).
"""

from __future__ import annotations

import threading
from typing import Any

import tensorflow as tf

from accum_optimizer import _packages, counting
from accum_optimizer._compat import keras2 as compat
from accum_optimizer.families import _fit

# Keras 2's scalar reductions ("auto" is "sum_over_batch_size" in fit).
_REDUCTIONS = ("auto", "sum_over_batch_size", "sum")
# The per-element losses of the `call` inside a CountedLoss' `__call__`, per
# thread (each replica of a tf.distribute strategy runs in its own).
_CALLED = threading.local()


class _CountedLoss:
    """A Keras 2 loss that also reports its micro-batch's count ``c``.

    ``CountedLoss(loss)`` returns exactly what ``loss`` returns (Keras 2's
    ``Loss.__call__`` runs with ``loss``'s ``call``, mask handling, sample
    weights and reduction) and reports to the ``AccumulatingOptimizer`` of
    the same train step the count ``c`` the mean was taken over, so that
    the window applies ``Σ cᵢ·gᵢ / Σ cᵢ``: the gradient of the same loss
    over the window's samples taken at once, whatever the micro-batch sizes,
    masks and sample weights. The count follows Keras 2's reduction:

    * ``"auto"`` (the default) and ``"sum_over_batch_size"``: the number of
      loss elements (samples, or samples × timesteps for per-token losses);
      with a mask, the unmasked ones. Sample weights scale the terms, not
      the divisor, as in Keras 2.
    * ``"sum"``: 1 per micro-step; the optimizer must use
      ``reduction="sum"``.

    Args:
        loss: a Keras 2 ``Loss`` instance of this package, an identifier its
            ``losses.get`` resolves (``"mse"``), or a function
            ``fn(y_true, y_pred) -> per-sample losses`` (then with
            ``reduction``).
        reduction: only for a function or an identifier resolving to one:
            Keras 2's reduction, default ``"auto"``.
        name: default: the inner loss's name.

    One counted loss per model, as in Keras 3. Under ``tf.distribute`` a
    micro-batch's count is its replica's; the optimizer sums them over
    replicas once per update.

    Raises:
        ValueError: ``reduction`` ``"none"`` (not a scalar loss) or unknown;
            a ``"sum"`` loss with a ``"mean"`` optimizer (at the optimizer's
            ``apply_gradients``).
        TypeError: ``loss`` is not a loss, identifier or callable.
    """

    _keras: Any = None  # the class' Keras 2 package

    def __init__(self, loss: Any, reduction: str | None = None, name: str | None = None):
        inner = _resolve_loss(self._keras, loss, reduction)
        if inner.reduction not in _REDUCTIONS:
            raise ValueError(
                f"CountedLoss needs a scalar loss reduction, one of {_REDUCTIONS}. "
                f"Received {inner.name!r} with reduction={inner.reduction!r}."
            )
        super().__init__(reduction=inner.reduction, name=name or inner.name)
        self.inner_loss = inner
        self.identifier = loss  # for get_config

    def call(self, y_true: Any, y_pred: Any) -> Any:
        losses = self.inner_loss.call(y_true, y_pred)
        _CALLED.losses = losses
        return losses

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        _CALLED.losses = None
        value = super().__call__(y_true, y_pred, sample_weight)  # Keras 2's own, with `call` above
        losses, _CALLED.losses = _CALLED.losses, None
        reduction = "sum" if self.reduction == "sum" else "sum_over_batch_size"
        count = _count(self._keras, losses, y_pred, sample_weight, reduction)
        counting.report_count(count, reduction, self.name, self)
        return value

    def get_config(self) -> dict:
        loss = self.identifier
        if not isinstance(loss, str):
            loss = self._keras.losses.serialize(self.inner_loss)
        config = {"loss": loss, "name": self.name}
        if not isinstance(self.identifier, self._keras.losses.Loss) and self.reduction != "auto":
            config["reduction"] = self.reduction
        return config

    @classmethod
    def from_config(cls, config: dict) -> Any:
        config = dict(config)
        if isinstance(config["loss"], dict):
            config["loss"] = cls._keras.losses.deserialize(config["loss"])
        return cls(**config)


def _count(package: Any, losses: Any, y_pred: Any, sample_weight: Any, reduction: str) -> Any:
    """The micro-batch's count: Keras 2's ``Loss.__call__`` (the merged mask,
    ``apply_valid_mask``) and ``compute_weighted_loss`` (the weights' rank
    alignment) decide the shape it divides by."""
    if reduction == "sum":
        return counting.micro_batch_count(None, None, None, reduction)
    utils = compat.losses_utils(package)
    mask = _fit.merge_masks(utils.get_mask(y_pred), utils.get_mask(losses))
    values = tf.convert_to_tensor(losses)
    if not values.dtype.is_floating:
        values = tf.cast(values, tf.float32)
    weights = utils.apply_valid_mask(values, sample_weight, mask, reduction)
    if weights is not None:
        weights = tf.cast(weights, values.dtype)
        values, _, weights = utils.squeeze_or_expand_dimensions(values, None, weights)
        values = values * weights
    return counting.micro_batch_count(values, weights, mask, reduction)


def _resolve_loss(package: Any, loss: Any, reduction: str | None) -> Any:
    return _fit.resolve_loss(loss, reduction, package.losses.Loss, package.losses.get,
                                 lambda *a, **k: compat.loss_function_wrapper(package)(*a, **k),
                                 "auto", package.__name__)


class _FlushPartialWindow(_fit.FlushAtEpochEnd):
    """Apply the partial window at the end of every epoch, so that each
    epoch ends on an update (``AccumulatingOptimizer.flush``), as Keras 3's
    ``FlushPartialWindow``.

    ``model.fit(x, y, batch_size=B, callbacks=[FlushPartialWindow()])`` with
    an ``AccumulatingOptimizer`` of N (either Keras 2 family) trains like
    ``fit(x, y, batch_size=N*B)``: each epoch's last window, of fewer than N
    micro-batches, is applied normalised by what it holds. When ``fit``
    validates, the flush happens before validation; put it before callbacks
    that read the weights at epoch end (``ModelCheckpoint``,
    ``BackupAndRestore``).

    Also in Keras 2's graph-mode ``fit`` (``tf.compat.v1``, eager execution
    disabled): the flush op is built once, in the graph of the optimizer's
    state, and run in Keras' session.

    Raises:
        ValueError: (at ``on_train_begin``) the model's optimizer has no
            ``AccumulatingOptimizer``.
    """

    def _run_flush(self, opt: Any) -> None:
        if tf.executing_eagerly():
            opt.flush()
            return
        graph = opt.micro_steps.graph
        cached = getattr(self, "_flush_op", None)
        if cached is None or cached[0] is not opt or cached[1] is not graph:
            with graph.as_default():
                cached = (opt, graph, opt.flush())
            self._flush_op = cached
        self._keras.backend.batch_get_value([cached[2]])


def _per_package(kind: str, package: Any, mixin: type, base: type, register: bool) -> type:
    def make(package: Any) -> type:
        return type(kind, (mixin, base), {
            "__module__": __name__, "__qualname__": kind, "__doc__": mixin.__doc__, "_keras": package,
        })

    return _packages.per_package_class(kind, package, make, kind if register else None)


def counted_loss_class(package: Any) -> type:
    """``CountedLoss`` for one Keras 2 package: a subclass of its
    ``losses.Loss``, registered as ``"accum_optimizer>CountedLoss"`` (cached)."""
    return _per_package("CountedLoss", package, _CountedLoss, package.losses.Loss, register=True)


def flush_partial_window_class(package: Any) -> type:
    """``FlushPartialWindow`` for one Keras 2 package: a subclass of its
    ``callbacks.Callback`` (cached)."""
    return _per_package("FlushPartialWindow", package, _FlushPartialWindow, package.callbacks.Callback, register=False)
