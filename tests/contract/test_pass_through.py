"""Pass-through at N = 1: ``gradient_accumulation_steps=1`` is the plain inner
optimizer, bitwise (weights, every inner variable, ``iterations``), and makes
no accumulator; ``micro_steps`` still counts.

Reference: the plain inner optimizer trained the same way on the same
batches (bitwise).
"""

from __future__ import annotations

import pytest

from support.arrays import assert_bitwise_equal
from support.drivers import FAMILIES, Inner, driver, params


def _inners(d):
    return {
        "keras3": [Inner("adam", 0.01), Inner("sgd", 0.1, momentum=0.9)],
        "keras2": [Inner("adam_ema", 0.01)],
        "legacy": [Inner("adam", 0.05)],
        "tf1": [Inner("adam", 0.02)],
    }[d.family]


@pytest.mark.parametrize("family, inner", params(FAMILIES, _inners))
def test_n_equal_1_is_the_plain_inner_optimizer_bitwise(family, inner):
    d = driver(family)
    steps, b = 5, 4
    x, y = d.data(steps * b)
    with d.trainer(inner) as ref, d.trainer(inner, n=1) as acc:
        for s in range(steps):
            ref.step(x[s * b:(s + 1) * b], y[s * b:(s + 1) * b])
            acc.step(x[s * b:(s + 1) * b], y[s * b:(s + 1) * b])
        assert_bitwise_equal(ref.weights(), acc.weights(), "weights")
        assert_bitwise_equal(ref.inner_state(), acc.inner_state(), "inner state")
        counters = acc.counters()
        assert counters["iterations"] == counters["micro_steps"] == steps
        assert acc.acc_grads() == [] and acc.grad_received is None
        own = acc.own_variables()
        assert len(own) == 1 and acc.is_wrapper_counter(own[0]), own  # micro_steps only
