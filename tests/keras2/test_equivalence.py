"""Keras 2 new API: N micro-batches of B equal one batch of N*B, for every optimizer class.

Reference (``tests/reference_keras2.py``): the same model (same initial
weights, same sample order) trained by the plain inner optimizer with batch
N*B and a loss that is a mean over the batch, run the same way (eagerly or as
a ``tf.function``). Besides the weights, every variable of the inner optimizer
(``iterations``, slots, EMA shadows, learning rate, a schedule's current
learning rate, Nadam's ``_u_product``) must equal the reference optimizer's.

Run with ``-s`` to print each case's max weight difference (the figures of
the README and the report):
``TF_USE_LEGACY_KERAS=1 .venvs/tfkeras/bin/python -m pytest tests/test_keras2_equivalence.py -s -k every_class``.
"""

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support.reference_keras2 import (  # noqa: E402
    make_mlp,
    optimizer_cases,
    max_abs_diff,
    optimizer_state,
    reference_and_accumulated,
    weights,
)

keras = tf.keras
o = keras.optimizers
schedules = o.schedules
N, B, WINDOWS = 3, 4, 4
TOL32, TOL64 = 1e-5, 1e-12

OPTIMIZERS = optimizer_cases()

OPTIONS = {
    "clipnorm": lambda: o.Adam(1e-2, clipnorm=0.05),
    "global_clipnorm": lambda: o.Adam(1e-2, global_clipnorm=0.05),
    "clipvalue": lambda: o.SGD(0.1, clipvalue=0.01),
    "weight_decay_sgd": lambda: o.SGD(0.1, momentum=0.9, weight_decay=0.1),
    "ema_overwrite": lambda: o.Adam(1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2),
    # Boundaries and decay lengths are in updates; the 4 windows cross them,
    # so a schedule fed micro-steps would give other rates.
    "piecewise_constant": lambda: o.Adam(schedules.PiecewiseConstantDecay([1, 2], [1e-2, 3e-2, 1e-3])),
    "cosine_warmup_adamw_ema": lambda: o.AdamW(
        schedules.CosineDecay(0.0, decay_steps=3, warmup_target=2e-2, warmup_steps=2),
        weight_decay=0.05,
        use_ema=True,
    ),
}
# Eager and graph runs of one Keras 2 optimizer may differ (Nadam's
# `_u_product` cache is a Python counter); these also run eagerly.
EAGER = ["sgd_momentum", "adam", "nadam", "adafactor"]


def _check(name, optimizer_fn, mode, dtype="float32", reduction="mean"):
    ref, acc, ref_opt, acc_opt = reference_and_accumulated(
        lambda: make_mlp(0, dtype=dtype), optimizer_fn, N, B, WINDOWS, reduction=reduction, mode=mode, dtype=dtype
    )
    tol = TOL64 if dtype == "float64" else TOL32
    assert int(acc_opt.iterations.numpy()) == WINDOWS == int(ref_opt.iterations.numpy())
    assert int(acc_opt.micro_steps.numpy()) == N * WINDOWS
    # Training moved the weights, so the comparison is not vacuous.
    assert max_abs_diff(weights(ref), weights(make_mlp(0, dtype=dtype))) > 1e-3
    dw = max_abs_diff(weights(ref), weights(acc))
    ds = max_abs_diff(optimizer_state(ref_opt), optimizer_state(acc_opt.inner_optimizer))
    print(f"[keras2 TF {tf.__version__}] {name} {mode} {dtype} {reduction}: max|dw| {dw:.2e}, max|dstate| {ds:.2e}")
    assert dw <= tol
    assert ds <= tol
    return acc_opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_class_matches_large_batch(name):
    _check(name, OPTIMIZERS[name], "graph")


@pytest.mark.parametrize("name", EAGER)
def test_every_class_matches_large_batch_eagerly(name):
    _check(name, OPTIMIZERS[name], "eager")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_clipping_weight_decay_ema_and_schedules_act_once_per_update(name):
    _check(name, OPTIONS[name], "graph")


@pytest.mark.parametrize("name", ["adam", "adafactor"])
def test_float64_matches_large_batch_tightly(name):
    _check(name, OPTIMIZERS[name], "graph", dtype="float64")


def test_sum_reduction_matches_large_batch_of_summed_losses():
    _check("adam", OPTIMIZERS["adam"], "graph", reduction="sum")


def test_schedule_sees_updates_not_micro_steps():
    # Hand-derived: ExponentialDecay(0.2, 1, 0.3, staircase) at update k is
    # 0.2 * 0.3**k; the current learning rate the inner optimizer holds after
    # the last update was computed at iterations = WINDOWS - 1. Fed
    # micro-steps, it would be 0.2 * 0.3**(N * WINDOWS - 1).
    def make():
        return o.SGD(schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True))

    acc_opt = _check("exponential_decay", make, "eager")
    np.testing.assert_allclose(float(acc_opt.learning_rate.numpy()), 0.2 * 0.3 ** (WINDOWS - 1), rtol=1e-6)
