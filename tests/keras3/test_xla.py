"""Accumulation inside XLA-compiled training steps.

The whole micro-step (scatter/add into the slots, the counter, the ``cond``
that picks update steps, the inner optimizer's update) must compile with XLA.
The independent reference is the plain inner optimizer with batch ``N * B``
and no XLA (``tests/support/reference.py``), same initial weights, same sample order.
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, make_train_step, max_abs_diff, mse, train, weights

N = 4  # gradient_accumulation_steps
B = 8  # micro-batch
WINDOWS = 3
EPOCHS = 2
TOL = 1e-5

schedules = keras.optimizers.schedules


def _optimizer_cases():
    o = keras.optimizers
    return {
        "adam": lambda: o.Adam(1e-2),
        "adamw_ema_schedule_clip": lambda: o.AdamW(
            learning_rate=schedules.ExponentialDecay(2e-2, decay_steps=2, decay_rate=0.5),
            weight_decay=0.05,
            use_ema=True,
            ema_momentum=0.9,
            # The batch-32 gradient norms here are 0.48..0.86: some
            # updates are clipped, some are not.
            global_clipnorm=0.7,
        ),
    }


OPTIMIZERS = _optimizer_cases()


def _fit(model, optimizer, x, y, batch, epochs, jit_compile):
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    # Keras silently falls back to jit_compile=False for models it thinks
    # cannot be compiled; make sure XLA is really on (or off).
    assert model.jit_compile is jit_compile
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(ds, epochs=epochs, shuffle=False, verbose=0)
    return model


def _assert_matches(acc_model, acc_opt, ref_model, ref_opt, updates, initial):
    assert int(acc_opt.micro_steps.numpy()) == N * updates
    assert int(acc_opt.iterations.numpy()) == updates == int(ref_opt.iterations.numpy())
    assert max_abs_diff(weights(ref_model), initial) > 1e-2  # training moved the weights
    assert max_abs_diff(weights(acc_model), weights(ref_model)) <= TOL
    assert len(acc_opt.inner_optimizer.variables) == len(ref_opt.variables)
    assert max_abs_diff(weights(acc_opt.inner_optimizer.variables), weights(ref_opt.variables)) <= TOL


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_jit_compiled_fit_matches_large_batch(opt_name):
    optimizer_fn = OPTIMIZERS[opt_name]
    x, y = make_data(N * B * WINDOWS)

    model = make_mlp(seed=0)
    opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
    _fit(model, opt, x, y, B, EPOCHS, jit_compile=True)

    ref_model = make_mlp(seed=0)
    ref_opt = optimizer_fn()
    _fit(ref_model, ref_opt, x, y, N * B, EPOCHS, jit_compile=False)

    _assert_matches(model, opt, ref_model, ref_opt, WINDOWS * EPOCHS, weights(make_mlp(seed=0)))


def test_jit_compiled_custom_loop_matches_large_batch():
    optimizer_fn = OPTIMIZERS["adam"]
    x, y = make_data(N * B * WINDOWS, seed=2)

    model = make_mlp(seed=0)
    opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
    step = make_train_step(model, opt, mse, mode="xla")
    for s in range(N * WINDOWS):
        xb, yb = tf.constant(x[s * B : (s + 1) * B]), tf.constant(y[s * B : (s + 1) * B])
        step(xb, yb)
        if s == 0:
            # The step really is one XLA computation.
            hlo = step.experimental_get_compiler_ir(xb, yb)(stage="hlo")
            assert "HloModule" in hlo

    ref_model = make_mlp(seed=0)
    ref_opt = optimizer_fn()
    train(ref_model, ref_opt, x, y, N * B, WINDOWS)

    _assert_matches(model, opt, ref_model, ref_opt, WINDOWS, weights(make_mlp(seed=0)))


# --------------------------------------------------------------------------
# Embedding: sparse (tf.IndexedSlices) gradients under XLA
# --------------------------------------------------------------------------
VOCAB, SEQ = 20, 3


def _make_embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )


def _embedding_data(n, seed=6):
    rng = np.random.default_rng(seed)
    # Ids 15..19 never occur: their rows get no gradient in any window.
    x = rng.integers(0, VOCAB - 5, size=(n, SEQ)).astype("int32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def _embedding_reference(optimizer, x, y, densify):
    """Plain optimizer, batch N*B, no XLA, custom loop.

    ``densify``: hand the optimizer ``tf.convert_to_tensor(grad)`` instead of
    the ``tf.IndexedSlices``. Needed for Adam: Keras' Adam computes
    ``ops.square(gradient)`` on the slices *before* repeated ids are summed,
    so for a sparse batch gradient with repeated ids its second moment gets
    ``sum(g_i**2)`` instead of ``(sum g_i)**2`` (the update depends on the
    representation, not just on the gradient). The wrapper hands the inner
    optimizer the window gradient as a dense tensor (its slot), which is the
    gradient of the N*B batch, so the reference gets that gradient densely
    too. For SGD (linear in the gradient) the sparse form is used as is.
    """
    model = _make_embedding_model()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    steps_per_epoch = len(x) // (N * B)
    for _ in range(EPOCHS):
        for s in range(steps_per_epoch):
            sl = slice(s * N * B, (s + 1) * N * B)
            step(tf.constant(x[sl]), tf.constant(y[sl]))
    return model


EMBEDDING_OPTIMIZERS = {
    # Plain SGD gets the sparse window (IndexedSlices over the touched rows).
    "sgd": (lambda: keras.optimizers.SGD(0.5), False),
    "sgd_momentum": (lambda: keras.optimizers.SGD(0.5, momentum=0.9), False),
    "adam": (lambda: keras.optimizers.Adam(5e-2), True),
}


@pytest.mark.parametrize("opt_name", sorted(EMBEDDING_OPTIMIZERS))
def test_jit_compiled_fit_embedding_sparse_gradients_match_large_batch(opt_name):
    optimizer_fn, densify = EMBEDDING_OPTIMIZERS[opt_name]
    x, y = _embedding_data(N * B * WINDOWS)

    # The embedding gradient of this model is sparse, with repeated ids.
    probe = _make_embedding_model()
    with tf.GradientTape() as tape:
        loss = mse(y[:B], probe(x[:B], training=True))
    grad = tape.gradient(loss, probe.trainable_variables)[0]
    assert isinstance(grad, tf.IndexedSlices)
    assert len(np.unique(grad.indices.numpy())) < len(grad.indices.numpy())

    model = _make_embedding_model()
    opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
    _fit(model, opt, x, y, B, EPOCHS, jit_compile=True)

    ref_opt = optimizer_fn()
    ref_model = _embedding_reference(ref_opt, x, y, densify)

    initial = weights(_make_embedding_model())
    _assert_matches(model, opt, ref_model, ref_opt, WINDOWS * EPOCHS, initial)
    # Rows of ids that never occur are untouched, as in the reference.
    np.testing.assert_array_equal(weights(model)[0][VOCAB - 5 :], initial[0][VOCAB - 5 :])
