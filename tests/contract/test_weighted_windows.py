"""Weighted windows: micro-batches of unequal size, each passing its count as
``weight``, make one window equal to the large batch of their samples.

References: the plain inner optimizer on the large batch each window stands
for (the window's micro-batches concatenated), same initial weights and
sample order; values computed by hand with SGD. Tolerance: float32 rounding
of a few updates (1e-6; the weighted window forms ``c * (S / c)`` instead of
``S``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, Inner, NotApplicable, driver, params

pytestmark = pytest.mark.windows  # (.ci/legs.py runs each Keras 2 family's in one leg)

TOL = 1e-6


def _modes(d):
    return d.modes()


def _assert_same_training(ref, acc, tol=TOL):
    assert acc.counters()["iterations"] == ref.counters()["iterations"]
    assert max_abs_diff(ref.weights(), acc.weights()) <= tol
    assert max_abs_diff(ref.inner_state(), acc.inner_state()) <= tol


@pytest.mark.parametrize("family, mode", params(FAMILIES, _modes))
def test_unequal_micro_batches_weighted_by_their_counts_equal_their_concatenation(family, mode):
    """N = 3, micro-batches of 4, 4, 2 | 3, 1, 5 with weight = sample count:
    each window equals one Adam step on the batch of its 10 (then 9) samples
    (weights, every inner variable). Without the weights the run differs
    (the check can fail)."""
    d = driver(family)
    sizes = [4, 4, 2, 3, 1, 5]
    x, y = d.data(sum(sizes))
    with d.trainer(Inner("adam", 0.05), mode=mode) as ref, \
            d.trainer(Inner("adam", 0.05), n=3, weighted=True, mode=mode) as acc, \
            d.trainer(Inner("adam", 0.05), n=3, mode=mode) as unweighted:
        start = 0
        for w in range(2):
            n = sum(sizes[3 * w:3 * w + 3])
            ref.step(x[start:start + n], y[start:start + n])
            start += n
        start = 0
        for b in sizes:
            acc.step(x[start:start + b], y[start:start + b], weight=b)
            unweighted.step(x[start:start + b], y[start:start + b])
            start += b
        _assert_same_training(ref, acc)
        assert max_abs_diff(ref.weights(), unweighted.weights()) > 100 * TOL


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_sum_reduction_multiplies_each_micro_gradient_by_its_weight(family, case):
    """reduction="sum": the window applies Σ cᵢ·gᵢ (hand-computed, SGD)."""
    t = driver(family).vectors([[1.0, -2.0]], Inner("sgd", 0.5), n=2, reduction="sum")
    g1, g2 = np.array([0.25, 1.0], "float32"), np.array([-2.0, 0.5], "float32")
    t.apply([g1], weight=3.0)
    t.apply([g2], weight=0.5)
    np.testing.assert_allclose(t.values()[0], np.array([1.0, -2.0]) - 0.5 * (3 * g1 + 0.5 * g2), rtol=0, atol=1e-7)


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_weight_one_everywhere_equals_no_weight(family, case):
    """weight=1 on every micro-step is the unweighted window, bitwise."""
    d = driver(family)
    x, y = d.data(12)
    results = []
    for weighted in (False, True):
        with d.trainer(Inner("adam", 0.1), n=3, weighted=weighted) as t:
            for k in range(6):
                t.step(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2], weight=1.0 if weighted else None)
            results.append(t.weights())
    assert_bitwise_equal(*results)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_window_of_zero_counts_applies_nothing(family, case, reduction):
    """Counts all 0, Adam: the window that closes applies nothing
    (``iterations`` does not move, weights and every inner variable bitwise
    unchanged, accumulators zero), and neither does a flush of such a
    partial window."""
    d = driver(family)
    x, y = d.data(12)
    with d.trainer(Inner("adam", 0.1), n=2, reduction=reduction, weighted=True) as t:
        t.build()
        before = t.weights() + t.inner_state()
        t.step(x[:4], y[:4], weight=0.0)
        t.step(x[4:8], y[4:8], weight=0.0)  # closes the window
        counters = t.counters()
        assert (counters["iterations"], counters["micro_steps"], counters["mini_step"]) == (0, 2, 0)
        assert_bitwise_equal(before, t.weights() + t.inner_state())
        t.step(x[8:], y[8:], weight=0.0)
        t.flush()
        counters = t.counters()
        assert (counters["iterations"], counters["micro_steps"], counters["mini_step"]) == (0, 3, 0)
        assert_bitwise_equal(before, t.weights() + t.inner_state())
        for acc in t.acc_grads():
            np.testing.assert_array_equal(acc, 0)


BAD_WEIGHTS = [
    (-1.0, ValueError, "weight=-1.0"),
    (float("nan"), ValueError, "weight=nan"),
    (float("inf"), ValueError, "weight=inf"),
    ([1.0, 2.0], ValueError, "shape (2,)"),
    ("3", TypeError, "weight='3'"),
    (True, TypeError, "weight=True"),
]


@pytest.mark.parametrize("bad, error, words", BAD_WEIGHTS, ids=[repr(b[0]) for b in BAD_WEIGHTS])
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_bad_weight_gets_a_clear_error_and_changes_nothing(family, case, bad, error, words):
    """A weight known when the step is built (a Python value) that is
    negative, not finite, not a scalar or not a number raises, naming it; the
    window is as it was."""
    t = driver(family).vectors([[1.0, 2.0]], Inner("sgd", 0.1), n=2)
    t.apply([[1.0, 1.0]])
    with pytest.raises(error, match="weight") as info:
        t.apply([[1.0, 1.0]], weight=bad, at_build=True)
    assert words in str(info.value)
    counters = t.counters()
    assert (counters["micro_steps"], counters["mini_step"]) == (1, 1)


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_negative_runtime_weight_stops_the_step_before_any_write(family, case):
    """A weight known only when the step runs (a tensor in a ``tf.function``,
    a fed placeholder): a negative one raises InvalidArgumentError before the
    step writes anything (counters, window weight, accumulators, variable)."""
    t = driver(family).vectors([[1.0, -1.0]], Inner("sgd", 0.1), n=2, traced=True)
    t.apply([[1.0, 1.0]], weight=2.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weight"):
        t.apply([[1.0, 1.0]], weight=-1.0)
    counters = t.counters()
    assert (counters["micro_steps"], counters["mini_step"], counters["window_weight"]) == (1, 1, 2.0)
    np.testing.assert_array_equal(t.acc_grads()[0], [2.0, 2.0])
    np.testing.assert_array_equal(t.values()[0], [1.0, -1.0])


# Per micro-step, the samples of each replica (2 replicas): unequal counts.
# Window 1 (N = 2): 3 + 1, then 2 + 4 samples; then a partial window of
# 2 + 1 samples, flushed.
MIRRORED_SPLITS = [(3, 1), (2, 4), (2, 1)]


def _keras_only(d):
    if d.family == "tf1":
        return NotApplicable("tf.distribute strategies are out of scope for TF1 graph code (tf1/test_api.py: refused)")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _keras_only))
def test_weighted_windows_and_flush_under_mirrored_strategy_equal_the_single_device_large_batch(
        family, case, strategy):
    """2 replicas with unequal sample counts per micro-step, each passing its
    own count as ``weight`` and its mean loss divided by the replica count
    (Keras' convention); a flush applies the partial window. Equals the
    plain inner optimizer on ONE device on batches of the window's 10, then
    3, samples. Tolerance 1e-5, as the other MirroredStrategy tests: the
    cross-replica all-reduce sums in another order than one device."""
    d = driver(family)
    x, y = d.data(sum(sum(s) for s in MIRRORED_SPLITS))
    ref = d.trainer(Inner("adam", 0.05))
    ref.step(x[:10], y[:10])
    ref.step(x[10:13], y[10:13])
    t = d.trainer(Inner("adam", 0.05), n=2, strategy=strategy)
    start = 0
    for counts in MIRRORED_SPLITS:
        bounds = [start, start + counts[0], start + sum(counts)]
        start = bounds[-1]
        t.replica_step([x[bounds[r]:bounds[r + 1]] for r in range(2)], [y[bounds[r]:bounds[r + 1]] for r in range(2)])
    counters = t.counters()
    assert (counters["iterations"], counters["mini_step"]) == (1, 1)
    assert counters["window_weight"] == 3.0  # summed over the replicas on read
    t.flush()
    counters = t.counters()
    assert (counters["iterations"], counters["mini_step"]) == (2, 0)
    _assert_same_training(ref, t, tol=1e-5)
