"""Equivalence with the batch-N·B reference for every Keras 2 legacy optimizer.

Each test trains the same model from the same initial weights on the same
samples in the same order twice: the plain inner optimizer on batches of
``N·B``, and ``AccumulatingOptimizer(inner, N)`` on micro-batches of ``B``,
both eagerly or both in a ``tf.function``. It compares, after EVERY update,
the model's weights and every variable of the inner optimizer
(``iterations``, all slots), not only the final values: a wrapper that
counted micro-steps (schedules, bias correction) can land on close final
weights but leaves a different trajectory.
"""

from support.families import require

require("legacy")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference_keras2 as R  # noqa: E402

L = tf.keras.optimizers.legacy
schedules = tf.keras.optimizers.schedules

from support.reference_keras2 import LEGACY_B as B, LEGACY_N as N, LEGACY_TOL as TOL, LEGACY_UPDATES as UPDATES, check_pair  # noqa: E402,E501

#: Every legacy class, with the variants the issue names.
LEGACY = {
    "SGD": lambda m: L.SGD(0.1),
    "SGD(momentum)": lambda m: L.SGD(0.1, momentum=0.9),
    "SGD(nesterov)": lambda m: L.SGD(0.1, momentum=0.9, nesterov=True),
    "Adam": lambda m: L.Adam(0.05),
    "Adam(amsgrad)": lambda m: L.Adam(0.05, amsgrad=True),
    "Adamax": lambda m: L.Adamax(0.05),
    "Adagrad": lambda m: L.Adagrad(0.1),
    "Adadelta": lambda m: L.Adadelta(1.0),
    "RMSprop": lambda m: L.RMSprop(0.01),
    "RMSprop(centered,momentum)": lambda m: L.RMSprop(0.01, momentum=0.5, centered=True),
    "Nadam": lambda m: L.Nadam(0.05),
    "Ftrl": lambda m: L.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
}

#: Clipping and learning-rate schedules (counted in updates), on Adam.
VARIANTS = {
    "clipnorm": lambda m: L.Adam(0.05, clipnorm=0.05),
    "global_clipnorm": lambda m: L.Adam(0.05, global_clipnorm=0.05),
    "clipvalue": lambda m: L.Adam(0.05, clipvalue=0.01),
    "ExponentialDecay": lambda m: L.Adam(schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)),
    "PiecewiseConstantDecay": lambda m: L.SGD(schedules.PiecewiseConstantDecay([1, 2], [0.3, 0.03, 0.003])),
    "CosineDecay(warmup)": lambda m: L.SGD(
        schedules.CosineDecay(0.0, decay_steps=2, warmup_target=0.2, warmup_steps=2), momentum=0.9
    ),
    "decay=": lambda m: L.SGD(0.2, decay=1.0),  # lr / (1 + decay * iterations)
}


@pytest.mark.parametrize("name", list(LEGACY))
def test_equivalence_every_legacy_optimizer(name):
    ref, acc = R.run_pair(LEGACY[name], N, B, UPDATES)
    check_pair(ref, acc)


# Eagerly (both runs): the optimizers whose eager and traced arithmetic
# differ the most (fused kernels vs. composite ops, Nadam's python-side
# momentum cache), and one plain case.
@pytest.mark.parametrize("name", ["SGD(momentum)", "Adam(amsgrad)", "Nadam", "Ftrl"])
def test_equivalence_eager(name):
    ref, acc = R.run_pair(LEGACY[name], N, B, UPDATES, eager=True)
    check_pair(ref, acc)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_equivalence_clipping_and_schedules_count_updates(name):
    ref, acc = R.run_pair(VARIANTS[name], N, B, UPDATES)
    check_pair(ref, acc)


def test_schedule_check_is_not_vacuous():
    # A schedule that counted micro-steps would see step N*u instead of u:
    # the reference run with the schedule stepped N times faster leaves a
    # trajectory far outside the tolerance, so the test above can fail.
    fast = lambda m: L.Adam(schedules.ExponentialDecay(0.1, decay_steps=1 / N, decay_rate=0.5))  # noqa: E731
    ref, _ = R.run_pair(VARIANTS["ExponentialDecay"], N, B, UPDATES)
    wrong, _ = R.run_pair(fast, N, B, UPDATES)
    assert R.trajectory_diff(ref, wrong) > 100 * TOL


def test_equivalence_reduction_sum():
    # "sum" applies the sum of the micro-batch gradients: the reference is
    # the large batch with the loss multiplied by N.
    ref, acc = R.run_pair(LEGACY["Adam"], N, B, UPDATES, reduction="sum")
    check_pair(ref, acc)


def test_equivalence_float64_is_tighter():
    model_fn = lambda: R.dense_model(dtype="float64")  # noqa: E731
    data_fn = lambda n: R.dense_data(n, dtype=np.float64)  # noqa: E731
    ref, acc = R.run_pair(LEGACY["RMSprop(centered,momentum)"], N, B, UPDATES, model_fn=model_fn, data_fn=data_fn)
    check_pair(ref, acc, tol=1e-12)
