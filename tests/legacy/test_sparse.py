"""Sparse (``Embedding``) gradients with legacy optimizers.

``OptimizerV2`` applies ``tf.IndexedSlices`` through
``_resource_apply_sparse``; lazy optimizers (momentum SGD, tfa ``LazyAdam``)
update only the rows present. The reference is therefore the large batch
trained on its own *sparse* gradient: rows no sample of the window looked up
keep their weights and slots. The wrapper must hand the inner optimizer the
window's touched rows as ``tf.IndexedSlices`` (each once, summed), and must
not densify on micro-steps.
"""

from support.families import require, requires

require("legacy")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework.function_def_to_graph import function_def_to_graph  # noqa: E402

from support import reference as R  # noqa: E402
from support.graph_deps import micro_step_ops  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

L = tf.keras.optimizers.legacy
N, B, UPDATES = 3, 2, 3
TOL = 1e-5


def _windowed_ids(n):
    """Ids such that update u looks up only rows {4u % 12 .. 4u % 12 + 3} and
    rows 8-11 are never looked up by the first two updates: rows touched in
    one window and not the next are where lazy and dense updates differ."""
    rng = np.random.default_rng(1)
    per_update = N * B
    x = np.stack([rng.integers(0, 4, size=R.SEQ) + 4 * ((i // per_update) % 2) for i in range(n)]).astype(np.int32)
    return x, rng.normal(size=(n, R.OUT)).astype(np.float32)


def _densified_step(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = R.mse(y, model(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _dense_reference(make_inner):
    x, y = _windowed_ids(N * B * UPDATES)
    model = R.embedding_model()
    step = _densified_step(model, make_inner(model))
    for u in range(UPDATES):
        step(tf.constant(x[u * N * B:(u + 1) * N * B]), tf.constant(y[u * N * B:(u + 1) * N * B]))
    return model


CASES = {"SGD(momentum)": lambda m: L.SGD(0.1, momentum=0.9), "Adam": lambda m: L.Adam(0.05)}


def _tfa_cases():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tensorflow_addons as tfa
    return {"LazyAdam": lambda m: tfa.optimizers.LazyAdam(0.05)}


def _check_sparse(make_inner, lazy):
    ref, acc = R.run_pair(make_inner, N, B, UPDATES, model_fn=R.embedding_model, data_fn=_windowed_ids)
    assert R.moved(ref) > 1e-3
    assert R.trajectory_diff(ref, acc) <= TOL
    assert R.state_diff(ref, acc) <= TOL
    table = acc["model"].layers[0].embeddings
    # Rows 8-11 were never looked up: bitwise their initial values.
    np.testing.assert_array_equal(table.numpy()[8:], acc["initial"][0][8:])
    if lazy:
        # The comparison can fail: the dense-gradient large batch differs from
        # the sparse one for a lazy optimizer (rows 0-3 keep moving on
        # momentum in the windows that do not look them up).
        dense = _dense_reference(make_inner)
        assert R.max_abs_diff(dense.get_weights(), ref["model"].get_weights()) > 100 * TOL


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_window_equals_sparse_large_batch(name):
    _check_sparse(CASES[name], lazy=name == "SGD(momentum)")


@requires("tfa")
def test_sparse_window_lazy_adam_equals_sparse_large_batch():
    _check_sparse(_tfa_cases()["LazyAdam"], lazy=True)


def _all_ops(graph):
    ops = list(graph.get_operations())
    for fdef in graph.as_graph_def().library.function:
        ops += list(function_def_to_graph(fdef).get_operations())
    return ops


def _densifications(ops, vocab):
    """IndexedSlices-to-dense conversions (an ``UnsortedSegmentSum`` with
    ``vocab`` segments) or dense writes of a table-sized value."""
    bad = []
    for op in ops:
        if op.type == "UnsortedSegmentSum" and op.outputs[0].shape.rank and op.outputs[0].shape[0] == vocab:
            bad.append(op.type)
        if op.type in ("AssignAddVariableOp", "AssignVariableOp") and op.inputs[1].shape.rank == 2:
            if op.inputs[1].shape[0] == vocab:
                bad.append(op.type)
    return bad


def _graph(model, opt, step_fn=None):
    x, y = R.embedding_data(B, vocab_used=4)
    step = step_fn(model, opt) if step_fn else R.make_train_step(model, opt)
    return step.get_concrete_function(tf.constant(x), tf.constant(y)).graph


def test_micro_step_scatter_adds_and_never_densifies():
    model = R.embedding_model()
    opt = AccumulatingOptimizer(L.SGD(0.1, momentum=0.9), N)
    graph = _graph(model, opt)
    for branch in ("else_branch", "then_branch"):  # an accumulate-only micro-step, an update
        assert [op.type for op in micro_step_ops(graph, branch)].count("ResourceScatterAdd") == 1  # the table's accumulator
    assert _densifications(_all_ops(graph), R.VOCAB) == []  # (the update too: momentum SGD is lazy)
    # The check is not vacuous: a step that densifies the gradient is caught.
    plain = R.embedding_model()
    assert _densifications(_all_ops(_graph(plain, L.SGD(0.1, momentum=0.9), _densified_step)), R.VOCAB) != []


def _lazy_adam():
    tfa = pytest.importorskip("tensorflow_addons", reason="tensorflow-addons: the tf215 leg")
    return tfa.optimizers.LazyAdam(0.05)


@pytest.mark.parametrize("inner_fn", [lambda: L.SGD(0.1, momentum=0.9), _lazy_adam], ids=["sgd_momentum", "lazy_adam"])
def test_sparse_weighted_windows_and_flush_equal_the_large_batches(inner_fn):
    """Embedding (IndexedSlices gradients), micro-batches of 3, 1, 4 (one
    window of N = 3, weights = sample counts) then 2, 2 and a flush: equal
    the plain inner optimizer on batches of 8 and 4, and the rows no sample
    looked up keep their value and slots bitwise (the sparse window reaches
    lazy optimizers as IndexedSlices over the touched rows)."""
    from support.reference import OUT, SEQ, embedding_data, embedding_model, max_abs_diff, mse, weights

    # One trace for every micro-batch size.
    signature = [tf.TensorSpec([None, SEQ], tf.int32), tf.TensorSpec([None, OUT], tf.float32)]

    sizes, windows = [3, 1, 4, 2, 2], [8, 4]
    x, y = embedding_data(sum(sizes), vocab_used=8)
    ref, ref_opt = embedding_model(0), inner_fn()
    model, opt = embedding_model(0), AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=3)

    def grads(m, xs, ys):
        with tf.GradientTape() as tape:
            loss = mse(ys, m(xs, training=True))
        return tape.gradient(loss, m.trainable_variables)

    @tf.function(input_signature=signature)
    def ref_step(xs, ys):
        ref_opt.apply_gradients(zip(grads(ref, xs, ys), ref.trainable_variables))

    @tf.function(input_signature=signature + [tf.TensorSpec([], tf.float32)])
    def step(xs, ys, weight):
        g = grads(model, xs, ys)
        assert isinstance(g[0], tf.IndexedSlices)
        opt.apply_gradients(zip(g, model.trainable_variables), weight=weight)

    start = 0
    for n in windows:
        ref_step(x[start: start + n], y[start: start + n])
        start += n
    start = 0
    for b in sizes:
        step(x[start: start + b], y[start: start + b], tf.constant(float(b)))
        start += b
    opt.flush()
    assert int(opt.iterations.numpy()) == 2 and int(opt.micro_steps.numpy()) == 5
    # 1e-6: float32 rounding of a few updates (the weighted window forms c * (S / c)).
    assert max_abs_diff(weights(ref), weights(model)) <= 1e-6
    assert max_abs_diff([w.numpy() for w in ref_opt.weights], [w.numpy() for w in opt.inner_optimizer.weights]) <= 1e-6
    table = model.trainable_variables[0].numpy()
    np.testing.assert_array_equal(table[8:], embedding_model(0).trainable_variables[0].numpy()[8:])



def _numpy_slices(rows, values):
    """A ``tf.IndexedSlices`` whose parts are NumPy arrays (which
    ``OptimizerV2.apply_gradients`` accepts)."""
    return tf.IndexedSlices(np.asarray(values, np.float32), np.asarray(rows, np.int64), np.array([6, 2], np.int64))


# Three micro-steps' gradients of a (6, 2) table, touching rows 1, 3 and 1 again.
NUMPY_MICRO_GRADS = [([1, 3], [[1.0, 2.0], [3.0, 4.0]]), ([3], [[0.5, -1.0]]), ([1, 4], [[-2.0, 1.0], [1.0, 1.0]])]


@pytest.mark.parametrize("n", [1, 3])
def test_indexed_slices_with_numpy_parts_train_like_the_plain_optimizer(n):
    """Issue 22, item 4 (crashed at N > 1 in the accumulation's cast).
    Reference: the plain optimizer given the same NumPy slices (N = 1,
    bitwise), or, for N = 3, the large batch's gradient: the three
    micro-steps' slices concatenated, values divided by 3 (the window mean;
    the plain optimizer sums duplicate rows)."""
    initial = np.arange(12, dtype=np.float32).reshape(6, 2) / 10
    ref_var, acc_var = tf.Variable(initial), tf.Variable(initial)
    ref, acc = L.Adam(0.1), AccumulatingOptimizer(L.Adam(0.1), n)
    for rows, values in NUMPY_MICRO_GRADS:
        acc.apply_gradients([(_numpy_slices(rows, values), acc_var)])
        if n == 1:
            ref.apply_gradients([(_numpy_slices(rows, values), ref_var)])
    if n == 1:
        np.testing.assert_array_equal(acc_var.numpy(), ref_var.numpy())
    else:
        rows = np.concatenate([r for r, _ in NUMPY_MICRO_GRADS])
        values = np.concatenate([np.asarray(v, np.float32) for _, v in NUMPY_MICRO_GRADS]) / 3
        ref.apply_gradients([(_numpy_slices(rows, values), ref_var)])
        np.testing.assert_allclose(acc_var.numpy(), ref_var.numpy(), rtol=0, atol=TOL)
        assert int(acc.iterations.numpy()) == 1
    assert not np.array_equal(acc_var.numpy(), initial)
