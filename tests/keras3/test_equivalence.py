"""Accumulating N micro-batches of B equals one batch of N*B, for every Keras optimizer.

Reference: the same model (same initial weights, same sample order) trained by
the plain inner optimizer with batch N*B and a loss that is a mean over the
batch (``tests/reference.py``). Besides the weights, the inner optimizer's own
state (moments, ``iterations``, EMA shadows, ...) must equal the reference
optimizer's, variable by variable.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.reference import make_mlp, max_abs_diff, reference_and_accumulated, weights

schedules = keras.optimizers.schedules


def _opt_cases():
    o = keras.optimizers
    return {
        "sgd": lambda: o.SGD(0.1),
        "sgd_momentum": lambda: o.SGD(0.1, momentum=0.9),
        "sgd_nesterov": lambda: o.SGD(0.1, momentum=0.9, nesterov=True),
        "adam": lambda: o.Adam(1e-2),
        "adam_amsgrad": lambda: o.Adam(1e-2, amsgrad=True),
        "adamw": lambda: o.AdamW(1e-2, weight_decay=0.05),
        "adamax": lambda: o.Adamax(1e-2),
        "adagrad": lambda: o.Adagrad(5e-2),
        "adadelta": lambda: o.Adadelta(1.0),
        "rmsprop": lambda: o.RMSprop(1e-2),
        "rmsprop_centered": lambda: o.RMSprop(1e-2, centered=True, momentum=0.5),
        "nadam": lambda: o.Nadam(1e-2),
        "ftrl": lambda: o.Ftrl(5e-2, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
        "lion": lambda: o.Lion(1e-3),
        "lamb": lambda: o.Lamb(1e-2),
        "adafactor": lambda: o.Adafactor(1e-2),
        "schedule_free_adamw": lambda: o.ScheduleFreeAdamW(1e-2),
        "multi_optimizer": lambda: o.MultiOptimizer(
            lambda v: o.Adam(1e-2) if "kernel" in v.path else o.SGD(0.1, momentum=0.9)
        ),
    }
    # Muon is added below when this Keras has it.


OPTIMIZERS = _opt_cases()
if hasattr(keras.optimizers, "Muon"):
    OPTIMIZERS["muon"] = lambda: keras.optimizers.Muon(1e-2)

OPTIONS = {
    "clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
    "weight_decay_sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1),
    "weight_decay_adam": lambda: keras.optimizers.Adam(1e-2, weight_decay=0.1),
    "ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9),
    "ema_overwrite": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    # Boundaries and decay lengths are in updates; the 4 windows trained
    # cross them, so a schedule fed micro-steps would give other rates.
    "piecewise_constant": lambda: keras.optimizers.Adam(
        schedules.PiecewiseConstantDecay([1, 2], [1e-2, 3e-2, 1e-3])
    ),
    "exponential_decay": lambda: keras.optimizers.SGD(
        schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True)
    ),
    "cosine_warmup": lambda: keras.optimizers.AdamW(
        schedules.CosineDecay(0.0, decay_steps=3, warmup_target=2e-2, warmup_steps=2),
        weight_decay=0.05,
        use_ema=True,
    ),
}


def _inner_state(opt):
    return [np.array(v.numpy()) for v in opt.variables]


def _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol):
    assert max_abs_diff(weights(ref_model), weights(acc_model)) <= tol
    ref_state, acc_state = _inner_state(ref_opt), _inner_state(acc_opt.inner_optimizer)
    assert [s.shape for s in ref_state] == [s.shape for s in acc_state]
    assert max_abs_diff(ref_state, acc_state) <= tol
    assert int(acc_opt.iterations.numpy()) == int(ref_opt.iterations.numpy())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_keras_optimizer_matches_large_batch_float32(name):
    n, windows = 4, 4
    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        make_mlp, OPTIMIZERS[name], n=n, micro_batch=3, windows=windows
    )
    assert int(acc_opt.micro_steps.numpy()) == n * windows
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=1e-5)
    # The comparison is not vacuous: training moved the weights.
    assert max_abs_diff(weights(ref_model), weights(make_mlp())) > 1e-4


@pytest.mark.parametrize(
    "name", ["sgd_momentum", "adam", "adamw", "rmsprop_centered", "nadam", "lamb", "adafactor"]
)
def test_optimizers_match_large_batch_float64_tightly(name):
    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        lambda: make_mlp(dtype="float64"), OPTIMIZERS[name], n=4, micro_batch=3, windows=3,
        dtype="float64",
    )
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=1e-12)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_clipping_weight_decay_ema_and_schedules_count_updates(name):
    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        make_mlp, OPTIONS[name], n=4, micro_batch=3, windows=4
    )
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=1e-5)
    inner = acc_opt.inner_optimizer
    if inner.use_ema:
        # The EMA shadow weights are part of `variables`, compared above;
        # check them by name too, so a missing shadow cannot pass.
        assert len(inner._model_variables_moving_average) == len(acc_model.trainable_variables)
        assert max_abs_diff(
            weights(ref_opt._model_variables_moving_average),
            weights(inner._model_variables_moving_average),
        ) <= 1e-5
    if isinstance(inner._learning_rate, schedules.LearningRateSchedule):
        # Same rate now as the reference, i.e. the schedule saw 4 updates.
        np.testing.assert_allclose(
            float(acc_opt.learning_rate.numpy()), float(ref_opt.learning_rate.numpy()), rtol=1e-6
        )


def test_sum_reduction_applies_the_summed_gradient():
    # Reference for "sum": batch N*B with the loss multiplied by N, whose
    # gradient is the sum of the N micro-batch mean-loss gradients.
    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        make_mlp, lambda: keras.optimizers.SGD(0.02, momentum=0.9), n=4, micro_batch=3,
        windows=3, reduction="sum",
    )
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=1e-5)


PROPERTY_OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop", "adagrad", "nadam", "lion"]


@given(
    n=st.integers(1, 8),
    micro_batch=st.integers(1, 4),
    in_dim=st.integers(1, 5),
    hidden=st.integers(1, 6),
    out_dim=st.integers(1, 3),
    opt=st.sampled_from(PROPERTY_OPTIMIZERS),
    reduction=st.sampled_from(["mean", "sum"]),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_property_accumulation_matches_large_batch(
    n, micro_batch, in_dim, hidden, out_dim, opt, reduction, dtype
):
    # Eager steps: a fresh model per example would otherwise cost a fresh
    # tf.function trace per example (the traced path is covered above).
    def model_fn():
        return make_mlp(seed=7, in_dim=in_dim, hidden=hidden, out_dim=out_dim, dtype=dtype)

    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        model_fn, OPTIMIZERS[opt], n=n, micro_batch=micro_batch, windows=2,
        reduction=reduction, dtype=dtype, jit_compile=None,
    )
    tol = 1e-5 if dtype == "float32" else 1e-11
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=tol)
