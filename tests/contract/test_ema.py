"""EMA once per update: an inner optimizer's moving average of the weights
(Keras' ``use_ema``, tensorflow-addons' ``MovingAverage`` and ``SWA``, which
average by ``iterations``) takes one step per window, as in large-batch
training, never one per micro-step.

Reference: the plain inner optimizer at batch N·B (:mod:`support.drivers`);
the shadows are compared after every update with the rest of the inner
state, and by name (one per trainable variable), so a missing shadow cannot
pass.
"""

from __future__ import annotations

import pytest

from support.drivers import FAMILIES, assert_matches_large_batch, driver, params

ALL = FAMILIES + ("tfa",)


@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.ema_cases()))
def test_ema_moves_once_per_update(family, case):
    ref, acc = driver(family).pair(case)
    assert acc.ema is not None and len(acc.ema) == len(acc.objects["model"].trainable_variables)
    assert_matches_large_batch(family, case, ref, acc)
