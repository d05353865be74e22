"""Schedules count updates: learning-rate schedules (and the tfa wrappers that
count ``iterations``) see one step per window, never one per micro-step; an
accumulation schedule (``gradient_accumulation_steps`` a dict or a callable
of the update index) makes each window as long as it says.

References: the plain inner optimizer on the large batch each window stands
for (:mod:`support.drivers`), the same reference with its schedule stepped N
times faster (what counting micro-steps would give: the check can fail), and
hand-derived counts.
"""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.arrays import assert_bitwise_equal, max_abs_diff, trajectory_diff
from support.drivers import FAMILIES, Inner, NotApplicable, assert_matches_large_batch, driver, params
from support.schedules import GrowingWindows, registered

ALL = FAMILIES + ("tfa",)
TOL = 1e-6  # float32 rounding of a few updates


# ------------------------------------------------- learning-rate schedules
@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.schedule_cases()))
def test_learning_rate_schedule_counts_updates(family, case):
    """Boundaries and decay lengths are in updates; the windows trained cross
    them: the trajectory (and, where the family reports it, the current
    learning rate) equals the large batch's."""
    ref, acc = driver(family).pair(case)
    assert_matches_large_batch(family, case, ref, acc)


@pytest.mark.parametrize("family, case", params(ALL))
def test_schedule_check_is_not_vacuous(family, case):
    """A schedule fed micro-steps would run N times faster: the reference with
    its schedule stepped N times faster leaves a trajectory far outside the
    tolerance, so the test above can fail."""
    d = driver(family)
    schedule, fast = d.fast_schedule_pair()
    assert trajectory_diff(d.reference(schedule).trajectory, d.reference(fast).trajectory) > 100 * 1e-5


# ----------------------------------------------------- accumulation schedules
def _schedules(d):
    return [None]


def _configs(d):
    if d.family == "tf1":
        return NotApplicable("tf.compat.v1.train optimizers have no get_config")
    return [None]


def _assert_same_training(ref, acc, tol=TOL):
    assert acc.counters()["iterations"] == ref.counters()["iterations"]
    assert max_abs_diff(ref.weights(), acc.weights()) <= tol
    assert max_abs_diff(ref.inner_state(), acc.inner_state()) <= tol


def _schedule_run(d, schedule, per_update, b=2):
    """Micro-batches of ``b`` with ``schedule``; reference: plain SGD with
    momentum on batches of ``b * N(u)``."""
    x, y = d.data(b * sum(per_update))
    ref = d.trainer(Inner("sgd", 0.1, momentum=0.9))
    acc = d.trainer(Inner("sgd", 0.1, momentum=0.9), n=schedule)
    start = 0
    for n in per_update:
        ref.step(x[start:start + n * b], y[start:start + n * b])
        start += n * b
    for k in range(sum(per_update)):
        acc.step(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b])
    return ref, acc


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _schedules))
def test_dict_schedule_equals_growing_large_batches(family, case):
    """{0: 1, 2: 2, 4: 4} over 2 + 4 + 8 + 4*2 micro-batches equals the
    large-batch run with batch sizes B, B, 2B, 2B, 4B, 4B, 4B, 4B."""
    ref, acc = _schedule_run(driver(family), {0: 1, 2: 2, 4: 4}, [1, 1, 2, 2, 4, 4, 4, 4])
    _assert_same_training(ref, acc)
    assert acc.counters()["iterations"] == 8 and acc.counters()["micro_steps"] == 22


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _schedules))
def test_callable_schedule_equals_growing_large_batches(family, case):
    seen = []

    def n_of(update):
        seen.append(update.dtype)
        return tf.where(update < 2, tf.constant(1, tf.int64), tf.constant(3, tf.int64))

    ref, acc = _schedule_run(driver(family), n_of, [1, 1, 3, 3])
    _assert_same_training(ref, acc)
    assert seen and all(dtype == tf.int64 for dtype in seen)


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _schedules))
def test_callable_schedule_receives_the_update_index(family, case):
    """N(u) = u + 1: windows of 1, 2, 3 micro-steps (updates after
    micro-steps 1, 3, 6), the index an int64."""
    seen = []

    def n(update):
        seen.append(update.dtype)
        return update + 1

    t = driver(family).vectors([0.0], Inner("sgd", 0.1), n=n)
    counts = []
    for _ in range(6):
        t.apply([1.0])
        counts.append(t.counters()["iterations"])
    assert counts == [1, 1, 2, 2, 2, 3]
    assert set(seen) == {tf.int64}


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _schedules))
def test_a_flush_counts_as_an_update_of_the_schedule(family, case):
    """{0: 1, 1: 2, 2: 3}: one micro-step (update 0), one into update 1's
    window of 2, a flush (update 1, partial): the next window is update 2's,
    of 3 micro-steps (counting the flush; without it, it would be update 1's
    window of 2 again)."""
    t = driver(family).vectors([0.0], Inner("sgd", 0.1), n={0: 1, 1: 2, 2: 3})
    t.apply([1.0])
    t.apply([1.0])
    t.flush()
    assert t.counters()["iterations"] == 2
    counts = []
    for _ in range(3):
        t.apply([1.0])
        counts.append(t.counters()["iterations"])
    assert counts == [2, 2, 3]


@pytest.mark.windows
@pytest.mark.parametrize("family, fmt", params(FAMILIES, lambda d: d.save_formats()))
def test_resume_mid_window_of_a_schedule_is_bitwise_the_uninterrupted_run(family, fmt, tmp_path):
    """{0: 1, 2: 3}: windows of 1, 1, 3, 3 micro-steps. Saved after micro-step
    4 (update 2's window holds 2 of its 3), restored into a fresh model
    (other initial weights) and optimizer: the schedule's position (the
    update count that picks N) and the window come back, and 4 more
    micro-steps give the uninterrupted run's weights, inner state and
    counters, bitwise."""
    d = driver(family)
    x, y = d.data(16)
    schedule = {0: 1, 2: 3}

    def steps(t, ks):
        for k in ks:
            t.step(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])

    def result(t):
        c = t.counters()
        return t.weights() + t.inner_state(), (c["micro_steps"], c["iterations"], c["mini_step"])

    with d.trainer(Inner("adam", 0.05), n=schedule) as t:
        steps(t, range(8))
        straight, straight_counters = result(t)
    with d.trainer(Inner("adam", 0.05), n=schedule) as t:
        steps(t, range(4))
        assert t.counters()["mini_step"] == 2
        saved = t.save(fmt, tmp_path)
    with d.trainer(Inner("adam", 0.05), n=schedule, seed=7) as t:
        t.restore(fmt, saved)
        steps(t, range(4, 8))
        resumed, counters = result(t)
    assert counters == straight_counters == (8, 4, 0)
    assert_bitwise_equal(straight, resumed)


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _configs))
def test_schedule_config_round_trips_through_json(family, case):
    """A dict schedule survives get_config -> JSON -> from_config (string
    keys) and still closes windows at the same micro-steps; an unregistered
    callable refuses get_config with a message naming the fix."""
    d = driver(family)
    opt = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps={0: 1, 2: 2})
    config = json.loads(json.dumps(opt.get_config()))
    assert config["gradient_accumulation_steps"] == {"0": 1, "2": 2}
    again = type(opt).from_config(config)
    assert again.gradient_accumulation_steps == {0: 1, 2: 2}
    v = d.variable(0.0)
    counts = []
    for _ in range(6):
        again.apply_gradients([(tf.constant(1.0), v)])
        counts.append(int(again.iterations.numpy()))
    assert counts == [1, 2, 2, 3, 3, 4]
    fn = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=lambda u: 2)
    with pytest.raises(ValueError, match="not a registered Keras object"):
        fn.get_config()


class Unregistered(GrowingWindows):
    """Never registered (its base may be: registration is per class)."""


class Unconfigurable:
    """Callable without ``get_config`` (which Keras' registration refuses):
    it cannot be saved."""

    def __call__(self, update):
        return tf.constant(2, tf.int64)


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _configs))
def test_registered_schedule_object_round_trips_and_resumes_bitwise(family, case, tmp_path):
    """A registered schedule object survives get_config -> JSON -> from_config
    and ``keras.optimizers.serialize``/``deserialize`` as an equal object;
    training resumed mid-window (the state saved, a fresh optimizer rebuilt
    from the JSON config) continues bitwise like the uninterrupted run."""
    d = driver(family)
    cls = registered(d.keras)
    opt = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=cls(3))
    config = json.loads(json.dumps(opt.get_config()))
    again = type(opt).from_config(config)
    assert type(again.gradient_accumulation_steps) is cls and again.gradient_accumulation_steps.cap == 3
    serialized = json.loads(json.dumps(d.keras.optimizers.serialize(opt)))
    back = d.keras.optimizers.deserialize(serialized)
    assert type(back) is type(opt) and type(back.gradient_accumulation_steps) is cls
    assert back.gradient_accumulation_steps.cap == 3

    # Windows of 1, 1, 2, 2, 3: 9 micro-steps; save after 6 (mid-window: the
    # fifth window, of 3, has 1 micro-step), resume into an optimizer built
    # from the JSON config.
    x, y = d.data(2 * 9)
    fmt = d.save_formats()[0]

    def steps(t, ks):
        for k in ks:
            t.step(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])

    straight = d.trainer(Inner("sgd", 0.1, momentum=0.9), n=cls(3))
    steps(straight, range(9))
    assert straight.counters()["iterations"] == 5
    cut = d.trainer(Inner("sgd", 0.1, momentum=0.9), n=cls(3))
    steps(cut, range(6))
    saved = cut.save(fmt, tmp_path)
    schedule = type(cut.opt).from_config(json.loads(json.dumps(cut.opt.get_config()))).gradient_accumulation_steps
    resumed = d.trainer(Inner("sgd", 0.1, momentum=0.9), n=schedule, seed=7)
    resumed.restore(fmt, saved)
    steps(resumed, range(6, 9))
    assert resumed.counters() == straight.counters()
    assert_bitwise_equal(straight.weights() + straight.inner_state(), resumed.weights() + resumed.inner_state())


@pytest.mark.windows
@pytest.mark.parametrize("family, case", params(FAMILIES, _configs))
def test_unsaveable_schedule_object_gets_a_clear_error(family, case):
    """An unregistered schedule object, or one without get_config, refuses get_config with a message naming the argument, the
    value and what is accepted (not Keras' AttributeError on ``__name__``)."""
    d = driver(family)
    for schedule, words in [(Unregistered(3), "not a registered Keras object"), (Unconfigurable(), "get_config")]:
        opt = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=schedule)
        with pytest.raises(ValueError, match="gradient_accumulation_steps") as info:
            opt.get_config()
        message = str(info.value)
        assert words in message and repr(schedule) in message and "register_keras_serializable" in message


BAD_SCHEDULES = [
    ({0: 1, 30: 2, 20: 4}, ValueError, "key 20 (value 4) after key 30"),
    ({1: 2}, ValueError, "first key 1"),
    ({0: 0}, ValueError, "{0: 0}"),
    ({0: 2.0}, TypeError, "{0: 2.0}"),
    ({0: 1.5}, TypeError, "{0: 1.5}"),
    ({0.5: 2}, TypeError, "key 0.5"),
    ({}, ValueError, "empty dict"),
    (2.0, TypeError, "gradient_accumulation_steps=2.0"),
]


@pytest.mark.windows
@pytest.mark.parametrize("bad, error, words", BAD_SCHEDULES, ids=[repr(b[0]) for b in BAD_SCHEDULES])
@pytest.mark.parametrize("family, case", params(FAMILIES, _schedules))
def test_bad_schedule_gets_a_clear_error(family, case, bad, error, words):
    d = driver(family)
    with pytest.raises(error, match="gradient_accumulation_steps") as info:
        AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=bad)
    assert words in str(info.value)

