"""N micro-batches of B equal one batch of N·B, for every optimizer of every family.

Reference (:meth:`support.drivers.Driver.pair`): the same model (same initial
weights, same samples in the same order) trained by the plain inner
optimizer with batch N·B and a loss that is a mean over the batch, run the
same way (traced, eagerly, or under TF1's control flow v1). After EVERY
update, the model's weights and every variable of the inner optimizer
(``iterations``, slots, EMA shadows, a schedule's current learning rate,
Nadam's ``_u_product``, tfa's slow/average weights, TF1's beta powers and
``global_step``) must equal the reference's within float32 rounding
(``1e-5``; ``1e-12`` in float64): a wrapper that counted micro-steps
(schedules, bias correction) can land on close final weights but leaves
another trajectory. Each family's setting (N, B, updates, model) is its
driver's.

Run with ``-s`` to print each case's max differences (the README's figures).
"""

from __future__ import annotations

import pytest

from support.drivers import FAMILIES, assert_matches_large_batch, driver, params

ALL = FAMILIES + ("tfa",)


@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.equivalence_cases()))
def test_every_optimizer_matches_the_large_batch(family, case):
    """Every optimizer class of the family, with clipping and weight decay."""
    ref, acc = driver(family).pair(case)
    assert_matches_large_batch(family, case, ref, acc)


@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.mode_cases()))
def test_other_execution_modes_match_the_large_batch(family, case):
    """Eagerly (Keras 2 families), and with RefVariables and control flow v1
    (TF1)."""
    ref, acc = driver(family).pair(case)
    assert_matches_large_batch(family, case, ref, acc)


@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.float64_cases()))
def test_float64_matches_the_large_batch_tightly(family, case):
    ref, acc = driver(family).pair(case)
    assert_matches_large_batch(family, case, ref, acc)


@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.sum_cases()))
def test_sum_reduction_matches_the_large_batch_of_summed_losses(family, case):
    """``reduction="sum"`` applies the sum of the micro-batch gradients: the
    reference is the large batch with its loss multiplied by N."""
    ref, acc = driver(family).pair(case)
    assert_matches_large_batch(family, case, ref, acc)
