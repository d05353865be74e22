"""tensorflow-addons: what is its own (every tfa optimizer against the
batch-N·B reference, its wrappers that count ``iterations``, missing
gradients: the tfa cells of tests/contract/).

A tfa wrapper (Lookahead, MovingAverage, SWA) around the accumulating
optimizer is refused before anything moves; reference: the model's
weights before the call (bitwise).
"""

from support.families import require

require("tfa")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import tensorflow_addons as tfa  # noqa: E402

from support import reference as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

L = tf.keras.optimizers.legacy
T = tfa.optimizers


@pytest.mark.parametrize("outer", ["Lookahead", "MovingAverage", "SWA"])
def test_tfa_wrapper_around_accumulating_optimizer_is_refused_before_any_weight_moves(outer):
    model = R.dense_model()
    before = [w.numpy() for w in model.weights]
    acc = AccumulatingOptimizer(L.Adam(0.05), gradient_accumulation_steps=2)
    opt = {"Lookahead": T.Lookahead, "MovingAverage": T.MovingAverage, "SWA": T.SWA}[outer](acc)
    step = R.make_train_step(model, opt)
    x, y = R.dense_data(2)
    with pytest.raises(RuntimeError, match=r"AccumulatingOptimizer\(tfa.optimizers.Lookahead\(inner\)"):
        step(tf.constant(x), tf.constant(y))
    for b, w in zip(before, model.weights):
        np.testing.assert_array_equal(b, w.numpy())
    assert not acc.built  # not even the accumulators were made


