"""Keras 3's ``BatchNormalization`` with moving statistics pooled per window.

The layer pools each micro-batch's moments (:mod:`accum_optimizer.core.moments`)
in three saved variables; the ``AccumulatingOptimizer`` that trains it calls
:meth:`BatchNormalization.end_window` whenever one of its windows ends (an
update, a discarded window, ``flush()``: ``WindowState.followers``), and the
moving statistics take one momentum step there. How the layer finds that
optimizer: :mod:`accum_optimizer.layers._link`.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
from keras import ops

from accum_optimizer._compat import keras3 as compat
from accum_optimizer.core import moments
from accum_optimizer.layers import _link

@keras.saving.register_keras_serializable(package="accum_optimizer")
class BatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose moving statistics move once
    per accumulation window, by the window's pooled statistics.

    Same arguments, same normalisation and the same serialization as
    ``keras.layers.BatchNormalization`` (Keras 3); ``renorm=True`` is not
    supported. In training, while an ``AccumulatingOptimizer`` with N > 1
    trains it, each micro-batch is normalised by its own moments (as the
    parent does) and its count, mean and variance per channel are pooled
    into ``window_count`` (float32 scalar, elements per channel),
    ``window_mean`` and ``window_variance`` (float32 ``(channels,)``); when
    the optimizer's window ends (its update, a window it discards, or
    ``flush()``), ``moving_mean``/``moving_variance`` take one momentum step
    with the pool (Keras' expression, with the pool in place of one batch's
    moments) and the pool empties. The three pool variables are saved with
    the model, so a run resumed mid-window continues the same window.

    The pool of a window's micro-batches equals the moments of their union,
    so where the layers in front of it do not train (or it is on the input),
    the moving statistics after every window equal those of training on the
    batch of N·B; where they train, they are the pooled statistics of what
    this layer saw (see the documentation's page on BatchNorm).

    Outside training, while ``trainable`` is false, with no accumulating
    optimizer (a plain optimizer, N = 1) or on a backend other than
    TensorFlow, it is exactly the parent layer.

    Raises:
        ValueError: ``renorm=True``; or, when an optimizer links it, the
            layer already follows another live accumulating optimizer, or
            (under a multi-replica strategy) a step was traced before the
            optimizer was built: build it first.
        NotImplementedError: an accumulating optimizer on JAX or torch
            links it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.renorm:
            raise ValueError(
                "accum_optimizer.layers.BatchNormalization does not support renorm=True (received "
                "renorm=True): batch renormalisation keeps its own per-batch moving statistics. Use "
                "keras.layers.BatchNormalization(renorm=True), which does not depend on the "
                "micro-batch's statistics as much, or GroupNormalization/LayerNormalization."
            )
        self._window_link = _link.Link(keras.backend.backend())

    def build(self, input_shape: Sequence[Any]) -> None:
        super().build(input_shape)
        channels = (input_shape[self.axis],)
        self.window_count = self.add_weight(
            shape=(), name="window_count", initializer="zeros", dtype="float32", trainable=False, autocast=False,
            aggregation="only_first_replica",  # every replica pools the same (global) micro-batch
        )
        self.window_mean = self.add_weight(
            shape=channels, name="window_mean", initializer="zeros", dtype="float32", trainable=False,
            autocast=False, aggregation="only_first_replica",
        )
        self.window_variance = self.add_weight(
            shape=channels, name="window_variance", initializer="zeros", dtype="float32", trainable=False,
            autocast=False, aggregation="only_first_replica",
        )
        if keras.backend.backend() == "tensorflow":
            # Held by the untracked link: not a weight, not saved.
            self._window_link.pooling = keras.Variable(0, dtype="int32", trainable=False, name="pooling")
        _link.register(self)

    # ---------------------------------------------------------------- forward
    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        parent_call = super().call
        if (not (training and self.trainable) or self._window_link.pooling is None
                or (mask is not None and len(mask.shape) != len(inputs.shape) - 1)):  # (the parent's error)
            return parent_call(inputs, training=training, mask=mask)
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        return _link.forward(
            self,
            lambda m: self._pooling_call(inputs, m),
            lambda: parent_call(inputs, training=training, mask=mask),
            lambda: self._micro_batch_moments(inputs, mask),
        )

    def _micro_batch_moments(self, inputs: Any, mask: Any) -> tuple:
        """What the micro-batch adds to the pool, its ``(count, mean,
        variance)`` over every replica; and its ``mean``, ``variance`` as the
        parent normalises by them."""
        mean, variance = compat.batch_norm_moments(self, inputs, mask)
        if mask is None:
            count = ops.cast(ops.size(inputs), "float32") / float(inputs.shape[self.axis])
        else:
            count = ops.sum(ops.cast(mask, "float32")) * (
                ops.cast(ops.size(inputs), "float32") / ops.cast(ops.size(mask), "float32")
            ) / float(inputs.shape[self.axis])
        pooled = _link.across_replicas(count, ops.cast(mean, "float32"), ops.cast(variance, "float32"))
        return pooled, mean, variance

    def _pooling_call(self, inputs: Any, micro_batch: tuple) -> Any:
        """The parent's training forward pass (normalised by the
        micro-batch's own moments), pooling the moments in place of the
        moving-statistics update."""
        pooled, mean, variance = micro_batch
        self.add_to_pool(pooled)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis, offset=beta, scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    # ------------------------------------------------------------ the window
    def _pool(self) -> moments.Pool:
        return moments.Pool(self.window_count.value, self.window_mean.value, self.window_variance.value)

    def add_to_pool(self, micro_batch: tuple) -> None:
        """Merge a micro-batch's ``(count, mean, variance)`` into the pool."""
        pool = moments.merge(ops, self._pool(), *micro_batch)
        self.window_count.assign(pool.count)
        self.window_mean.assign(pool.mean)
        self.window_variance.assign(pool.variance)

    def end_window(self) -> list:
        """One momentum step of the moving statistics with the window's pool
        (none if it pooled nothing), then an empty pool. Called by the
        optimizer that trains the layer whenever its window ends; call it
        yourself only to end a window that optimizer will not end."""
        moving_mean, moving_variance = moments.moving_step(
            ops, self.moving_mean.value, self.moving_variance.value, self._pool(), self.momentum
        )
        return [
            self.moving_mean.assign(moving_mean),
            self.moving_variance.assign(moving_variance),
            self.window_count.assign(ops.zeros_like(self.window_count.value)),
            self.window_mean.assign(ops.zeros_like(self.window_mean.value)),
            self.window_variance.assign(ops.zeros_like(self.window_variance.value)),
        ]


def convert_batch_norm(model: Any) -> Any:
    """A copy of ``model`` (Sequential or Functional, nested models
    included) with every ``keras.layers.BatchNormalization`` replaced by
    :class:`BatchNormalization` of the same config, and every weight
    (moving statistics included) copied; the pools start empty. The
    original model is not changed.

    Raises:
        TypeError: ``model`` is not a Keras 3 Sequential or Functional model
            (a subclassed model: build it with
            ``accum_optimizer.layers.BatchNormalization`` in its code).
        ValueError: a ``BatchNormalization`` has ``renorm=True``, or a weight
            could not be matched in the copy.
    """
    subclassed = _link.check_convertible(model, keras.Model, keras.layers.BatchNormalization, "Keras 3", "keras")

    def clone(layer: Any) -> Any:
        if isinstance(layer, keras.layers.BatchNormalization) and not isinstance(layer, BatchNormalization):
            return BatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    try:
        converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as e:  # Keras: clone_function needs a Sequential or Functional model
        if isinstance(model, keras.Sequential) or "Functional" not in str(e):
            raise
        raise subclassed from e
    old = {v.path: v for v in model.weights}
    new = {v.path: v for v in converted.weights}
    missing = sorted(set(old) - set(new))
    if missing or len(old) != len(model.weights):
        raise ValueError(
            f"convert_batch_norm could not match the weights of {model.name!r} in its copy by path "
            f"(unmatched: {missing[:5]}); convert the model before loading or training it in a "
            f"different structure."
        )
    for path, variable in old.items():
        new[path].assign(variable.value)
    _link.copy_trainable(model, converted)
    return converted

