"""The framework-free core (:mod:`accum_optimizer.core`) driven through the
NumPy reference backend (``tests/support/numpy_backend.py``), in every leg.

References: windows computed by hand (small integer gradients, so every sum
is exact in float32 and every window gradient is one correctly rounded
division), and, for random N, weights and gradient sequences, a plain-Python
simulation of the window (lists of Python numbers, no NumPy, no core code).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accum_optimizer.core import (
    UNKNOWN_POSITION,
    Backend,
    Rules,
    flush,
    micro_step,
    pass_through,
    resume_position,
)
from support.numpy_backend import NumpyBackend, Sparse, Variable, make_window

G1, G2, G3 = np.array([1.0, 2.0]), np.array([3.0, -4.0]), np.array([5.0, 8.0])


def _f32(*values):
    return np.array(values, np.float32)


def _counters(w):
    """(micro_steps, mini_step, updates) as ints."""
    s = w.state
    return int(s.micro_steps.value), int(s.mini_step.value), int(s.updates.value)


def _run(w, steps, weights=None):
    for k, grads in enumerate(steps):
        micro_step(w.b, w.state, w.rules, grads, weight=None if weights is None else np.float32(weights[k]))


def test_numpy_backend_implements_every_backend_method():
    protocol = {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    assert len(protocol) >= 30
    assert sorted(n for n in protocol if not callable(getattr(NumpyBackend, n, None))) == []


def test_mean_window_hands_inner_the_mean_of_its_gradients():
    w = make_window([(2,)], Rules(3))
    _run(w, [[G1], [G2], [G3]])
    [(grads, gates)] = w.inner.calls
    np.testing.assert_array_equal(grads[0], _f32(9 / 3, 6 / 3))  # (1+3+5)/3, (2-4+8)/3
    assert gates == {}
    np.testing.assert_array_equal(w.inner.params[0].value, -_f32(3, 2))  # lr 1 from 0


def test_sum_window_hands_inner_the_sum_of_its_gradients():
    w = make_window([(2,)], Rules(3, reduction="sum"))
    _run(w, [[G1], [G2], [G3]])
    np.testing.assert_array_equal(w.inner.calls[0][0][0], _f32(9, 6))


@pytest.mark.parametrize("n", [2, 3, 4, 6, 7, 8])
def test_mean_window_is_the_correctly_rounded_quotient_for_every_n(n):
    """The window gradient is fl(Σg / N), one correctly rounded division,
    whether N is a power of two (then multiplied by the exact reciprocal,
    the same value) or not (divided). The sum is exact (integers); for
    N = 3, 6 and 7 the product with fl(1/N) differs from the quotient in
    float32 for some of them, so a multiplication there would fail."""
    total = _f32(5, 7, 10, 14, 17, 20, 23, 25)
    w = make_window([(8,)], Rules(n))
    _run(w, [[total]] + [[np.zeros(8)]] * (n - 1))
    [(grads, _)] = w.inner.calls
    expected = total / np.float32(n)
    np.testing.assert_array_equal(grads[0], expected)
    if n & (n - 1):  # (the check is not vacuous)
        assert np.any(total * (np.float32(1) / np.float32(n)) != expected)


def test_weighted_window_hands_inner_the_count_weighted_mean():
    w = make_window([(2,)], Rules(3))
    _run(w, [[G1], [G2], [G3]], weights=[2, 0, 1])
    # (2·g1 + 0·g2 + 1·g3) / (2 + 0 + 1)
    np.testing.assert_array_equal(w.inner.calls[0][0][0], _f32(7 / 3, 12 / 3))


def test_weighted_sum_window_is_not_divided():
    w = make_window([(2,)], Rules(3, reduction="sum"))
    _run(w, [[G1], [G2], [G3]], weights=[2, 0, 1])
    np.testing.assert_array_equal(w.inner.calls[0][0][0], _f32(7, 12))


def test_window_whose_counts_sum_to_zero_is_discarded():
    w = make_window([(2,)], Rules(2))
    _run(w, [[G1], [G2]], weights=[0, 0])
    assert w.inner.calls == []
    assert _counters(w) == (2, 0, 0)
    np.testing.assert_array_equal(w.state.acc_grads[0].value, _f32(0, 0))


def test_accumulators_and_window_are_zeroed_after_an_update():
    w = make_window([(2,), (3,)], Rules(3))
    _run(w, [[G1, np.ones(3)], [G2, None], [G3, np.ones(3)]], weights=[1, 2, 3])
    assert len(w.inner.calls) == 1
    s = w.state
    for acc in s.acc_grads:
        np.testing.assert_array_equal(acc.value, np.zeros_like(acc.value))
    assert float(s.window_weight.value) == 0.0
    assert int(s.mini_step.value) == 0
    np.testing.assert_array_equal(s.grad_received.value, [0, 0])


def test_counters_at_every_micro_step():
    w = make_window([(2,)], Rules(3))
    seen = []
    for _ in range(7):
        micro_step(w.b, w.state, w.rules, [G1])
        seen.append(_counters(w))
    # (micro_steps, mini_step, updates): an update every third micro-step.
    assert seen == [(1, 1, 0), (2, 2, 0), (3, 0, 1), (4, 1, 1), (5, 2, 1), (6, 0, 2), (7, 1, 2)]


def test_only_the_window_moves_between_updates():
    w = make_window([(2,)], Rules(3))
    _run(w, [[G1], [G2]])
    assert w.inner.calls == []
    np.testing.assert_array_equal(w.inner.params[0].value, _f32(0, 0))
    assert int(w.inner.iterations.value) == 0
    np.testing.assert_array_equal(w.state.acc_grads[0].value, _f32(4, -2))  # g1 + g2
    assert float(w.state.window_weight.value) == 2.0
    np.testing.assert_array_equal(w.state.grad_received.value, [1])


def test_window_of_one_updates_every_micro_step_with_its_gradient():
    w = make_window([(2,)], Rules(1))
    _run(w, [[G1], [G2]])
    assert [c[0][0].tolist() for c in w.inner.calls] == [G1.tolist(), G2.tolist()]
    assert _counters(w) == (2, 0, 2)


def test_mean_divides_by_the_window_count_where_a_variable_missed_micro_steps():
    w = make_window([(2,), (2,)], Rules(3))
    _run(w, [[G1, G2], [G2, None], [G3, None]])
    [(grads, gates)] = w.inner.calls
    np.testing.assert_array_equal(grads[1], _f32(3 / 3, -4 / 3))  # g2 over 3, not over 1
    assert gates == {1: True}  # no gradient on the closing micro-step, one earlier


def test_variable_without_a_gradient_in_the_window_is_gated_off():
    w = make_window([(2,), (2,)], Rules(2))
    _run(w, [[G1, None], [G2, None]])
    [(grads, gates)] = w.inner.calls
    assert gates == {1: False}
    np.testing.assert_array_equal(w.inner.params[1].value, _f32(0, 0))
    np.testing.assert_array_equal(w.inner.params[0].value, -_f32(2, -1))


def test_flush_applies_a_partial_window_normalised_by_its_own_count():
    w = make_window([(2,)], Rules(3))
    _run(w, [[G1], [G2]])
    flush(w.b, w.state, w.rules)
    [(grads, gates)] = w.inner.calls
    np.testing.assert_array_equal(grads[0], _f32(4 / 2, -2 / 2))  # (g1 + g2) / 2, not / 3
    assert gates == {0: True}
    assert _counters(w) == (2, 0, 1)  # micro_steps unchanged; one update
    np.testing.assert_array_equal(w.state.acc_grads[0].value, _f32(0, 0))
    # The next window starts afresh: three more micro-steps to its update.
    _run(w, [[G1], [G2]])
    assert len(w.inner.calls) == 1


def test_flush_of_a_weighted_partial_window_uses_its_weights():
    w = make_window([(2,)], Rules(4))
    _run(w, [[G1], [G3]], weights=[3, 1])
    flush(w.b, w.state, w.rules)
    np.testing.assert_array_equal(w.inner.calls[0][0][0], _f32(8 / 4, 14 / 4))  # (3·g1 + g3) / 4


@pytest.mark.parametrize("weighted", [None, False])
def test_flush_of_an_empty_window_changes_nothing(weighted):
    w = make_window([(2,)], Rules(2, weighted=weighted))
    flush(w.b, w.state, w.rules)
    _run(w, [[G1], [G2]])
    flush(w.b, w.state, w.rules)
    assert len(w.inner.calls) == 1
    assert _counters(w) == (2, 0, 1)


@pytest.mark.parametrize("micro_steps, n, position", [(7, 3, 1), (6, 3, 0), (5, 4, 1), (2, 5, 2)])
def test_resume_position_is_micro_steps_modulo_n(micro_steps, n, position):
    w = make_window([(2,)], Rules(n))
    w.state.micro_steps.set(micro_steps)
    w.state.mini_step.set(UNKNOWN_POSITION)
    resume_position(w.b, w.state, w.rules)
    assert int(w.state.mini_step.value) == position
    assert float(w.state.window_weight.value) == position  # each earlier micro-step counted 1
    # The restored window closes after its remaining n - position micro-steps.
    _run(w, [[G1]] * (n - position - 1))
    assert w.inner.calls == []
    _run(w, [[G1]])
    assert len(w.inner.calls) == 1


def test_resume_position_derives_a_zero_position_with_marked_gradients():
    # A checkpoint from before mini_step existed, restored mid-window into a
    # fresh state (mini_step 0, grad_received marked): position unknown.
    w = make_window([(2,)], Rules(3))
    w.state.micro_steps.set(5)
    w.state.grad_received.set([1])
    resume_position(w.b, w.state, w.rules)
    assert int(w.state.mini_step.value) == 2


def test_resume_position_leaves_a_known_position():
    w = make_window([(2,)], Rules(3))
    _run(w, [[G1], [G2], [G3], [G1]])
    before = (_counters(w), float(w.state.window_weight.value))
    w.state.micro_steps.set(8)  # would give 2 if it were derived
    resume_position(w.b, w.state, w.rules)
    assert (_counters(w)[1:], float(w.state.window_weight.value)) == (before[0][1:], before[1])


def test_resume_position_under_a_schedule_is_zero():
    w = make_window([(2,)], Rules({0: 3}))
    w.state.micro_steps.set(7)
    w.state.mini_step.set(UNKNOWN_POSITION)
    resume_position(w.b, w.state, w.rules)
    assert int(w.state.mini_step.value) == 0


@pytest.mark.parametrize("length", [{0: 2, 2: 3}, lambda update: 2 if update < 2 else 3],
                         ids=["dict", "callable"])
def test_schedule_picks_each_window_length_from_the_update_count(length):
    w = make_window([(2,)], Rules(length))
    updates_after = []
    for _ in range(10):
        micro_step(w.b, w.state, w.rules, [G1])
        updates_after.append(_counters(w)[2])
    # Windows of 2, 2, then 3, 3: updates after micro-steps 2, 4, 7, 10.
    assert updates_after == [0, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_callable_schedule_below_one_is_refused_when_it_runs():
    w = make_window([(2,)], Rules(lambda update: 0))
    with pytest.raises(ValueError, match="must return an int >= 1"):
        micro_step(w.b, w.state, w.rules, [G1])


def test_skip_micro_step_drops_a_non_finite_micro_step_uncounted():
    w = make_window([(2,)], Rules(2, nonfinite="skip_micro_step"))
    _run(w, [[G1], [np.array([np.nan, 1.0])], [G2]])
    [(grads, _)] = w.inner.calls
    np.testing.assert_array_equal(grads[0], _f32(4 / 2, -2 / 2))  # (g1 + g2) / 2
    assert _counters(w) == (2, 0, 1)
    assert int(w.state.skipped_micro_steps.value) == 1
    assert int(w.state.skipped_windows.value) == 0


def test_skip_window_discards_a_window_with_a_non_finite_micro_step():
    w = make_window([(2,)], Rules(2, nonfinite="skip_window"))
    _run(w, [[G1], [np.array([np.inf, 1.0])], [G2], [G3]])
    [(grads, _)] = w.inner.calls  # the first window was discarded
    np.testing.assert_array_equal(grads[0], _f32(8 / 2, 4 / 2))  # (g2 + g3) / 2
    assert _counters(w) == (4, 0, 1)
    assert (int(w.state.skipped_micro_steps.value), int(w.state.skipped_windows.value)) == (1, 1)
    assert int(w.state.window_poisoned.value) == 0


def test_propagate_hands_a_non_finite_window_to_the_inner_optimizer():
    w = make_window([(2,)], Rules(2))
    _run(w, [[G1], [np.array([np.inf, 1.0])]])
    assert np.isinf(w.inner.calls[0][0][0][0])


def test_sparse_gradients_scatter_add_and_the_window_is_sparse_over_touched_rows():
    w = make_window([(4, 2)], Rules(2), tracked=[True])
    rows = lambda *r: np.array(r)  # noqa: E731
    _run(w, [[Sparse(np.ones((2, 2)), rows(0, 2), (4, 2))], [Sparse(np.full((2, 2), 3.0), rows(2, 2), (4, 2))]])
    [(grads, _)] = w.inner.calls
    window = grads[0]
    assert isinstance(window, Sparse)
    np.testing.assert_array_equal(window.indices, [0, 2])  # ascending, each once
    np.testing.assert_array_equal(window.values, [[1 / 2, 1 / 2], [7 / 2, 7 / 2]])  # (1+3+3)/2 on row 2
    np.testing.assert_array_equal(w.state.acc_grads[0].value, np.zeros((4, 2)))
    np.testing.assert_array_equal(w.state.touched_rows[0].value, np.zeros(4))


def test_sparse_window_handed_dense_where_the_inner_needs_it():
    w = make_window([(3, 1)], Rules(2), tracked=[True], sparse_update=[False])
    _run(w, [[Sparse(np.ones((1, 1)), np.array([1]), (3, 1))], [None]])
    np.testing.assert_array_equal(w.inner.calls[0][0][0], _f32([0], [1 / 2], [0]))


def test_max_combined_variable_gets_its_window_maximum_unweighted():
    w = make_window([(2,), (2,)], Rules(3), combine=["reduction", "max"])
    _run(w, [[G1, G1], [G2, G2], [G3, -G3]], weights=[1, 0, 2])
    [(grads, _)] = w.inner.calls
    np.testing.assert_array_equal(grads[1], _f32(3, 2))  # max(g1, g2, -g3), no weight, no division
    np.testing.assert_array_equal(grads[0], _f32(11 / 3, 18 / 3))  # (g1 + 2·g3) / 3


def test_wider_accumulator_casts_the_window_gradient_back_to_the_variable_dtype():
    w = make_window([(2,)], Rules(2), accumulator_dtype=np.float32, variable_dtype=np.float16)
    _run(w, [[G1.astype(np.float16)], [G2.astype(np.float16)]])
    window = w.inner.calls[0][0][0]
    assert window.dtype == np.float16
    assert w.state.acc_grads[0].dtype == np.float32


def test_pass_through_updates_with_each_micro_step_and_counts_it():
    w = make_window([(2,)], Rules(1))
    handed = []
    pass_through(w.b, w.state.micro_steps, [G1], handed.append, "mean")
    pass_through(w.b, w.state.micro_steps, [G2], handed.append, "sum", weight=np.float32(3))
    pass_through(w.b, w.state.micro_steps, [G3], handed.append, "mean", weight=np.float32(0))
    assert [h[0].tolist() for h in handed] == [G1.tolist(), (3 * G2).tolist()]  # count 0: nothing
    assert int(w.state.micro_steps.value) == 3


def test_rules_needing_a_missing_state_field_are_refused_naming_it():
    w = make_window([(2,)], Rules(2))
    with pytest.raises(ValueError, match="skipped_micro_steps"):
        micro_step(w.b, w.state, Rules(2, nonfinite="skip_micro_step"), [G1])


# ----------------------------------------------- against a plain-Python window
def _reference(n, reduction, steps, weights, flushed):
    """Plain Python: the inner calls ``(window_grads, gates)`` and the final
    ``(micro_steps, mini_step, updates, acc, window_weight)`` of windows of
    ``n`` over ``steps`` (per micro-step, per variable, a list of numbers or
    ``None``), with a count per micro-step (``weights``, or 1 each), then a
    flush if ``flushed``."""
    k, size = len(steps[0]), 2
    fresh = lambda: ([[0.0] * size for _ in range(k)], 0.0, 0, [0] * k)  # noqa: E731
    (acc, count, position, received), calls = fresh(), []

    def close(grads):
        if count > 0 or weights is None:  # a window of counts summing to 0 is discarded
            divisor = count if reduction == "mean" else 1
            gates = {i: bool(received[i]) for i, g in enumerate(grads) if g is None}
            calls.append(([[a / divisor for a in acc_i] for acc_i in acc], gates))

    for t, grads in enumerate(steps):
        c = 1 if weights is None else weights[t]
        for i, g in enumerate(grads):
            if g is not None:
                acc[i] = [a + c * x for a, x in zip(acc[i], g)]
                received[i] = 1
        count, position = count + c, position + 1
        if position == n:
            close(grads)
            acc, count, position, received = fresh()
    if flushed and position > 0:
        close([None] * k)
        acc, count, position, received = fresh()
    return calls, (len(steps), position, len(calls), acc, count)


_gradient = st.one_of(st.none(), st.lists(st.integers(-8, 8), min_size=2, max_size=2))


@st.composite
def _windows(draw):
    """(N, per micro-step the gradients of k variables, counts or None)."""
    n, k, t = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    steps = draw(st.lists(st.lists(_gradient, min_size=k, max_size=k), min_size=t, max_size=t))
    weights = draw(st.lists(st.sampled_from([0, 0, 1, 3]), min_size=t, max_size=t)) if draw(st.booleans()) else None
    return n, steps, weights


@given(_windows(), st.sampled_from(["mean", "sum"]), st.booleans())
def test_windows_match_a_plain_python_window_for_any_n_and_gradients(case, reduction, flushed):
    n, steps, weights = case
    w = make_window([(2,)] * len(steps[0]), Rules(n, reduction=reduction))
    _run(w, [[None if g is None else np.array(g, np.float32) for g in grads] for grads in steps], weights)
    if flushed:
        flush(w.b, w.state, w.rules)
    calls, (micro, position, updates, acc, count) = _reference(n, reduction, steps, weights, flushed)
    assert len(w.inner.calls) == len(calls)
    for (got, got_gates), (want, want_gates) in zip(w.inner.calls, calls):
        assert got_gates == want_gates
        for g, v in zip(got, want):
            np.testing.assert_array_equal(g, np.array(v, np.float32))  # exact: integer sums, one division
    assert _counters(w) == (micro, position, updates)
    assert float(w.state.window_weight.value) == count
    for a, v in zip(w.state.acc_grads, acc):
        np.testing.assert_array_equal(a.value, np.array(v, np.float32))


def test_numpy_variable_keeps_its_shape_and_dtype():
    v = Variable(np.zeros(3), np.float32)
    NumpyBackend(None).assign(v, 2)
    assert v.value.tolist() == [2.0, 2.0, 2.0] and v.dtype == np.float32
