"""Save and resume mid-window, bitwise, in each family's own formats: the
window's position (``mini_step``, which a flush makes differ from
``micro_steps % N``), its weight and the accumulators are state.

Reference: the same run without interruption (bitwise). The run: N = 3,
Adam, micro-batches of 2 whose weights are k + 1: 2 micro-steps, a flush, 2
micro-steps (mid-window: ``mini_step`` 2, ``micro_steps`` 4, so
``micro_steps % N`` is 1, not 2), save, restore into a fresh model (other
initial weights: the restore must overwrite them) and optimizer, 4 more
micro-steps.
"""

from __future__ import annotations

import functools

import pytest

from support.arrays import assert_bitwise_equal
from support.drivers import FAMILIES, Inner, driver, params

pytestmark = pytest.mark.windows  # (the Makefile runs each Keras 2 family's in one leg)


def _run(d, fmt, directory, flush=True, drop_window=False):
    """The final weights, inner state and counters; ``fmt=None``: no
    interruption. Without ``flush``: no flush and no weights (what state saved
    before ``mini_step`` and ``window_weight`` existed can hold)."""
    x, y = d.data(16)

    def steps(t, ks):
        for k in ks:
            t.step(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2], weight=float(k + 1) if flush else None)

    t = d.trainer(Inner("adam", 0.05), n=3, weighted=flush)
    steps(t, range(2))
    if flush:
        t.flush()
    steps(t, range(2, 4))
    if fmt is not None:
        saved = t.save(fmt, directory, drop_window=drop_window)
        t = d.trainer(Inner("adam", 0.05), n=3, weighted=flush, seed=7)
        t.restore(fmt, saved, drop_window=drop_window)
    steps(t, range(4, 8))
    counters = t.counters()
    return t.weights() + t.inner_state(), (counters["micro_steps"], counters["iterations"], counters["mini_step"])


@functools.cache
def _straight(family, flush):
    """The uninterrupted run (computed once per family and ``flush``; only read)."""
    return _run(driver(family), None, None, flush=flush)


@pytest.mark.parametrize("family, fmt", params(FAMILIES, lambda d: d.save_formats()))
def test_resume_mid_window_after_a_flush_is_bitwise_the_uninterrupted_run(family, fmt, tmp_path):
    d = driver(family)
    straight, straight_counters = _straight(family, True)
    resumed, counters = _run(d, fmt, tmp_path)
    assert counters == straight_counters == (8, 3, 0)
    assert_bitwise_equal(straight, resumed)


@pytest.mark.parametrize("family, fmt", params(FAMILIES, lambda d: d.old_save_formats()))
def test_state_saved_without_the_window_variables_resumes_at_micro_steps_mod_n(family, fmt, tmp_path):
    """State saved before ``mini_step``/``window_weight`` existed (without
    them; unweighted, no flush, so the window's position was
    ``micro_steps % N``) resumes bitwise: the position comes back as
    ``micro_steps % N``."""
    d = driver(family)
    straight, straight_counters = _straight(family, False)
    resumed, counters = _run(d, fmt, tmp_path, flush=False, drop_window=True)
    assert counters == straight_counters
    assert_bitwise_equal(straight, resumed)
