"""Between updates nothing moves: a micro-step that does not close its window
leaves the weights and every variable of the inner optimizer (slots,
``iterations``, EMA shadows, a schedule's current rate, hyperparameters)
bitwise as they were, while the accumulators fill; the counters follow the
micro-steps (``micro_steps == m``, ``iterations == m // N``).

Under ``model.fit`` too, for the families that have it.

Reference: snapshots of the same run (bitwise).
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, NotApplicable, driver, params

N, B, STEPS = 4, 3, 14


@pytest.mark.parametrize("family, mode", params(FAMILIES, lambda d: d.between_updates_modes()))
def test_non_update_micro_steps_leave_weights_and_inner_state_bitwise_untouched(family, mode):
    d = driver(family)
    x, y = d.data(STEPS * B)
    with d.trainer(d.RICH_INNER, n=N, mode=mode) as t:
        t.build()
        before = t.snapshot()
        n_weights = len(t.weights())
        for m in range(1, STEPS + 1):
            t.step(x[(m - 1) * B:m * B], y[(m - 1) * B:m * B])
            after = t.snapshot()
            counters = t.counters()
            assert (counters["micro_steps"], counters["iterations"]) == (m, m // N)
            if m % N:
                assert_bitwise_equal(before, after, f"micro-step {m}")
                assert any(np.any(a != 0) for a in t.acc_grads())  # ...while the accumulators did move
            else:
                for i in range(n_weights):  # every weight moved
                    assert max_abs_diff([before[i]], [after[i]]) > 0, f"weight {i} at the update {m}"
                assert max_abs_diff(before[n_weights:], after[n_weights:]) > 0
                if d.ALL_STATE_MOVES_ON_UPDATE:
                    moved = [i for i in range(len(after)) if not np.array_equal(before[i], after[i])]
                    assert moved == list(range(len(after)))
                assert all(np.all(a == 0) for a in t.acc_grads())
            before = after


def _fit_cases(d):
    if d.family == "tf1":
        return NotApplicable("TF1 graph code has no model.fit (its micro-steps are the train op's runs, above)")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _fit_cases))
def test_fit_non_update_batches_leave_inner_state_bitwise_untouched(family, case):
    """``model.fit`` of 12 batches of 2 (the wrapper compiled into the
    family's Keras, N = 4, the rich inner optimizer): after each batch that
    does not close a window the weights and every inner variable are bitwise
    as after the batch before; each update moves them."""
    from accum_optimizer import AccumulatingOptimizer

    d = driver(family)
    model, inner = d.R.make_mlp(), d.make_inner(d.RICH_INNER)
    model.compile(optimizer=AccumulatingOptimizer(inner, N), loss="mse")
    states = []
    record = d.keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: states.append(d.snapshot(model, inner)))
    x, y = d.data(2 * 12)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    assert len(states) == 12 and int(model.optimizer.iterations.numpy()) == 12 // N
    for m in range(1, 12):
        if (m + 1) % N:  # batch m (0-based) is micro-step m + 1
            assert_bitwise_equal(states[m - 1], states[m], f"batch {m}")
        else:
            assert max_abs_diff(states[m - 1], states[m]) > 0
