"""Between updates nothing moves: a micro-step that does not close its window
leaves the weights and every variable of the inner optimizer (slots,
``iterations``, EMA shadows, a schedule's current rate, hyperparameters)
bitwise as they were, while the accumulators fill; the counters follow the
micro-steps (``micro_steps == m``, ``iterations == m // N``).

Reference: snapshots of the same run (bitwise).
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, driver, params

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
