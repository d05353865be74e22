"""The sparse window: an update that costs O(rows touched) for embedding tables.

Setting: ``Embedding(V=40, D=4)`` -> mean over 5 ids -> ``Dense(2)``, MSE;
ids drawn from rows 0..11 only, so every micro-batch repeats ids, windows
repeat them across micro-batches, and rows 12..39 are never looked up.
``N = 4`` micro-batches of ``B = 3`` against the plain inner optimizer on
batch ``N * B = 12`` (same initial weights, same samples in the same order).

Which large batch is the reference depends on the inner optimizer
(``accum_optimizer.families.keras3._keeps_slices_sparse``):

* plain ``SGD`` gets the window as ``tf.IndexedSlices`` over the touched rows
  (each once) and applies it as a scatter; SGD is linear in the gradient, so
  this equals the large batch trained on its *own* ``IndexedSlices`` (with
  repeated ids), and rows no sample looked up stay bitwise unchanged.
  ``SGD(momentum=0.9)`` densifies slices itself and gets the dense window;
  Keras applies its own slices exactly like the dense gradient too.
* Adam, Adagrad and Ftrl square the gradient: on slices with repeated ids
  they square each slice before the duplicates are combined, so the large
  batch on its own slices is a different optimizer step. They get the dense
  window gradient, which equals the large batch trained on the dense
  gradient (the ids deduplicated: ``tf.convert_to_tensor`` of its slices).

Tolerance 1e-6: float32 sums of the same 12 per-sample terms in a different
order (the window sums per micro-batch first), a few ulps of weights of
order 1, as in tests/keras3/test_sparse.py.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

from accum_optimizer import AccumulatingOptimizer
from support.reference import max_abs_diff, mse, weights

VOCAB, DIM, IDS, USED = 40, 4, 5, 12
N, B, WINDOWS = 4, 3, 3
TOL = 1e-6


def _model(vocab=VOCAB, dim=DIM, tied=False):
    keras.utils.set_random_seed(21)
    inp = keras.Input((IDS,), dtype="int32")
    embedding = keras.layers.Embedding(vocab, dim, name="table")
    h = keras.layers.GlobalAveragePooling1D()(embedding(inp))
    if not tied:
        return keras.Model(inp, keras.layers.Dense(2)(h))
    # Tied: the table is also the output projection (logits over the vocabulary).
    out = keras.layers.Lambda(lambda t: keras.ops.matmul(t, keras.ops.transpose(embedding.embeddings)))(h)
    return keras.Model(inp, out)


def _data(n, out_dim=2, seed=4):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, USED, size=(n, IDS)).astype("int32")
    y = rng.normal(size=(n, out_dim)).astype("float32")
    return ids, y


def _step(model, opt, densify=False):
    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads[0]

    return step


def _run(inner_fn, ref_densify, tied=False, out_dim=2):
    x, y = _data(N * B * WINDOWS, out_dim)
    ref, acc = _model(tied=tied), _model(tied=tied)
    ref_opt, acc_opt = inner_fn(), AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=N)
    ref_step, acc_step = _step(ref, ref_opt, densify=ref_densify), _step(acc, acc_opt)
    for w in range(WINDOWS):
        ref_step(x[w * N * B : (w + 1) * N * B], y[w * N * B : (w + 1) * N * B])
    for s in range(N * WINDOWS):
        grad = acc_step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    assert int(acc_opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == WINDOWS
    return ref, acc, ref_opt, acc_opt, acc_step, grad


def _update_branch_ops(step, x, y):
    """The ops of the traced step's update branch (the window's closing
    micro-step: the `cond` branch that calls the inner optimizer)."""
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    branches = [function_def_to_graph(f) for name, f in library.items() if "cond_true" in name]
    return [op for g in branches for op in g.get_operations()]


def _table_sized(ops, types):
    """Ops among ``types`` whose output is a dense (VOCAB, DIM) tensor."""
    return [op.type for op in ops if op.type in types and op.outputs
            and op.outputs[0].shape.rank == 2 and op.outputs[0].shape.as_list() == [VOCAB, DIM]]


@pytest.mark.parametrize(
    "inner_fn",
    [lambda: keras.optimizers.SGD(0.5), lambda: keras.optimizers.SGD(0.5, momentum=0.9)],
    ids=["sgd", "sgd_momentum"],
)
def test_sgd_window_equals_large_batch_on_its_own_indexed_slices(inner_fn):
    ref, acc, ref_opt, acc_opt, _, grad = _run(inner_fn, ref_densify=False)
    assert isinstance(grad, tf.IndexedSlices)  # the window really is sparse
    assert max_abs_diff(weights(ref), weights(acc)) <= TOL
    assert max_abs_diff(
        [v.numpy() for v in ref_opt.variables], [v.numpy() for v in acc_opt.inner_optimizer.variables]
    ) <= TOL
    # Rows no sample looked up: bitwise their initial values, as in the reference.
    initial = _model().get_layer("table").embeddings.numpy()
    table = acc.get_layer("table").embeddings.numpy()
    np.testing.assert_array_equal(table[USED:], initial[USED:])
    assert max_abs_diff([table[:USED]], [initial[:USED]]) > 1e-3  # the looked-up rows did move
    # The window's accumulator and row marks are clear after the last update.
    assert not np.any(acc_opt.acc_grads[0].numpy()) and not np.any(acc_opt.touched_rows[0].numpy())


def test_plain_sgd_update_is_a_scatter_and_never_dense_over_the_table():
    ref, acc, ref_opt, acc_opt, step, _ = _run(lambda: keras.optimizers.SGD(0.5), ref_densify=False)
    x, y = _data(B)
    ops = _update_branch_ops(step, x, y)
    types = [op.type for op in ops]
    assert "ResourceScatterSub" in types  # the inner SGD's sparse update
    assert "ResourceScatterUpdate" in types  # zeroing the touched rows
    # Nothing table-sized: no densified slices, no dense zeros, no dense read-modify-write.
    assert _table_sized(ops, {"UnsortedSegmentSum", "Fill", "RealDiv", "Mul", "Sub", "AddV2"}) == []


@pytest.mark.parametrize(
    "inner_fn",
    [lambda: keras.optimizers.Adam(5e-2), lambda: keras.optimizers.Adagrad(0.5),
     lambda: keras.optimizers.Ftrl(0.5)],
    ids=["adam", "adagrad", "ftrl"],
)
def test_squaring_optimizers_equal_the_large_batch_with_deduplicated_ids(inner_fn):
    ref, acc, ref_opt, acc_opt, step, grad = _run(inner_fn, ref_densify=True)
    assert isinstance(grad, tf.IndexedSlices)
    assert max_abs_diff(weights(ref), weights(acc)) <= TOL
    assert max_abs_diff(
        [v.numpy() for v in ref_opt.variables], [v.numpy() for v in acc_opt.inner_optimizer.variables]
    ) <= TOL
    # They get the dense window (no slices to densify: no UnsortedSegmentSum
    # in the update), and still only the touched rows are zeroed (no
    # table-sized Fill).
    x, y = _data(B)
    ops = _update_branch_ops(step, x, y)
    assert _table_sized(ops, {"UnsortedSegmentSum", "Fill"}) == []
    assert "ResourceScatterUpdate" in [op.type for op in ops]


def test_adam_on_its_own_repeated_id_slices_is_a_different_step():
    # What the README states: the large batch trained on its own slices with
    # repeated ids differs from the window (= the dense large batch) for Adam.
    # Printed (-s) for the README; the assertion keeps the two references
    # distinguishable, so the dense-reference test above is not vacuous.
    inner_fn = lambda: keras.optimizers.Adam(5e-2)  # noqa: E731
    ref_own, acc, *_ = _run(inner_fn, ref_densify=False)
    ref_dense, *_ = _run(inner_fn, ref_densify=True)
    own = max_abs_diff(weights(ref_own), weights(acc))
    dense = max_abs_diff(weights(ref_dense), weights(acc))
    print(f"\nmax |window - large batch on its own IndexedSlices| (Adam, repeated ids): {own:.3e}; "
          f"against the dense large batch: {dense:.3e}")
    assert dense <= TOL < 100 * TOL < own


def test_tied_embedding_gets_a_dense_gradient_and_the_dense_path():
    # Lookup + output projection: TF adds the slices to the dense matmul
    # gradient, so the table's gradient is dense on every micro-step, and the
    # window is the dense one (equal to the large batch, whose gradient is the
    # same dense tensor).
    ref, acc, ref_opt, acc_opt, step, grad = _run(
        lambda: keras.optimizers.SGD(0.5), ref_densify=False, tied=True, out_dim=VOCAB
    )
    assert not isinstance(grad, tf.IndexedSlices)
    assert max_abs_diff(weights(ref), weights(acc)) <= TOL
    x, y = _data(B, VOCAB)
    types = [op.type for op in _update_branch_ops(step, x, y)]
    assert "ResourceScatterSub" not in types and "Where" not in types  # no sparse window


@pytest.mark.parametrize("dense_at", [0, N - 1], ids=["dense_first", "dense_closing"])
def test_a_dense_gradient_within_a_window_marks_every_row(dense_at):
    # One micro-step per window hands the table a dense gradient (another
    # traced function), the others slices. Closing on the dense one takes the
    # dense path; closing on slices gives a sparse window over every row
    # (the dense micro-step touched them all). Both equal the large batch.
    x, y = _data(N * B * WINDOWS)
    ref, acc = _model(), _model()
    ref_opt = keras.optimizers.SGD(0.5)
    acc_opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=N)
    ref_step = _step(ref, ref_opt)
    sparse_step, dense_step = _step(acc, acc_opt), _step(acc, acc_opt, densify=True)
    for w in range(WINDOWS):
        ref_step(x[w * N * B : (w + 1) * N * B], y[w * N * B : (w + 1) * N * B])
    for s in range(N * WINDOWS):
        fn = dense_step if s % N == dense_at else sparse_step
        fn(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    assert int(acc_opt.iterations.numpy()) == WINDOWS
    assert max_abs_diff(weights(ref), weights(acc)) <= TOL
    assert not np.any(acc_opt.acc_grads[0].numpy()) and not np.any(acc_opt.touched_rows[0].numpy())


def test_state_saved_without_row_trackers_restores_every_accumulated_row(tmp_path):
    # State written by a version without trackers (simulated: the saved
    # store without its tracker entries), mid-window, loads into a fresh
    # model and optimizer; the rows the restored accumulator holds are marked,
    # so the window closes with all of them: equal to uninterrupted training.
    x, y = _data(N * B * WINDOWS)
    split = N * B + 2 * B  # two micro-steps into the second window
    model = _model()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=N)
    step = _step(model, opt)
    for s in range(split // B):
        step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    store = {}
    opt.save_own_variables(store)
    n_trackers = len(opt.touched_rows)
    assert n_trackers == len(model.trainable_variables)  # table, kernel, bias: all rank >= 1
    old_store = {str(i): store[str(i)] for i in range(len(store) - n_trackers)}
    assert np.any(store[str(2)])  # the table's accumulator holds the window so far

    def resume(clear_marks):
        resumed = _model()
        resumed.set_weights(snapshot)
        resumed_opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=N)
        resumed_opt.build(resumed.trainable_variables)
        resumed_opt.load_own_variables(old_store)
        marked = resumed_opt.touched_rows[0].numpy() > 0
        np.testing.assert_array_equal(marked, np.any(store["2"] != 0, axis=1))
        if clear_marks:
            for t in resumed_opt.touched_rows:
                t.assign(np.zeros(t.shape, "float16"))
        resumed_step = _step(resumed, resumed_opt)
        for s in range(split // B, N * WINDOWS):
            resumed_step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
        return np.concatenate([w.ravel() for w in weights(resumed)])

    snapshot = model.get_weights()
    for s in range(split // B, N * WINDOWS):
        step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    uninterrupted = np.concatenate([w.ravel() for w in weights(model)])
    np.testing.assert_array_equal(resume(clear_marks=False), uninterrupted)
    # The check can fail: without the marks, the closing sparse window drops
    # the restored rows.
    assert np.max(np.abs(resume(clear_marks=True) - uninterrupted)) > 1e-3


def test_state_saved_with_row_trackers_resumes_mid_window_bitwise(tmp_path):
    x, y = _data(N * B * WINDOWS)
    model = _model()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=N)
    model.compile(opt, "mse")
    step = _step(model, opt)
    for s in range(N + 2):
        step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert np.any(loaded.optimizer.touched_rows[0].numpy())
    for a, b in zip(opt.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    loaded_step = _step(loaded, loaded.optimizer)
    for s in range(N + 2, N * WINDOWS):
        step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
        loaded_step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B])
    for a, b in zip(weights(model), weights(loaded)):
        np.testing.assert_array_equal(a, b)


def test_mirrored_fit_with_embedding_matches_single_device_large_batch(strategy):
    # 2 replicas, global micro-batch 2*B: each replica accumulates its slices
    # and marks its rows; the sparse window (plain SGD) is all-reduced once
    # per update by the inner optimizer. Reference: one device, batch N*2*B.
    rng = np.random.default_rng(2)
    b = 2 * B
    x = rng.integers(0, USED, size=(N * b * WINDOWS, IDS)).astype("int32")
    y = rng.normal(size=(N * b * WINDOWS, 2)).astype("float32")
    for inner_fn in (lambda: keras.optimizers.SGD(0.5), lambda: keras.optimizers.Adam(5e-2)):
        with strategy.scope():
            model = _model()
            opt = AccumulatingOptimizer(inner_fn(), N)
            model.compile(opt, "mse")
        model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
        ref = _model()
        ref_opt = inner_fn()
        ref_step = _step(ref, ref_opt, densify=True)  # Adam: the dense large batch (see the module doc)
        for w in range(WINDOWS):
            ref_step(x[w * N * b : (w + 1) * N * b], y[w * N * b : (w + 1) * N * b])
        assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == WINDOWS
        assert max_abs_diff(weights(ref), weights(_model())) > 1e-3
        # 1e-5: as tests/keras3/test_distribution.py (two replicas' float32 partial
        # sums, Adam's division by sqrt(v) amplifying their rounding).
        assert max_abs_diff(weights(model), weights(ref)) <= 1e-5
        table = model.get_layer("table").embeddings.numpy()
        np.testing.assert_array_equal(table[USED:], _model().get_layer("table").embeddings.numpy()[USED:])
