"""``model.fit`` under ``tf.distribute.MirroredStrategy`` (2 logical CPUs:
conftest.py) equals the single-device large batch.

Keras scales each replica's loss by ``1 / num_replicas``, so the replicas'
gradients sum to the gradient of the mean over the global micro-batch of B.
Each replica adds its own micro-batch gradients into its own (``ON_READ``)
accumulators; on an update the inner optimizer's ``apply_gradients``
all-reduces the window gradients, the one cross-replica reduction of the
window. Reference (:meth:`support.drivers.keras.KerasDriver.mirrored_pair`):
the plain inner optimizer on ONE device with batch N·B (same initial
weights, same samples in the same order, no shuffling): the weights and
every variable of the inner optimizer within float32 rounding (``1e-5``),
every replica holding the same values bitwise, and where the family's driver
counts them, as many gradient all-reductions as it expects (Keras 3's count:
keras3/test_distribution.py). Each family's N, B, epochs, models and
optimizers (clipping, EMA, schedules, sparse gradients) are its driver's.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import max_abs_diff
from support.drivers import FAMILIES, TOL, NotApplicable, driver, params


def _cases(d):
    if d.family == "tf1":
        return NotApplicable("TF1 graph code runs in a Session without a tf.distribute strategy (refused: "
                             "tf1/test_api.py::test_a_distribution_strategy_is_refused)")
    return d.mirrored_cases()


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_mirrored_fit_matches_single_device_large_batch(strategy, monkeypatch, family, case):
    d = driver(family)
    n, _, windows, epochs, moved = d.MIRRORED
    ref, acc = d.mirrored_pair(case, strategy, monkeypatch)
    assert acc.micro_steps == n * windows * epochs
    assert acc.iterations == ref.iterations == windows * epochs
    assert max_abs_diff(ref.weights, ref.initial) > moved  # training moved the weights
    assert max_abs_diff(acc.weights, ref.weights) <= TOL
    assert max_abs_diff(acc.state, ref.state) <= TOL
    for values in acc.objects["replicas"]:
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0])
    if acc.objects["expected_reductions"] is not None:
        assert acc.objects["reductions"] == acc.objects["expected_reductions"]
