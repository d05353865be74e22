"""Sparse (`tf.IndexedSlices`) gradients stay sparse while they accumulate.

Reference: the same embedding model trained by the plain optimizer with batch
N*B on *dense* gradients (``tf.convert_to_tensor`` of the slices).
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.graph_deps import micro_step_ops
from support.reference import densifications, max_abs_diff, mse, table_data, table_model, weights

VOCAB, DIM = 40, 4


def _step(model, opt, densify):
    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


@pytest.mark.parametrize(
    "inner_fn",
    [lambda: keras.optimizers.SGD(0.5, momentum=0.9), lambda: keras.optimizers.Adam(5e-2)],
    ids=["sgd_momentum", "adam"],
)
def test_sparse_accumulation_matches_dense_large_batch(inner_fn):
    n, mb, windows = 4, 3, 3
    x, y = table_data(n * mb * windows)
    ref, acc = table_model(VOCAB, DIM), table_model(VOCAB, DIM)
    ref_opt = inner_fn()
    acc_opt = AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=n)
    ref_step, acc_step = _step(ref, ref_opt, densify=True), _step(acc, acc_opt, densify=False)

    # The accumulating run really receives IndexedSlices.
    with tf.GradientTape() as tape:
        loss = mse(y[:mb], acc(x[:mb]))
    assert isinstance(tape.gradient(loss, acc.trainable_variables)[0], tf.IndexedSlices)

    for s in range(windows):
        ref_step(x[s * n * mb : (s + 1) * n * mb], y[s * n * mb : (s + 1) * n * mb])
    for s in range(n * windows):
        acc_step(x[s * mb : (s + 1) * mb], y[s * mb : (s + 1) * mb])
    assert int(acc_opt.iterations.numpy()) == windows
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6
    assert max_abs_diff(
        [v.numpy() for v in ref_opt.variables], [v.numpy() for v in acc_opt.inner_optimizer.variables]
    ) <= 1e-6


def _traced_micro_step(model, opt, vocab):
    x, y = table_data(8)
    return _step(model, opt, densify=False).get_concrete_function(tf.constant(x), tf.constant(y)).graph


def test_densification_check_catches_keras_builtin_accumulation():
    # The check of tests/contract/test_sparse.py is not vacuous: Keras'
    # built-in accumulation densifies the embedding gradient on every
    # micro-step (in its `cond`'s false branch, the accumulate step) and the
    # same check sees it.
    vocab, dim = 200_000, 8
    model = table_model(vocab, dim)
    opt = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=8)
    graph = _traced_micro_step(model, opt, vocab)
    assert [op.type for op in graph.get_operations()].count("If") + [
        op.type for op in graph.get_operations()].count("StatelessIf") == 1
    assert densifications(micro_step_ops(graph), vocab, dim) != []


def test_traced_step_keeps_no_accumulator_sized_constant_alive():
    # Zeroing the slots with a constant `zeros(shape)` lets TF's graph
    # optimizer fold it into a constant as large as the table, which the
    # traced function keeps resident. After the first traced micro-step the
    # allocator may hold only small extras, not another table.
    vocab, dim = 400_000, 16
    table_bytes = vocab * dim * 4
    model = table_model(vocab, dim)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=4)
    opt.build(model.trainable_variables)
    step = _step(model, opt, densify=False)
    x, y = table_data(8)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(tf.constant(x), tf.constant(y))
    after = tf.config.experimental.get_memory_info("CPU:0")["current"]
    assert after - before < table_bytes / 2
