"""Legacy optimizers in a ``tf.compat.v1`` graph (TF1-style code with
``tf.keras.optimizers.legacy.*``, Keras 2's graph-mode ``fit``), where
nothing runs unless fetched: ``apply_gradients``, ``minimize`` and ``flush``
return the op to run, as ``OptimizerV2`` does (issue 22, item 1: they
returned ``None``, and ``sess.run(train_op)`` failed).

References: the plain inner optimizer in the same graph code, at batch B
(N = 1: bitwise) or at batch N·B (N > 1: within 1e-5, float32 rounding of
the batch sums); a flushed partial window against a plain step on that
window's samples.
"""

from support.families import require

require("legacy")

import contextlib  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

L = tf.keras.optimizers.legacy
tf1 = tf.compat.v1
B, TOL = 2, 1e-5


@contextlib.contextmanager
def _control_flow(mode):
    """``"v2"``: TF2's ``cond_v2`` in the graph; ``"v1"``: the control flow
    v1 of ``disable_v2_behavior`` code (restored afterwards)."""
    if mode == "v2":
        yield
        return
    enabled = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        if enabled:
            tf1.enable_control_flow_v2()


def _train_in_graph(make_opt, batches, api, flush_after=None, mode="v2"):
    """Build a linear model's train op in a v1 graph (control flow ``mode``),
    ``sess.run`` it once per batch (then the flush op, if ``flush_after``),
    return the weights and ``iterations``."""
    graph = tf.Graph()
    with _control_flow(mode), graph.as_default():
        rng = np.random.default_rng(0)
        w = tf1.Variable(rng.normal(size=(R.IN, R.OUT)).astype(np.float32), use_resource=True)
        b = tf1.Variable(np.zeros(R.OUT, np.float32), use_resource=True)
        x = tf1.placeholder(tf.float32, [None, R.IN])
        y = tf1.placeholder(tf.float32, [None, R.OUT])

        def loss():
            return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))

        opt = make_opt()
        if api == "minimize":
            train_op = opt.minimize(loss, [w, b])
        else:
            train_op = opt.apply_gradients(zip(tf.gradients(loss(), [w, b]), [w, b]))
        assert isinstance(train_op, tf.Operation), train_op
        flush_op = opt.flush() if flush_after is not None else None
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            for xb, yb in batches:
                sess.run(train_op, {x: xb, y: yb})
            if flush_op is not None:
                assert isinstance(flush_op, tf.Operation), flush_op
                sess.run(flush_op)
            return sess.run([w, b]), int(sess.run(opt.iterations))


def _batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("mode", ["v2", "v1"])
@pytest.mark.parametrize("api", ["apply_gradients", "minimize"])
@pytest.mark.parametrize("n", [1, 3])
def test_train_op_in_a_v1_graph_trains_like_the_plain_optimizer(n, api, mode):
    updates = 2
    x, y = R.dense_data(n * B * updates)
    ref, ref_iterations = _train_in_graph(lambda: L.Adam(0.05), _batches(x, y, n * B), api, mode=mode)
    acc, acc_iterations = _train_in_graph(
        lambda: AccumulatingOptimizer(L.Adam(0.05), n), _batches(x, y, B), api, mode=mode)
    assert acc_iterations == ref_iterations == updates
    diff = R.max_abs_diff(ref, acc)
    if n == 1:
        assert diff == 0.0
    else:
        moved = R.max_abs_diff(ref, _train_in_graph(lambda: L.Adam(0.05), [], api)[0])
        assert moved > 100 * TOL and diff <= TOL


def test_flush_op_in_a_v1_graph_applies_the_partial_window():
    n = 3
    x, y = R.dense_data(n * B + B)  # one full window, then one micro-batch
    windows = [(x[: n * B], y[: n * B]), (x[n * B:], y[n * B:])]
    ref, ref_iterations = _train_in_graph(lambda: L.SGD(0.1, momentum=0.5), windows, "apply_gradients")
    assert ref_iterations == 2
    acc, acc_iterations = _train_in_graph(
        lambda: AccumulatingOptimizer(L.SGD(0.1, momentum=0.5), n), _batches(x, y, B), "apply_gradients",
        flush_after=True,
    )
    assert acc_iterations == ref_iterations == 2
    assert R.max_abs_diff(ref, acc) <= TOL


_FIT_IN_GRAPH_MODE = """
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
from accum_optimizer import AccumulatingOptimizer
from support import reference as R
keras, L = tf.keras, tf.keras.optimizers.legacy
N, B, UPDATES = 3, 2, 3
x, y = R.dense_data(N * B * UPDATES)

def fit(opt, batch):
    model = R.dense_model()
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights(), int(keras.backend.get_value(opt.iterations))

for n in (1, N):
    ref = fit(L.Adam(0.05), n * B)
    acc = fit(AccumulatingOptimizer(L.Adam(0.05), n), B)
    print("fit", n, R.max_abs_diff(ref[0], acc[0]), ref[1], acc[1],
          R.max_abs_diff(ref[0], R.dense_model().get_weights()))

# An uneven epoch (its last window holds one micro-batch), two epochs:
# FlushPartialWindow against fit(batch_size=N*B), whose last batch is short.
from accum_optimizer import FlushPartialWindow
x, y = R.dense_data(N * B * UPDATES + B)
models = []
for opt, batch, callbacks in ((L.Adam(0.05), N * B, []), (AccumulatingOptimizer(L.Adam(0.05), N), B,
                                                        [FlushPartialWindow()])):
    model = R.dense_model()
    model.compile(opt, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    models.append((model.get_weights(), int(keras.backend.get_value(opt.iterations))))
print("flush", N, R.max_abs_diff(models[0][0], models[1][0]), models[0][1], models[1][1], 1.0)
"""


def test_graph_mode_fit_trains_like_the_plain_optimizer():
    """Keras 2's graph-mode ``fit`` (``disable_eager_execution``, a fresh
    process) runs ``optimizer.get_updates``, which needs the op; and
    ``FlushPartialWindow`` runs the flush op in Keras' session."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _FIT_IN_GRAPH_MODE], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(
            [tests] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {int(f[1]): [float(v) for v in f[2:]] for f in (line.split() for line in out.stdout.splitlines())
            if f and f[0] == "fit"}
    assert sorted(rows) == [1, 3] and "flush" in out.stdout, out.stdout
    diff, ref_iterations, acc_iterations, moved = rows[1]
    assert diff == 0.0 and acc_iterations == ref_iterations == 9  # N = 1: bitwise, 9 updates
    diff, ref_iterations, acc_iterations, moved = rows[3]
    assert acc_iterations == ref_iterations == 3 and moved > 100 * TOL and diff <= TOL
    flush = [float(v) for v in next(line for line in out.stdout.splitlines() if line.startswith("flush")).split()[2:]]
    diff, ref_iterations, acc_iterations, _ = flush
    assert acc_iterations == ref_iterations == 2 * 4 and diff <= TOL  # FlushPartialWindow: 4 updates per epoch
