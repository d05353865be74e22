"""Flush: the partial window is applied as one update, normalised by what it
holds (its micro-steps, or the sum of their counts when weighted; never by
N), what a large batch of its samples would apply; a flush of an empty
window changes nothing; the next window is a full one again.

References: values computed by hand with SGD; the plain inner optimizer on
the large batches the windows stand for (the last one smaller).
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, Inner, driver, params

pytestmark = pytest.mark.windows  # (.ci/legs.py runs each Keras 2 family's in one leg)

TOL = 1e-6


def _traced(d):
    """Eagerly and inside ``tf.function`` (Keras families); TF1 ops are graph ops."""
    return [False] if d.family == "tf1" else [False, True]


@pytest.mark.parametrize("weights", [(None, None), (1.0, 3.0)], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("family, traced", params(FAMILIES, _traced))
def test_flush_normalises_by_what_the_window_holds(family, traced, weights):
    """SGD(0.5), N = 4, hand-computed: after 2 micro-steps, flush applies
    (g1 + g2) / 2 unweighted, (1·g1 + 3·g2) / 4 with weights 1 and 3, and
    counts one update; a flush on an empty window (built, before any
    micro-step; or right after a flush) is a no-op; the
    next window is a full window of 4 again."""
    g1, g2 = np.array([1.0, 2.0], "float32"), np.array([3.0, -6.0], "float32")
    w1, w2 = weights
    t = driver(family).vectors([[1.0, -1.0]], Inner("sgd", 0.5), n=4)
    t.build()
    t.flush(traced)  # an empty window: built, before any micro-step (unbuilt, flush raises: core/test_arguments.py)
    assert t.counters()["iterations"] == 0
    t.apply([g1], weight=w1)
    t.apply([g2], weight=w2)
    t.flush(traced)
    c1, c2 = (1.0, 1.0) if w1 is None else (w1, w2)
    expected = np.array([1.0, -1.0], "float32") - 0.5 * (c1 * g1 + c2 * g2) / (c1 + c2)
    np.testing.assert_allclose(t.values()[0], expected, rtol=0, atol=1e-7)
    counters = t.counters()
    assert (counters["iterations"], counters["micro_steps"], counters["mini_step"]) == (1, 2, 0)
    t.flush(traced)
    np.testing.assert_allclose(t.values()[0], expected, rtol=0, atol=1e-7)
    assert t.counters()["iterations"] == 1
    for _ in range(3):
        t.apply([g1])
    assert t.counters()["iterations"] == 1
    t.apply([g1])
    assert t.counters()["iterations"] == 2


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_flush_right_after_a_window_closed_is_a_no_op(family, case):
    """Four micro-steps close the window; a flush then changes nothing."""
    t = driver(family).vectors([[1.0, -1.0]], Inner("sgd", 0.5), n=4)
    t.build()
    t.flush()  # built, before any micro-step: nothing to apply
    for _ in range(4):
        t.apply([[1.0, 1.0]])
    before = t.values()
    t.flush()
    assert_bitwise_equal(before, t.values())
    assert t.counters()["iterations"] == 1


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_flush_at_the_end_of_an_epoch_equals_the_smaller_last_batch(family, case):
    """Micro-batches 4, 4, 2 (a window of N = 3), then 3, 2 and a flush (a
    partial window of 2 micro-steps, normalised by its counts 3 + 2): Adam on
    batches of 10 and 5 (weights, every inner variable); the flush counts as
    an update."""
    d = driver(family)
    sizes = [4, 4, 2, 3, 2]
    x, y = d.data(sum(sizes))
    with d.trainer(Inner("adam", 0.05)) as ref, d.trainer(Inner("adam", 0.05), n=3, weighted=True) as acc:
        ref.step(x[:10], y[:10])
        ref.step(x[10:15], y[10:15])
        start = 0
        for b in sizes:
            acc.step(x[start:start + b], y[start:start + b], weight=b)
            start += b
        acc.flush()
        assert acc.counters()["iterations"] == ref.counters()["iterations"] == 2
        assert max_abs_diff(ref.weights(), acc.weights()) <= TOL
        assert max_abs_diff(ref.inner_state(), acc.inner_state()) <= TOL
