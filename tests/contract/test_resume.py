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

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal
from support.drivers import FAMILIES, Inner, NotApplicable, driver, params

pytestmark = pytest.mark.windows  # (.ci/legs.py runs each Keras 2 family's in one leg)


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


def _model_files(d):
    if d.family in ("keras3", "keras2"):
        return ["weights.h5", "keras"]
    return NotApplicable("the family's optimizer state is not in Keras' own model files (.weights.h5, .keras): "
                         "legacy optimizers' is dropped there by Keras 2 (docs/saving.md); TF1 has no model")


def _h5_contents(path) -> dict:
    """``{dataset path: array}`` of an HDF5 file."""
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("family, case", params(FAMILIES, _model_files))
def test_load_weights_into_an_unbuilt_optimizer_restores_its_state_at_once(family, case, tmp_path):
    """``model.load_weights`` (of a ``.weights.h5`` or ``.keras`` file) into a
    compiled model whose optimizer is not built yet: right after the load,
    before any step, the optimizer holds the saved state (every inner
    variable, the accumulators, the counters), saving again writes the
    same file as the original save, and training continues bitwise like the
    uninterrupted run."""
    d = driver(family)
    x, y = d.data(16)

    def trainer(seed):
        t = d.trainer(Inner("adam", 0.05), n=3, seed=seed)
        t.model.compile(optimizer=t.opt, loss="mse")
        return t

    def steps(t, ks):
        for k in ks:
            t.step(x[2 * k:2 * k + 2], y[2 * k:2 * k + 2])

    straight = trainer(0)
    steps(straight, range(4))  # mid-window: 1 update, 1 micro-step into the next
    straight.model.save_weights(str(tmp_path / "w.weights.h5"))
    straight.model.save(str(tmp_path / "m.keras"))
    saved_state, saved_counters = straight.inner_state(), straight.counters()
    saved_own = [np.array(v.numpy()) for v in straight.own_variables()]

    resumed = trainer(7)
    assert len(resumed.inner_state()) < len(saved_state)  # not built yet
    resumed.model.load_weights(str(tmp_path / ("w.weights.h5" if case == "weights.h5" else "m.keras")))
    assert resumed.counters() == saved_counters
    assert_bitwise_equal(saved_state, resumed.inner_state(), "inner optimizer variables")
    assert_bitwise_equal(saved_own, [np.array(v.numpy()) for v in resumed.own_variables()], "wrapper's variables")
    resumed.model.save_weights(str(tmp_path / "again.weights.h5"))
    original, again = _h5_contents(tmp_path / "w.weights.h5"), _h5_contents(tmp_path / "again.weights.h5")
    assert sorted(again) == sorted(original)
    assert_bitwise_equal([original[k] for k in sorted(original)], [again[k] for k in sorted(original)], "file")

    steps(straight, range(4, 8))
    steps(resumed, range(4, 8))
    assert resumed.counters() == straight.counters()
    assert_bitwise_equal(straight.weights() + straight.inner_state(), resumed.weights() + resumed.inner_state())
