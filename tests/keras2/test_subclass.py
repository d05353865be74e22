"""Where `tf.keras` is Keras 2, `class Mine(accum_optimizer.AccumulatingOptimizer)`
subclasses the Keras 2 new-API family's class (issue 16, item 4); reference:
that family class, trained on the same data (bitwise)."""

from __future__ import annotations

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import accum_optimizer  # noqa: E402
from accum_optimizer.families import keras2 as keras2_family  # noqa: E402

keras = tf.keras


class Mine(accum_optimizer.AccumulatingOptimizer):
    pass


def _fit(opt):
    tf.keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(opt, "mse")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    return model.get_weights()


def test_subclass_is_the_keras2_family_class_and_trains_like_it():
    assert issubclass(Mine, keras2_family.AccumulatingOptimizer)
    assert issubclass(Mine, keras.optimizers.Optimizer)
    opt = Mine(keras.optimizers.Adam(1e-2), 2)
    assert isinstance(opt, accum_optimizer.AccumulatingOptimizer) and type(opt) is Mine
    for a, b in zip(_fit(opt), _fit(keras2_family.AccumulatingOptimizer(keras.optimizers.Adam(1e-2), 2))):
        np.testing.assert_array_equal(a, b)
