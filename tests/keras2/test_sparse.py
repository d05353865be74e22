"""Keras 2 new API: sparse (`tf.IndexedSlices`) gradients accumulate by scatter-add.

Reference: the same embedding model trained by the plain optimizer with batch
N*B on its own *sparse* gradient (``IndexedSlices`` over the ids of the large
batch, which Keras 2 deduplicates before ``update_step``).

The wrapper hands the inner optimizer the *dense* window gradient (no
``WindowState.touched_rows``): every Keras 2 new-API optimizer either treats
an ``IndexedSlices`` gradient densely (its slots decay on every row; Adam,
Nadam, AdamW, Adamax, Adadelta, Ftrl, Lion, Adafactor, momentum SGD, RMSprop
with momentum) or updates only the rows present, where a zero row of a dense
gradient gives a zero step too (SGD, Adagrad, RMSprop without momentum:
``-lr * 0 / sqrt(acc + eps)`` and ``m * 0`` are exact zeros). So the
dense-window result equals the sparse large batch to rounding, for every
class, which ``test_every_class_matches_the_sparse_large_batch`` checks.
"""

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.reference import max_abs_diff, mse, optimizer_cases, optimizer_state, table_data, table_model, weights  # noqa: E402

keras = tf.keras
VOCAB, DIM = 40, 4
N, MB, WINDOWS = 4, 3, 3
OPTIMIZERS = optimizer_cases()
# Row-lazy on IndexedSlices: the rows no window looks up (ids >= 12) keep
# their initial values, in the sparse reference and, bitwise, in the
# accumulating run that hands them a zero dense gradient.
LAZY = ("sgd", "adagrad", "rmsprop")


def _step(model, opt, mode):
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step if mode == "eager" else tf.function(step)


def _check(name, mode):
    x, y = table_data(N * MB * WINDOWS)
    ref, acc = table_model(VOCAB, DIM), table_model(VOCAB, DIM)
    ref_opt = OPTIMIZERS[name]()
    acc_opt = AccumulatingOptimizer(OPTIMIZERS[name](), gradient_accumulation_steps=N)
    ref_step, acc_step = _step(ref, ref_opt, mode), _step(acc, acc_opt, mode)
    for s in range(WINDOWS):
        ref_step(tf.constant(x[s * N * MB : (s + 1) * N * MB]), tf.constant(y[s * N * MB : (s + 1) * N * MB]))
    for s in range(N * WINDOWS):
        acc_step(tf.constant(x[s * MB : (s + 1) * MB]), tf.constant(y[s * MB : (s + 1) * MB]))
    assert int(acc_opt.iterations.numpy()) == WINDOWS
    table0 = table_model(VOCAB, DIM).get_layer("table").embeddings.numpy()
    for model in (ref, acc):
        table = model.get_layer("table").embeddings.numpy()
        assert np.any(table[:12] != table0[:12])
        if name in LAZY:
            np.testing.assert_array_equal(table[12:], table0[12:])
    dw = max_abs_diff(weights(ref), weights(acc))
    ds = max_abs_diff(optimizer_state(ref_opt), optimizer_state(acc_opt.inner_optimizer))
    print(f"[keras2 sparse TF {tf.__version__}] {name} {mode}: max|dw| {dw:.2e}, max|dstate| {ds:.2e}")
    assert dw <= 1e-5
    assert ds <= 1e-5


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_class_matches_the_sparse_large_batch(name):
    _check(name, "eager")


@pytest.mark.parametrize("name", ["sgd_momentum", "adagrad"])
def test_traced_sparse_accumulation_matches_the_sparse_large_batch(name):
    _check(name, "graph")
