"""Keras 3: a subset of the variables is trained. (The properties every
family has, nothing moving between updates, in custom loops and under
``fit``, and missing gradients among them, are in tests/contract/.)

Reference: the plain optimizer on the large batch with the same variable
subset.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, max_abs_diff, mse, weights


def test_trains_only_variables_whose_name_lacks_vgg():
    """The design's source document fine-tunes everything but the 'VGG'
    feature extractor: `apply_gradients` gets that subset only."""
    n, mb = 4, 3

    def model_fn():
        keras.utils.set_random_seed(11)
        inp = keras.Input((6,))
        h = keras.layers.Dense(5, activation="relu", name="VGG_features")(inp)
        out = keras.layers.Dense(3, name="head")(h)
        return keras.Model(inp, out)

    def trained_vars(model):
        return [v for v in model.trainable_variables if "VGG" not in v.path]

    x, y = make_data(3 * n * mb)
    ref, acc = model_fn(), model_fn()
    ref_opt = keras.optimizers.Adam(1e-2)
    acc_opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=n)

    def make_step(model, opt):
        tv = trained_vars(model)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb))
            opt.apply_gradients(zip(tape.gradient(loss, tv), tv))

        return step

    ref_step, acc_step = make_step(ref, ref_opt), make_step(acc, acc_opt)
    for s in range(3):
        ref_step(x[s * n * mb : (s + 1) * n * mb], y[s * n * mb : (s + 1) * n * mb])
    for s in range(3 * n):
        acc_step(x[s * mb : (s + 1) * mb], y[s * mb : (s + 1) * mb])
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6
    vgg = [v for v in acc.weights if "VGG" in v.path]
    init = [v for v in model_fn().weights if "VGG" in v.path]
    for v, v0 in zip(vgg, init):
        np.testing.assert_array_equal(v.numpy(), v0.numpy())
    # Accumulators exist only for the trained subset.
    assert len(acc_opt.acc_grads) == len(trained_vars(acc)) == 2
