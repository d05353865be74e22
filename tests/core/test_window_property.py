"""The window algorithm against the large batch, for any N or schedule, batch
size, dataset size and sample weights (hypothesis).

Reference: the plain inner optimizer on the large batches the windows stand
for, whose sizes are the schedule read by hand, the same initial weights
and sample order. Run through the Keras 3 family (``CountedLoss`` counts the
samples), the one whose ``apply`` takes a micro-step eagerly.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from accum_optimizer import AccumulatingOptimizer, CountedLoss  # noqa: E402
from support.reference import make_data, make_mlp, max_abs_diff, weights  # noqa: E402


def _state(opt):
    """The inner optimizer's variables (moments, iterations, ...), as arrays."""
    inner = getattr(opt, "inner_optimizer", opt)
    return [np.array(v.numpy()) for v in inner.variables]


def _assert_same_training(ref_model, ref_opt, model, opt, tol):
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy())
    assert max_abs_diff(weights(ref_model), weights(model)) <= tol
    assert max_abs_diff(_state(ref_opt), _state(opt)) <= tol


# Each example trains two eager models: a third of the profile's examples
# (13 in CI's profile, 50 in `make test-full`).
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(
    data=st.data(),
    schedule=st.one_of(st.integers(1, 4), st.just({0: 1, 1: 3}), st.just({0: 2, 2: 1, 3: 4})),
    b=st.integers(1, 4),
    n_samples=st.integers(3, 24),
    weighting=st.sampled_from(["none", "sample_weight", "mean_with_sample_weight"]),
)
def test_property_windows_equal_the_large_batch(data, schedule, b, n_samples, weighting):
    """hypothesis: N or a schedule, B, the dataset size (B need not divide
    it), sample weights (with zeros); micro-batches of B with CountedLoss
    and a flush at the end equal the large batches the windows stand for."""
    x, y = make_data(n_samples, in_dim=3, out_dim=2, seed=data.draw(st.integers(0, 50)))
    sw = None
    if weighting != "none":
        sw = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=n_samples,
                                         max_size=n_samples)), "float32")
    reduction = "mean_with_sample_weight" if weighting == "mean_with_sample_weight" else "sum_over_batch_size"
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    counted = CountedLoss(keras.losses.MeanSquaredError(reduction=reduction))
    ref, model = make_mlp(3, in_dim=3, out_dim=2), make_mlp(3, in_dim=3, out_dim=2)
    ref_opt = keras.optimizers.Adam(0.05)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=schedule)

    def n_of(update):  # the schedule read by hand: the last phase started by `update`
        if isinstance(schedule, int):
            return schedule
        return schedule[max(k for k in schedule if k <= update)]

    def apply(o, m, lo, s, e):
        with tf.GradientTape() as tape:
            value = lo(y[s:e], m(x[s:e]), sample_weight=None if sw is None else sw[s:e])
        o.apply(tape.gradient(value, m.trainable_variables), m.trainable_variables)

    # Reference: batches of b*N(u) (the last one what is left). A batch
    # whose count is 0 (all sample weights 0 under mean_with_sample_weight)
    # has no samples to learn from: the window applies nothing (documented),
    # so the reference skips it too and the update index stays.
    start, update = 0, 0
    while start < n_samples:
        n = n_of(update)
        end = min(n_samples, start + n * b)
        if not (reduction == "mean_with_sample_weight" and sw[start:end].sum() == 0):
            apply(ref_opt, ref, loss, start, end)
            update += 1
        start = end
    for s in range(0, n_samples, b):
        apply(opt, model, counted, s, min(n_samples, s + b))
    opt.flush()
    _assert_same_training(ref, ref_opt, model, opt, tol=2e-6)
