"""Keras 2's ``BatchNormalization`` (``tf_keras``, TF <= 2.15's ``keras``)
with moving statistics pooled per window.

The same layer as :mod:`accum_optimizer.layers._keras3` for a Keras 2
package: one class per package (:func:`batch_normalization_class`),
registered with that package's serialization. Keras 2's layer computes and
applies its moving-statistics update inside ``call`` through
``add_update`` (its fused path even averages inside the fused op); while
pooling, the layer holds those updates back (``add_update`` is public
``Layer`` API) and pools the micro-batch's moments, computed with
``tf.nn.moments``/``tf.nn.weighted_moments`` as the parent's unfused path
does. Where the parent's fused path moves the moving variance with the
unbiased batch variance (Bessel's ``n / (n - 1)``), the window's pooled
variance gets the same correction, ``n`` the window's count.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from accum_optimizer import _packages
from accum_optimizer._compat import keras2 as compat
from accum_optimizer.core import moments
from accum_optimizer.layers import _link


_DOC = """``BatchNormalization`` of this Keras 2 package whose moving statistics
move once per accumulation window, by the window's pooled statistics.

Same arguments, normalisation and serialization as the package's
``layers.BatchNormalization``; ``renorm=True`` and ``virtual_batch_size``
are refused. Pools, saves and follows its optimizer's window exactly as
``accum_optimizer.layers.BatchNormalization`` of Keras 3 does (see
``docs/batchnorm.md``): ``window_count`` (float32 scalar), ``window_mean``
and ``window_variance`` (float32, the moving statistics' shape);
:meth:`end_window` is called by the optimizer.

Raises:
    ValueError: ``renorm=True`` or a ``virtual_batch_size``; or, when an
        optimizer links it, the layer already follows another live
        accumulating optimizer, or (under a multi-replica strategy) a step
        was traced before the optimizer was built: build it first.
"""


def batch_normalization_class(package: Any) -> type:
    """The pooling ``BatchNormalization`` for ``package`` (``tf_keras`` or
    Keras 2.x ``keras``), registered as ``accum_optimizer>BatchNormalization``."""
    return _packages.per_package_class("BatchNormalization", package, _make, "BatchNormalization")


def _make(package: Any) -> type:
    base = package.layers.BatchNormalization

    class BatchNormalization(base):
        __doc__ = _DOC

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            refused = {"renorm": self.renorm} if self.renorm else (
                {"virtual_batch_size": self.virtual_batch_size} if self.virtual_batch_size is not None else {})
            if refused:
                (name, value), = refused.items()
                raise ValueError(
                    f"accum_optimizer.layers.BatchNormalization does not support {name} (received "
                    f"{name}={value!r}): it keeps its own per-batch statistics. Use "
                    f"{package.__name__}.layers.BatchNormalization({name}=...), or "
                    f"GroupNormalization/LayerNormalization."
                )
            self._window_link = _link.Link("tensorflow")
            self._holding_updates = False

        def build(self, input_shape: Any) -> None:
            super().build(input_shape)
            shape = self.moving_mean.shape
            for name, variable_shape in (("window_count", ()), ("window_mean", shape), ("window_variance", shape)):
                setattr(self, name, self.add_weight(
                    name=name, shape=variable_shape, dtype=tf.float32, initializer="zeros", trainable=False,
                    experimental_autocast=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,  # every replica pools the global micro-batch
                ))
            # Held by the untracked link: not a weight, not saved.
            self._window_link.pooling = tf.Variable(0, dtype=tf.int32, trainable=False, name="pooling")
            _link.register(self)

        # ------------------------------------------------------------ forward
        def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
            parent_call = super().call
            if training is not True or not self.trainable:
                return parent_call(inputs, training=training, mask=mask)
            return _link.forward(
                self,
                lambda prepared: self._pooling_call(inputs, mask, parent_call, prepared[0]),
                lambda: parent_call(inputs, training=True, mask=mask),
                lambda: (self._micro_batch_moments(inputs, mask),),
            )

        def add_update(self, updates: Any) -> None:
            if self._holding_updates:  # pooling: the moving statistics move when the window ends
                return
            super().add_update(updates)

        def _pooling_call(self, inputs: Any, mask: Any, parent_call: Any, pooled: tuple) -> Any:
            self.add_to_pool(pooled)
            self._holding_updates = True
            try:
                return parent_call(inputs, training=True, mask=mask)
            finally:
                self._holding_updates = False

        def _micro_batch_moments(self, inputs: Any, mask: Any) -> tuple:
            """What the micro-batch adds to the pool: its ``(count, mean,
            variance)`` over every replica (the unfused path's moments)."""
            x = tf.cast(inputs, tf.float32)
            axes = [i for i in range(x.shape.rank) if i not in self.axis]
            if mask is None:
                mean, variance = tf.nn.moments(x, axes, keepdims=True)
                count = tf.cast(tf.size(x), tf.float32) / tf.cast(tf.size(mean), tf.float32)
            else:
                weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float32), tf.shape(x))
                mean, variance = tf.nn.weighted_moments(x, axes, weights, keepdims=True)
                count = tf.reduce_sum(weights) / tf.cast(tf.size(mean), tf.float32)
            shape = self.moving_mean.shape
            return _link.across_replicas(count, tf.reshape(mean, shape), tf.reshape(variance, shape))

        def add_to_pool(self, micro_batch: tuple) -> None:
            """Merge a micro-batch's ``(count, mean, variance)`` into the pool."""
            pool = moments.merge(tf, self._pool(), *micro_batch)
            self.window_count.assign(pool.count)
            self.window_mean.assign(pool.mean)
            self.window_variance.assign(pool.variance)

        # -------------------------------------------------------- the window
        def _pool(self) -> moments.Pool:
            return moments.Pool(
                tf.convert_to_tensor(self.window_count), tf.convert_to_tensor(self.window_mean),
                tf.convert_to_tensor(self.window_variance),
            )

        def end_window(self) -> list:
            """One momentum step of the moving statistics with the window's
            pool (none if it pooled nothing), then an empty pool. Called by
            the optimizer that trains the layer whenever its window ends."""
            pool = self._pool()
            if compat.fused_variance_is_unbiased(self, package):
                # The fused op's unbiased variance, over the window's count.
                pool = moments.Pool(
                    pool.count, pool.mean, pool.variance * (pool.count / tf.maximum(pool.count - 1.0, 1.0))
                )
            moving_mean, moving_variance = moments.moving_step(
                tf, tf.convert_to_tensor(self.moving_mean), tf.convert_to_tensor(self.moving_variance), pool,
                self.momentum,
            )
            return [
                self.moving_mean.assign(moving_mean),
                self.moving_variance.assign(moving_variance),
                self.window_count.assign(tf.zeros_like(self.window_count)),
                self.window_mean.assign(tf.zeros_like(self.window_mean)),
                self.window_variance.assign(tf.zeros_like(self.window_variance)),
            ]

    BatchNormalization.__module__ = __name__
    return BatchNormalization


def convert_batch_norm(model: Any, package: Any) -> Any:
    """A copy of the Keras 2 Sequential or Functional ``model`` with every
    ``BatchNormalization`` replaced by the pooling one, weights copied.

    Raises:
        TypeError: a subclassed model.
        ValueError: a ``BatchNormalization`` has ``renorm=True``; or a nested
            model holds a Keras ``BatchNormalization`` (Keras 2's
            ``clone_model`` does not reach into it: convert it first).
    """
    cls = batch_normalization_class(package)
    subclassed = _link.check_convertible(
        model, package.Model, package.layers.BatchNormalization, package.__name__, package.__name__)
    for layer in model.layers:
        if isinstance(layer, package.Model) and any(
            isinstance(inner, package.layers.BatchNormalization) and not isinstance(inner, cls)
            for inner in _link.all_layers(layer)
        ):
            raise ValueError(
                f"convert_batch_norm: the nested model {layer.name!r} of {model.name!r} holds a "
                f"BatchNormalization, which Keras 2's clone_model does not reach; convert the nested model "
                f"first (convert_batch_norm(nested)) and build {model.name!r} with the converted copy."
            )

    def clone(layer: Any) -> Any:
        if isinstance(layer, package.layers.BatchNormalization) and not isinstance(layer, cls):
            return cls.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    try:
        converted = package.models.clone_model(model, clone_function=clone)
    except ValueError as e:  # Keras 2: "... only supported for Sequential models or Functional models"
        if "Functional" not in str(e):
            raise
        raise subclassed from e
    for old, new in zip(model.layers, converted.layers, strict=True):
        weights = old.get_weights()
        new.set_weights(weights + new.get_weights()[len(weights):])
    _link.copy_trainable(model, converted)
    return converted

