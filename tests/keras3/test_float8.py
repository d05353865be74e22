"""float8 training in a custom TensorFlow train step: ``scale_loss`` and
``apply`` agree on the units of the gradients.

References: the same float8 model trained with batch N·B (the large batch)
and Keras' built-in accumulation; ``fit`` on every backend is
``tests/backends/test_float8_any_backend.py``. N = 4 and B = 8 are powers of
two, so dividing a loss by N and multiplying its gradients back by N is
exact: the float8 state after one window is bitwise the large batch's (see
that module).
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.arrays import assert_bitwise_equal  # noqa: E402

N, B = 4, 8
RNG = np.random.default_rng(1)
X = RNG.normal(size=(N * B, 6)).astype("float32")
Y = RNG.normal(size=(N * B, 3)).astype("float32")


def float8_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.quantize("float8")
    return model


def loop(optimizer, batch: int, call_scale_loss: bool) -> dict:
    """One pass over X in a ``tf.function`` train step; every model variable
    by name afterwards."""
    model = float8_model()
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if call_scale_loss:
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    for i in range(0, len(X), batch):
        step(X[i:i + batch], Y[i:i + batch])
    return {f"{i}:{v.path.split('/')[-1]}": v.numpy() for i, v in enumerate(model.variables)}


@pytest.fixture(scope="module")
def large():
    return loop(keras.optimizers.SGD(0.1), N * B, call_scale_loss=True)


def test_a_step_that_calls_scale_loss_gets_the_large_batch_float8_state(large):
    ours = loop(AccumulatingOptimizer(keras.optimizers.SGD(0.1), N), B, call_scale_loss=True)
    for name in large:
        if "scale" in name or "amax_history" in name:
            assert_bitwise_equal([ours[name]], [large[name]], name)


def test_a_step_without_scale_loss_is_not_unscaled(large):
    """Without ``scale_loss`` the gradients are the micro-batch's own and
    nothing multiplies them: the weights are Keras' built-in's (the same
    micro-batch gradients added in the same order), and the output-gradient
    history is in micro-batch units, N times the large batch's, as the
    built-in keeps it."""
    ours = loop(AccumulatingOptimizer(keras.optimizers.SGD(0.1), N), B, call_scale_loss=False)
    builtin = loop(keras.optimizers.SGD(0.1, gradient_accumulation_steps=N), B, call_scale_loss=False)
    for name in large:
        if name.endswith((":kernel", ":bias")):
            assert_bitwise_equal([ours[name]], [builtin[name]], name)
        if name.endswith(":outputs_grad_amax_history"):
            assert np.any(large[name] != 0)
            assert_bitwise_equal([ours[name]], [N * large[name]], name)


def test_a_dict_schedule_scales_by_the_window_s_n(large):
    ours = loop(AccumulatingOptimizer(keras.optimizers.SGD(0.1), {0: N}), B, call_scale_loss=True)
    for name in large:
        if "scale" in name or "amax_history" in name:
            assert_bitwise_equal([ours[name]], [large[name]], name)
