"""TF1 graph code: what is the family's own (issue 8): the window phase by
hand, a ``var_list`` that leaves variables out, several train ops sharing one
window, sparse gradients, and ``reduction="sum"`` against the design
document's recipe. (Large-batch equivalence, nothing moving between updates
and missing gradients are contract properties: tests/contract/.)

References: the same graph, initial values and sample order trained with batch
N*B by the plain inner optimizer (:mod:`support.reference_tf1`); values
derived by hand; the design document's hand-written accumulation recipe. Control flow "v2" is TF2's default in a ``tf.Graph``
(resource variables, ``cond_v2``); "v1" is what
``tf.compat.v1.disable_v2_behavior()`` gives (``RefVariable``s, control flow
v1).
"""

from support.families import require

require("tf1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer.families.tf1 import AccumulatingOptimizer  # noqa: E402
from support.graph_deps import micro_step_ops  # noqa: E402
from support.reference_tf1 import (  # noqa: E402
    INNER_OPTIMIZERS,
    assert_bitwise,
    assert_close,
    build_mlp,
    control_flow,
    mlp_data,
    mlp_init,
    model_and_inner_state,
    train_mlp,
    values,
)

tf1 = tf.compat.v1

N, B, UPDATES = 3, 4, 3


# ------------------------------------------------------------ 2. window phase
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_window_phase_by_hand(mode):
    """GD(1.0), N=3, micro-gradients 1..6 on a scalar: w = -(1+2+3)/3 = -2
    after run 3, -2 - (4+5+6)/3 = -7 after run 6; global_step 0,0,1,1,1,2."""
    with control_flow(mode), tf.Graph().as_default(), tf1.Session() as sess:
        w = tf1.Variable(0.0, name="w")
        g = tf1.placeholder(tf.float32, [])
        global_step = tf1.train.get_or_create_global_step()
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(1.0), 3)
        train_op = opt.minimize(g * w, global_step=global_step)  # d(g*w)/dw = g
        sess.run(tf1.global_variables_initializer())
        seen = []
        for k in range(1, 7):
            sess.run(train_op, {g: float(k)})
            seen.append(sess.run([w, global_step, opt.micro_steps]))
    assert [s[0] for s in seen] == [0.0, 0.0, -2.0, -2.0, -2.0, -7.0]
    assert [s[1] for s in seen] == [0, 0, 1, 1, 1, 2]
    assert [s[2] for s in seen] == [1, 2, 3, 4, 5, 6]


def test_vgg_variables_excluded_from_var_list_stay_bitwise_untouched():
    """The design document's case: train only the variables whose name lacks
    'VGG'. The VGG kernel keeps its initial value bitwise and gets no
    accumulator nor slot; the rest matches the plain optimizer trained on
    batch N*B with the same var_list."""
    init = mlp_init(vgg=True)
    expected = train_mlp("Adam", None, N * B, UPDATES, init=init, var_filter=lambda v: "VGG" not in v.name)
    x, y = mlp_data(UPDATES * N * B)
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(init)
        global_step = tf1.train.get_or_create_global_step()
        inner = INNER_OPTIMIZERS["Adam"](global_step)
        opt = AccumulatingOptimizer(inner, N)
        train_vars = [v for v in tf1.trainable_variables() if "VGG" not in v.name]  # as in the design's document
        train_op = opt.minimize(mlp.loss, global_step=global_step, var_list=train_vars)
        sess.run(tf1.global_variables_initializer())
        for k in range(UPDATES * N):
            sess.run(train_op, mlp.feed(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
        actual = model_and_inner_state(sess, mlp, inner, global_step)
        vgg = mlp.variables["VGG/kernel"]
        assert opt.get_slot(vgg, "acc_grad") is None and opt.get_slot(vgg, "m") is None
        assert not any(v.name.startswith("VGG") for v in opt.variables())
    assert_close(actual, expected, tol=1e-5)
    np.testing.assert_array_equal(actual["VGG/kernel"], init["VGG/kernel"])


# -------------------------------------- several train ops sharing one window
def _two_task_graph(init):
    """An embedding table E used sparsely by task A only, a kernel W shared by
    both tasks, and U used by task B only."""
    table = tf1.Variable(init["E"], name="E")
    shared = tf1.Variable(init["W"], name="W")
    head_b = tf1.Variable(init["U"], name="U")

    def loss_a(ids, y):
        h = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
        return tf.reduce_mean(tf.square(tf.matmul(h, shared) - y))

    def loss_b(x, y):
        return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, head_b)), shared) - y))

    return table, shared, head_b, loss_a, loss_b


def test_train_ops_sharing_one_wrapper_share_one_window():
    """Ops A (E sparse, W) and B (W, U) of one wrapper built for [E, W, U],
    with lazy sparse Momentum, N=2. Windows (A,A), (A,B), (B,B), (B,A), (A,A):
    every
    variable with a gradient in the window is updated by its window mean, also
    when the closing op does not use it (E in (A,B), as IndexedSlices over its
    touched rows, so row 5, looked up only in window 1, keeps its momentum as
    in the large batch; U in (B,A)); a variable without one is not (U in
    (A,A), also once it has momentum, E in (B,B): value and momentum bitwise
    untouched). Reference: one plain Momentum step per window on the window's
    mean loss, (la + lb)/2 etc., whose gradient for E is the large batch's
    sparse IndexedSlices; global_step counts 5 updates."""
    rng = np.random.default_rng(7)
    init = {
        "E": rng.normal(size=(9, 3)).astype("float32"),
        "W": rng.normal(size=(3, 2)).astype("float32"),
        "U": rng.normal(size=(3, 3)).astype("float32"),
    }
    runs = list("AAABBBBAAA")
    ids = rng.integers(0, 5, size=(len(runs), 2, 2)).astype("int32")  # rows 6..8 never looked up
    ids[0, 0, 0] = 5  # row 5: window 1 only
    xs = rng.normal(size=(len(runs), 2, 3)).astype("float32")
    ys = rng.normal(size=(len(runs), 2, 2)).astype("float32")

    def inner():
        return tf1.train.MomentumOptimizer(0.1, 0.9)

    def state(sess, variables, opt, global_step):
        return values(sess, variables + [opt.get_slot(v, "momentum") for v in variables] + [global_step])

    with tf.Graph().as_default(), tf1.Session() as sess:
        table, shared, head_b, loss_a, loss_b = _two_task_graph(init)
        ids_ph = tf1.placeholder(tf.int32, [None, 2])
        x_ph = tf1.placeholder(tf.float32, [None, 3])
        y_ph = tf1.placeholder(tf.float32, [None, 2])
        global_step = tf1.train.get_or_create_global_step()
        momentum = inner()
        opt = AccumulatingOptimizer(momentum, 2)
        opt.build([table, shared, head_b], sparse_var_list=[table])
        op_a = opt.minimize(loss_a(ids_ph, y_ph), global_step=global_step, var_list=[table, shared])
        op_b = opt.minimize(loss_b(x_ph, y_ph), global_step=global_step, var_list=[shared, head_b])
        sess.run(tf1.global_variables_initializer())
        got = []
        for k, task in enumerate(runs):
            if task == "A":
                sess.run(op_a, {ids_ph: ids[k], y_ph: ys[k]})
            else:
                sess.run(op_b, {x_ph: xs[k], y_ph: ys[k]})
            if k % 2:
                got.append(state(sess, [table, shared, head_b], momentum, global_step))

    with tf.Graph().as_default(), tf1.Session() as sess:
        table, shared, head_b, loss_a, loss_b = _two_task_graph(init)
        global_step = tf1.train.get_or_create_global_step()
        momentum = inner()
        feeds = [(tf1.placeholder(tf.int32, [None, 2]), tf1.placeholder(tf.float32, [None, 3]),
                  tf1.placeholder(tf.float32, [None, 2])) for _ in range(2)]
        steps = {}
        for w in range(len(runs) // 2):
            window = tuple(runs[2 * w:2 * w + 2])
            if window not in steps:
                terms = [loss_a(i, y) if t == "A" else loss_b(x, y) for t, (i, x, y) in zip(window, feeds)]
                loss = tf.add_n(terms) / 2
                var_list = [v for v, used in ((table, "A" in window), (shared, True), (head_b, "B" in window)) if used]
                grads = tf.gradients(loss, var_list)
                if "A" in window:
                    assert isinstance(grads[0], tf.IndexedSlices)  # the large batch's E gradient is sparse
                steps[window] = momentum.apply_gradients(zip(grads, var_list), global_step=global_step)
        sess.run(tf1.global_variables_initializer())
        want = []
        for w in range(len(runs) // 2):
            feed = {}
            for i, (ids_i, x_i, y_i) in enumerate(feeds):
                k = 2 * w + i
                feed.update({ids_i: ids[k], x_i: xs[k], y_i: ys[k]})
            sess.run(steps[tuple(runs[2 * w:2 * w + 2])], feed)
            want.append(state(sess, [table, shared, head_b], momentum, global_step))

    for g, w in zip(got, want):
        assert_close(g, w, tol=1e-5)
    assert [s["global_step"] for s in got] == [1, 2, 3, 4, 5]
    # (A,A): U and its momentum untouched; (B,B): E and its momentum untouched.
    np.testing.assert_array_equal(got[0]["U"], init["U"])
    np.testing.assert_array_equal(got[0]["U/Momentum"], 0.0)
    assert np.all(got[3]["U/Momentum"] != 0)
    for name in ("U", "U/Momentum"):
        np.testing.assert_array_equal(got[4][name], got[3][name])
    for name in ("E", "E/Momentum"):
        np.testing.assert_array_equal(got[2][name], got[1][name])
    # Row 5 moved in window 1 and, lazily, not in window 2 (closed by B).
    assert np.all(got[0]["E/Momentum"][5] != 0)
    np.testing.assert_array_equal(got[1]["E"][5], got[0]["E"][5])
    # Lazy: rows never looked up keep momentum 0 and their initial values.
    np.testing.assert_array_equal(got[-1]["E/Momentum"][6:], 0.0)
    np.testing.assert_array_equal(got[-1]["E"][6:], init["E"][6:])


def test_a_variable_outside_the_built_window_is_refused():
    """A second train op with a variable the wrapper was not built for raises
    ValueError naming it and the fix (build with the union)."""
    with tf.Graph().as_default():
        a = tf1.Variable(1.0, name="a")
        b = tf1.Variable(2.0, name="b")
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.1), 2)
        opt.minimize(a * a)
        with pytest.raises(ValueError, match=r"got gradients for others: \['b:0'\].*opt\.build"):
            opt.minimize(a * b)


# ------------------------------------------------------------ 5. sparse
VOCAB, DIM = 13, 3


def _sparse_graph(init):
    table = tf1.Variable(init["E"], name="E")
    kernel = tf1.Variable(init["K"], name="K")
    ids = tf1.placeholder(tf.int32, [None, 2], name="ids")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    h = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(h), kernel) - y))
    return table, kernel, ids, y, loss


def _sparse_data():
    """Micro-batches of ids with repeats; rows >= 9 are never looked up; rows
    7 and 8 only in the first window (so lazy updates leave them alone in the
    second, where a dense update would move them)."""
    rng = np.random.default_rng(3)
    n = 2 * N
    ids = rng.integers(0, 7, size=(n * B, 2)).astype("int32")
    ids[0, 0], ids[B, 1] = 7, 8  # first window only
    y = rng.normal(size=(n * B, 2)).astype("float32")
    return ids, y


SPARSE_INNER = {
    "Momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
    "Adagrad": lambda: tf1.train.AdagradOptimizer(0.3),
    "Adam": lambda: tf1.train.AdamOptimizer(0.05),
    "Ftrl": lambda: tf1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.01),
}


def _train_sparse(inner_name, n, micro_batch, mode="v2"):
    rng = np.random.default_rng(5)
    init = {"E": rng.normal(size=(VOCAB, DIM)).astype("float32"), "K": rng.normal(size=(DIM, 2)).astype("float32")}
    ids_data, y_data = _sparse_data()
    snapshots = []
    with control_flow(mode), tf.Graph().as_default(), tf1.Session() as sess:
        table, kernel, ids, y, loss = _sparse_graph(init)
        inner = SPARSE_INNER[inner_name]()
        opt = inner if n is None else AccumulatingOptimizer(inner, n)
        train_op = opt.minimize(loss)
        sess.run(tf1.global_variables_initializer())
        runs = len(ids_data) // micro_batch
        for k in range(runs):
            batch = slice(k * micro_batch, (k + 1) * micro_batch)
            sess.run(train_op, {ids: ids_data[batch], y: y_data[batch]})
            if (k + 1) % (n or 1) == 0:
                snapshots.append(values(sess, [table, kernel] + list(inner.variables())))
    return init, snapshots


@pytest.mark.parametrize("inner_name", list(SPARSE_INNER))
def test_sparse_window_matches_the_sparse_large_batch(inner_name):
    """Embedding-lookup gradients: after each update, the table, the kernel
    and every slot equal the plain optimizer trained on batch N*B with its own
    (sparse) gradient within 1e-5; rows never looked up are bitwise
    untouched (value, and slots where the optimizer is lazy)."""
    init, expected = _train_sparse(inner_name, None, N * B)
    _, actual = _train_sparse(inner_name, N, B)
    for got, want in zip(actual, expected):
        assert_close(got, want, tol=1e-5)
    np.testing.assert_array_equal(actual[-1]["E"][9:], init["E"][9:])
    if inner_name == "Momentum":
        _assert_lazy(expected, actual)


def test_sparse_momentum_under_control_flow_v1_is_lazy_like_the_large_batch():
    """The same with RefVariables and control flow v1."""
    _, expected = _train_sparse("Momentum", None, N * B, mode="v1")
    _, actual = _train_sparse("Momentum", N, B, mode="v1")
    for got, want in zip(actual, expected):
        assert_close(got, want, tol=1e-5)
    _assert_lazy(expected, actual)


def _assert_lazy(expected, actual):
    """TF1 Momentum applies IndexedSlices lazily: rows 7 and 8, looked up only
    in the first window, keep their momentum and value through the second
    update in the reference, and so must they with accumulation (a dense
    window gradient would decay their momentum and move them)."""
    for snaps in (expected, actual):
        first, second = snaps
        np.testing.assert_array_equal(second["E"][7:9], first["E"][7:9])
        np.testing.assert_array_equal(second["E/Momentum"][7:9], first["E/Momentum"][7:9])
        assert np.all(first["E/Momentum"][7:9] != 0)  # they did move in window 1
        np.testing.assert_array_equal(second["E/Momentum"][9:], 0.0)


def _densifying_ops(train_op):
    """Ops among the ancestors of ``train_op`` in its own graph (what every
    run executes; the update branch is a separate function under cond_v2)
    that turn IndexedSlices into a dense tensor: ``tf.convert_to_tensor`` of
    IndexedSlices is an UnsortedSegmentSum over the variable's rows."""
    seen, stack, found = set(), [train_op], []
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type == "UnsortedSegmentSum":
            found.append(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def test_sparse_gradients_are_scatter_added_never_densified():
    """No micro-step op densifies the embedding gradient (the accumulator
    gets a ResourceScatterAdd). Control: the same check finds the
    densification in a graph that converts the gradient to a tensor."""
    rng = np.random.default_rng(5)
    init = {"E": rng.normal(size=(VOCAB, DIM)).astype("float32"), "K": rng.normal(size=(DIM, 2)).astype("float32")}
    with tf.Graph().as_default():
        table, kernel, ids, y, loss = _sparse_graph(init)
        opt = AccumulatingOptimizer(tf1.train.MomentumOptimizer(0.1, 0.9), N)
        grads_and_vars = opt.compute_gradients(loss)
        assert isinstance(grads_and_vars[0][0], tf.IndexedSlices)
        train_op = opt.apply_gradients(grads_and_vars)
        assert _densifying_ops(train_op) == []
        accumulate_only = micro_step_ops(tf1.get_default_graph())  # (the window cond's false branch too)
        assert "UnsortedSegmentSum" not in {op.type for op in accumulate_only}
        assert any(op.type == "ResourceScatterAdd" for op in accumulate_only)
        densified = opt.apply_gradients([(tf.convert_to_tensor(g), v) for g, v in grads_and_vars])
        assert _densifying_ops(densified) != []


# ------------------------------------------------------------ 6. reduction
def test_reduction_sum_is_the_design_documents_recipe():
    """reduction='sum' equals, bitwise, the hand-written TF1 recipe: accumulator
    variables, ``sess.run(accum_ops)`` on every micro-batch, ``sess.run(
    train_step)`` (the plain optimizer applied to the sums) every N-th, then
    ``sess.run(zero_ops)``."""
    x, y = mlp_data(UPDATES * N * B)
    init = mlp_init()
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(init)
        global_step = tf1.train.get_or_create_global_step()
        inner = tf1.train.AdamOptimizer(0.01)
        train_vars = list(mlp.variables.values())
        accum = [tf1.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in train_vars]
        zero_ops = [a.assign(tf.zeros_like(a)) for a in accum]
        gvs = inner.compute_gradients(mlp.loss, train_vars)
        accum_ops = [accum[i].assign_add(g) for i, (g, _) in enumerate(gvs)]
        train_step = inner.apply_gradients([(accum[i], v) for i, (_, v) in enumerate(gvs)], global_step=global_step)
        sess.run(tf1.global_variables_initializer())
        for k in range(UPDATES * N):
            sess.run(accum_ops, mlp.feed(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
            if (k + 1) % N == 0:
                sess.run(train_step)
                sess.run(zero_ops)
        expected = model_and_inner_state(sess, mlp, inner, global_step)
    assert_bitwise(_train_sum(init, x, y), expected)


def _train_sum(init, x, y):
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(init)
        global_step = tf1.train.get_or_create_global_step()
        inner = tf1.train.AdamOptimizer(0.01)
        opt = AccumulatingOptimizer(inner, N, reduction="sum")
        train_op = opt.minimize(mlp.loss, global_step=global_step, var_list=list(mlp.variables.values()))
        sess.run(tf1.global_variables_initializer())
        for k in range(UPDATES * N):
            sess.run(train_op, mlp.feed(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
        return model_and_inner_state(sess, mlp, inner, global_step)
