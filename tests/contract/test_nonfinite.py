"""Non-finite micro-steps and wider accumulators, in every family.

``nonfinite``: ``"propagate"`` (default) accumulates a NaN/Inf gradient as it
is, as the large batch with that sample would; ``"skip_micro_step"`` drops the
micro-step (not counted: the window takes one more micro-batch);
``"skip_window"`` counts it and discards its window (no update at all).
``accumulator_dtype``: float32 accumulators for 16-bit variables (default),
the window gradient cast back to the variable's dtype once per update.

References: the plain inner optimizer on the large batch of the window's
finite micro-batches (concatenated, same initial weights and sample order);
the state before a discarded window (bitwise); hand-derived float16 values.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, Inner, NotApplicable, driver, params

pytestmark = pytest.mark.windows  # (.ci/legs.py runs each Keras 2 family's in one leg)

TOL = 1e-6  # float32 rounding of a few updates
POISON = {"nan": np.nan, "inf": np.inf}


def _poisoned(x, sizes, bad, value):
    """``x`` with micro-batch ``bad`` (of micro-batches of ``sizes``) set to ``value``."""
    x = x.copy()
    start = sum(sizes[:bad])
    x[start:start + sizes[bad]] = value
    return x


def _batches(sizes):
    starts = np.cumsum([0] + list(sizes))
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def _assert_same_training(ref, acc, tol=TOL):
    assert acc.counters()["iterations"] == ref.counters()["iterations"]
    assert max_abs_diff(ref.weights(), acc.weights()) <= tol
    assert max_abs_diff(ref.inner_state(), acc.inner_state()) <= tol


# ------------------------------------------------------------ the policies
@pytest.mark.parametrize("poison", sorted(POISON))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("family, mode", params(FAMILIES, lambda d: d.modes()))
def test_skip_micro_step_equals_the_large_batch_of_the_finite_micro_batches(family, mode, weighted, poison):
    """N = 3, micro-batch 2 (of 7) non-finite: the windows are micro-batches
    0, 1, 3 and 4, 5, 6, each equal to one Adam step on their samples
    concatenated (weighted: unequal micro-batches, each passing its size, so
    the window divides by what it holds, never by what was skipped). The
    skipped micro-step is not counted. Under "propagate" the same data puts
    NaN in the weights (the check can fail). TF1: in TF2 graphs and under
    TF1 behaviour (RefVariables, control flow v1)."""
    d = driver(family)
    sizes = [2, 3, 1, 4, 2, 3, 1] if weighted else [2] * 7
    x, y = d.data(sum(sizes))
    bad = _poisoned(x, sizes, 2, POISON[poison])
    parts = _batches(sizes)
    with d.trainer(Inner("adam", 0.05), mode=mode) as ref, \
            d.trainer(Inner("adam", 0.05), n=3, weighted=weighted, mode=mode, nonfinite="skip_micro_step") as acc, \
            d.trainer(Inner("adam", 0.05), n=3, weighted=weighted, mode=mode) as propagate:
        for window in ([0, 1, 3], [4, 5, 6]):
            ref.step(np.concatenate([x[parts[k]] for k in window]), np.concatenate([y[parts[k]] for k in window]))
        for k, part in enumerate(parts):
            weight = float(sizes[k]) if weighted else None
            acc.step(bad[part], y[part], weight=weight)
            propagate.step(bad[part], y[part], weight=weight)
        _assert_same_training(ref, acc)
        counters = acc.counters()
        assert (counters["micro_steps"], counters["mini_step"]) == (6, 0)
        assert (counters["skipped_micro_steps"], counters["skipped_windows"]) == (1, 0)
        assert not np.all(np.isfinite(np.concatenate([w.ravel() for w in propagate.weights()])))


@pytest.mark.parametrize("poison", sorted(POISON))
@pytest.mark.parametrize("family, mode", params(FAMILIES, lambda d: d.modes()))
def test_skip_window_leaves_everything_bitwise_and_the_next_window_is_a_fresh_large_batch(family, mode, poison):
    """N = 3, micro-batch 4 (in the second window) non-finite: the second
    window is discarded (weights, every inner variable, iterations bitwise
    as after the first; accumulators zero), and the third equals one Adam
    step on its samples after the first window's."""
    d = driver(family)
    sizes = [2] * 9
    x, y = d.data(sum(sizes))
    bad = _poisoned(x, sizes, 4, POISON[poison])
    parts = _batches(sizes)
    with d.trainer(Inner("adam", 0.05), mode=mode) as ref, \
            d.trainer(Inner("adam", 0.05), n=3, mode=mode, nonfinite="skip_window") as acc:
        for window in ([0, 1, 2], [6, 7, 8]):
            ref.step(np.concatenate([x[parts[k]] for k in window]), np.concatenate([y[parts[k]] for k in window]))
        for part in parts[:3]:
            acc.step(bad[part], y[part])
        before = acc.snapshot()
        for part in parts[3:6]:
            acc.step(bad[part], y[part])
        assert_bitwise_equal(before, acc.snapshot(), "after the discarded window")
        assert all(not np.any(a) for a in acc.acc_grads())
        counters = acc.counters()
        assert counters["iterations"] == 1 and counters["micro_steps"] == 6 and counters["mini_step"] == 0
        assert (counters["skipped_micro_steps"], counters["skipped_windows"]) == (1, 1)
        for part in parts[6:]:
            acc.step(bad[part], y[part])
        _assert_same_training(ref, acc)
        assert acc.counters()["skipped_windows"] == 1


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_propagate_carries_a_nonfinite_micro_batch_like_the_large_batch(family, case):
    """The default: the NaN reaches the weights exactly where the large batch
    holding that micro-batch puts it, and no skip counters are kept."""
    d = driver(family)
    x, y = d.data(6)
    bad = _poisoned(x, [2, 2, 2], 1, np.nan)
    with d.trainer(Inner("adam", 0.05)) as ref, d.trainer(Inner("adam", 0.05), n=3) as acc:
        ref.step(bad, y)
        for part in _batches([2, 2, 2]):
            acc.step(bad[part], y[part])
        assert_bitwise_equal(ref.weights(), acc.weights())
        assert not np.all(np.isfinite(np.concatenate([w.ravel() for w in acc.weights()])))
        assert "skipped_micro_steps" not in acc.counters()


# ------------------------------------------------------ accumulator dtype
# float16 keeps 11 significant bits: 2048 + 1 lies halfway between 2048 and
# 2050 and rounds to even, 2048, so a float16 running sum of 2048, 1, 1, 1
# stays 2048 (mean 512); in float32 it is 2051, whose mean 512.75 rounds to
# the float16 513 once, when the update casts it back. SGD(1.0) from 0.
GRADS_16 = [2048.0, 1.0, 1.0, 1.0]
WIDE = -np.float16(np.float32(sum(GRADS_16)) / np.float32(len(GRADS_16)))
NARROW = -np.float16(np.float16(2048.0) / np.float16(len(GRADS_16)))


@pytest.mark.parametrize("accumulator_dtype, expected, acc_dtype", [
    (None, WIDE, "float32"), ("float32", WIDE, "float32"), ("float16", NARROW, "float16"),
], ids=["default", "float32", "float16"])
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_float16_variables_accumulate_in_float32_and_cast_once_per_update(family, case, accumulator_dtype,
                                                                           expected, acc_dtype):
    assert WIDE != NARROW  # the float16 accumulator stalls: the check can fail
    if accumulator_dtype is None and family != "keras3":
        # The Keras 2, legacy and TF1 families keep the variable's dtype by
        # default (their checkpoints hold such accumulators: a float16 one
        # does not restore into float32); float32 is asked for explicitly.
        expected, acc_dtype = NARROW, "float16"
    t = driver(family).vectors([[0.0, 0.0]], Inner("sgd", 1.0), n=4, dtype="float16",
                               accumulator_dtype=accumulator_dtype)
    for g in GRADS_16:
        t.apply([[g, g]])
    assert t.acc_dtypes() == [acc_dtype]
    assert t.counters()["iterations"] == 1
    value = t.values()[0]
    assert value.dtype == np.float16
    np.testing.assert_array_equal(value, [expected, expected])


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_default_accumulator_of_a_float64_variable_is_float64(family, case):
    t = driver(family).vectors([[0.5, 0.25]], Inner("sgd", 1.0), n=2, dtype="float64")
    t.apply([[1e-17, 1.0]])
    t.apply([[0.0, 0.0]])
    assert t.acc_dtypes() == ["float64"]
    np.testing.assert_array_equal(t.values()[0], np.array([0.5, 0.25]) - np.array([1e-17, 1.0]) / 2)


@pytest.mark.parametrize("bad", ["int32", "not_a_dtype", 3])
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_bad_accumulator_dtype_gets_a_clear_error(family, case, bad):
    from accum_optimizer import AccumulatingOptimizer

    d = driver(family)
    with pytest.raises(ValueError, match="`accumulator_dtype` must be") as info:
        AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), 2, accumulator_dtype=bad)
    assert f"accumulator_dtype={bad!r}" in str(info.value)


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_bad_nonfinite_policy_gets_a_clear_error(family, case):
    from accum_optimizer import AccumulatingOptimizer

    with pytest.raises(ValueError, match="`nonfinite` must be one of .*nonfinite='skip'"):
        AccumulatingOptimizer(driver(family).make_inner(Inner("sgd", 0.1)), 2, nonfinite="skip")


def _configs(d):
    if d.family == "tf1":
        return NotApplicable("tf.compat.v1.train optimizers have no get_config")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _configs))
def test_policy_and_accumulator_dtype_round_trip_through_the_config(family, case):
    from accum_optimizer import AccumulatingOptimizer

    opt = AccumulatingOptimizer(driver(family).make_inner(Inner("sgd", 0.1)), 2, nonfinite="skip_window",
                                accumulator_dtype="float64")
    config = json.loads(json.dumps(opt.get_config()))
    again = type(opt).from_config(config)
    assert (again.nonfinite, again.accumulator_dtype) == ("skip_window", "float64")
    del config["nonfinite"], config["accumulator_dtype"]  # a config of an older version
    again = type(opt).from_config(config)
    assert (again.nonfinite, again.accumulator_dtype) == ("propagate", None)


@pytest.mark.parametrize("family, fmt", params(FAMILIES, lambda d: d.save_formats()))
def test_resume_inside_a_poisoned_window_still_discards_it(family, fmt, tmp_path):
    """"skip_window", N = 3, micro-batch 4 non-finite; saved after micro-batch
    4 (the second window holds 3 and the poisoned 4), restored into a fresh
    model (other initial weights) and optimizer in the family's own format:
    the mark, the skip counters and the window come back, so the window is
    still discarded and the run ends bitwise as the uninterrupted one."""
    d = driver(family)
    x, y = d.data(18)
    bad = _poisoned(x, [2] * 9, 4, np.nan)
    parts = _batches([2] * 9)

    def steps(t, ks):
        for k in ks:
            t.step(bad[parts[k]], y[parts[k]])

    def result(t):
        return t.weights() + t.inner_state(), t.counters()

    with d.trainer(Inner("adam", 0.05), n=3, nonfinite="skip_window") as t:
        steps(t, range(9))
        straight, straight_counters = result(t)
    with d.trainer(Inner("adam", 0.05), n=3, nonfinite="skip_window") as t:
        steps(t, range(5))
        saved = t.save(fmt, tmp_path)
    with d.trainer(Inner("adam", 0.05), n=3, nonfinite="skip_window", seed=7) as t:
        t.restore(fmt, saved)
        steps(t, range(5, 9))
        resumed, counters = result(t)
    assert counters == straight_counters
    assert (counters["iterations"], counters["skipped_micro_steps"], counters["skipped_windows"]) == (2, 1, 1)
    assert_bitwise_equal(straight, resumed)


def _keras_only(d):
    if d.family == "tf1":
        return NotApplicable("tf.distribute strategies are out of scope for TF1 graph code (tf1/test_api.py: refused)")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _keras_only))
def test_every_replica_skips_a_micro_step_that_is_nonfinite_on_one(family, case, strategy):
    """MirroredStrategy, 2 replicas of 2 samples each per micro-step, N = 2,
    "skip_micro_step": NaN only in replica 1's shard of micro-step 1. Both
    replicas drop it (the finiteness flag is all-reduced), so the window is
    micro-steps 0 and 2: the plain inner optimizer on one device on their 8
    samples. Tolerance 1e-5, as the other MirroredStrategy tests."""
    d = driver(family)
    x, y = d.data(12)
    bad = x.copy()
    bad[6:8] = np.nan  # micro-step 1, replica 1
    ref = d.trainer(Inner("adam", 0.05))
    ref.step(np.concatenate([x[0:4], x[8:12]]), np.concatenate([y[0:4], y[8:12]]))
    t = d.trainer(Inner("adam", 0.05), n=2, strategy=strategy, nonfinite="skip_micro_step")
    for k in range(3):
        s = slice(4 * k, 4 * k + 4)
        t.replica_step([bad[s][:2], bad[s][2:]], [y[s][:2], y[s][2:]])
    counters = t.counters()
    assert (counters["iterations"], counters["micro_steps"], counters["skipped_micro_steps"]) == (1, 2, 1)
    _assert_same_training(ref, t, tol=1e-5)
