"""``model.fit`` under ``MirroredStrategy`` (2 logical CPUs, see conftest.py)
and with ``jit_compile=True``, for legacy optimizers.

Keras 2 scales each replica's loss by ``1 / num_replicas``; each replica
adds its local micro-batch gradients into its own ``ON_READ`` accumulators,
and on an update the inner optimizer's ``apply_gradients`` all-reduces the
window gradients (the one cross-replica reduction of the window), then clips
and applies. ``OptimizerV2`` clips *after* the all-reduce, so, unlike Keras 3,
clipping is part of the single-device comparison too. Reference: the plain
inner optimizer on ONE device, batch N·B, same samples in the same order.
"""

from support.families import require

require("legacy")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.distribution import ReductionCounter  # noqa: E402

keras = tf.keras
L = keras.optimizers.legacy
N, B, REPLICAS, UPDATES = 2, 4, 2, 3
TOL = 1e-5


# `strategy`: the session-wide 2-replica MirroredStrategy of conftest.py.


def _fit(model, opt, x, y, batch, jit_compile=False):
    model.compile(opt, loss="mse", jit_compile=jit_compile)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(data, epochs=1, shuffle=False, verbose=0)


CASES = {
    "Adam": (lambda: L.Adam(0.05), R.dense_model, R.dense_data),
    "Adam(global_clipnorm)": (lambda: L.Adam(0.05, global_clipnorm=0.05), R.dense_model, R.dense_data),
    "SGD(momentum) sparse": (lambda: L.SGD(0.1, momentum=0.9), R.embedding_model,
                             lambda n: R.embedding_data(n, vocab_used=8)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mirrored_fit_matches_single_device_large_batch(strategy, monkeypatch, name):
    make_inner, model_fn, data_fn = CASES[name]
    x, y = data_fn(N * B * UPDATES)
    ref_model, ref_inner = model_fn(), make_inner()
    _fit(ref_model, ref_inner, x, y, N * B)

    counter = ReductionCounter(monkeypatch, strategy, entry_points=("_batch_reduce_to",))
    # Control: plain training at batch N*B under the same strategy, one step
    # per update: the number of reductions large-batch training makes.
    with strategy.scope():
        _fit(model_fn(), make_inner(), x, y, N * B)
    control = int(counter.batch_reduce_to.numpy())
    assert control >= UPDATES  # at least the gradients' reduction per step
    counter.batch_reduce_to.assign(0)
    with strategy.scope():
        model = model_fn()
        opt = AccumulatingOptimizer(make_inner(), N)
        _fit(model, opt, x, y, B)
    assert int(opt.micro_steps.numpy()) == N * UPDATES
    assert int(opt.iterations.numpy()) == UPDATES == int(ref_inner.iterations.numpy())
    assert R.max_abs_diff(ref_model.get_weights(), [w.numpy() for w in R.dense_model().weights]
                      if model_fn is R.dense_model else [w.numpy() for w in R.embedding_model().weights]) > 1e-3
    assert R.max_abs_diff(model.get_weights(), ref_model.get_weights()) <= TOL
    assert R.max_abs_diff([w.numpy() for w in opt.inner_optimizer.weights], [w.numpy() for w in ref_inner.weights]) <= TOL
    # As many cross-replica reductions as the large batch: the gradients are
    # reduced once per update, never on a micro-step (N times more steps ran).
    assert int(counter.batch_reduce_to.numpy()) == control
    for v in list(model.weights) + list(opt.inner_optimizer.weights):
        values = [c.numpy() for c in getattr(v, "values", [v])]
        for c in values[1:]:
            np.testing.assert_array_equal(c, values[0])


def test_jit_compile_fit_matches_large_batch():
    x, y = R.dense_data(N * B * UPDATES)
    runs = []
    for accumulate in (False, True):
        model = R.dense_model()
        inner = L.Adam(0.05)
        _fit(model, AccumulatingOptimizer(inner, N) if accumulate else inner, x, y,
             B if accumulate else N * B, jit_compile=True)
        runs.append((model, inner))
    (rm, ri), (am, ai) = runs
    assert int(ai.iterations.numpy()) == UPDATES
    assert R.max_abs_diff(rm.get_weights(), am.get_weights()) <= TOL
    assert R.max_abs_diff([w.numpy() for w in ri.weights], [w.numpy() for w in ai.weights]) <= TOL
