"""``model.fit`` with ``jit_compile=True``, for legacy optimizers (under
``MirroredStrategy``: tests/contract/test_mirrored.py).

Reference: the plain inner optimizer, batch N·B, same samples in the same
order, also XLA-compiled.
"""

from support.families import require

require("legacy")

import tensorflow as tf  # noqa: E402

from support import reference as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

keras = tf.keras
L = keras.optimizers.legacy
N, B, UPDATES = 2, 4, 3
TOL = 1e-5


def _fit(model, opt, x, y, batch, jit_compile=False):
    model.compile(opt, loss="mse", jit_compile=jit_compile)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(data, epochs=1, shuffle=False, verbose=0)


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
