"""Keras 3: between updates nothing moves under ``fit`` either; a subset of
the variables is trained. (The custom-loop properties every family has,
nothing moving between updates and missing gradients among them, are in
tests/contract/.)

References: snapshots of the same run (bitwise); the plain optimizer on the
large batch with the same variable subset.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, max_abs_diff, mse, weights


def _snapshot(model, opt):
    return [np.array(v.numpy()) for v in model.weights] + [
        np.array(v.numpy()) for v in opt.inner_optimizer.variables
    ]


def _assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _rich_inner():
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=10, warmup_target=2e-2, warmup_steps=2)
    return keras.optimizers.AdamW(schedule, weight_decay=0.05, use_ema=True, ema_momentum=0.9)


def _grads(model, xb, yb):
    with tf.GradientTape() as tape:
        loss = mse(yb, model(xb, training=True))
    return tape.gradient(loss, model.trainable_variables)


class _StateRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(_snapshot(self.model, self.model.optimizer))


def test_fit_non_update_batches_leave_inner_state_bitwise_untouched():
    n = 4
    model = make_mlp()
    model.compile(optimizer=AccumulatingOptimizer(_rich_inner(), n), loss="mse")
    x, y = make_data(2 * 12)
    rec = _StateRecorder()
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    assert len(rec.states) == 12
    for m in range(1, 12):
        if (m + 1) % n:  # batch m (0-based) is micro-step m+1
            _assert_bitwise_equal(rec.states[m - 1], rec.states[m])
        else:
            assert max_abs_diff(rec.states[m - 1], rec.states[m]) > 0


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
