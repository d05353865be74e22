"""Missing gradients: a variable with no gradient in a window is not updated
at all (no step, no slot decay, no weight decay, no constraint, no EMA step);
one with gradients on some micro-steps only gets the sum of those, also when
the window closes on a micro-step without its gradient.

References: values computed by hand with SGD; the plain inner optimizer fed
the gradient of each window's mean loss computed on ONE tape (graph) over
the window's micro-batch losses (a hand-built large batch), where a variable
that no micro-batch loss touches gets ``None`` exactly as in large-batch
training. The model is ``y = a(x) + b(x)``, b's kernel under a non-negativity
constraint and starting with negative entries (constraining it without an
update would show); which micro-steps use b: :data:`PATTERN`.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import assert_bitwise_equal, max_abs_diff
from support.drivers import FAMILIES, PATTERN, Inner, driver, params

ALL = FAMILIES + ("tfa",)


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_missing_gradient_on_the_last_micro_step_keeps_the_window_sum_by_hand(family, case):
    """Plain SGD, lr 1, N = 4, mean. Per micro-step gradients
    w: 1, 2, 3, None  ->  w = 0 - (1 + 2 + 3) / 4 = -1.5;
    v: 10, None, 20, 30 -> v = 0 - (10 + 20 + 30) / 4 = -15."""
    t = driver(family).vectors([0.0, 0.0], Inner("sgd", 1.0), n=4)
    for gw, gv in [(1.0, 10.0), (2.0, None), (3.0, 20.0), (None, 30.0)]:
        t.apply([gw, gv])
    w, v = t.values()
    assert float(w) == -1.5
    assert float(v) == -15.0
    assert t.counters()["iterations"] == 1


# Plain Keras optimizers warn about b's missing gradient in the reference.
@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
@pytest.mark.parametrize("family, case", params(ALL, lambda d: d.missing_gradient_cases()))
def test_a_variable_without_gradient_in_a_window_is_not_updated(family, case):
    """After every window: the weights and every inner variable equal the
    hand-built large batch's (1e-6). Window 0 (b unused) leaves b at its
    initial values, window 4 (b unused again, now that b, its slots and its
    EMA shadow are away from their initial values) leaves b and every inner
    variable of b bitwise as window 3 left them, while a moved. ``case``
    says whether the micro-steps without b pass ``None`` for it or leave b
    out of the variables they pass."""
    d = driver(family)
    ref, acc = d.missing_gradient_runs(case)
    assert acc["iterations"] == len(PATTERN)
    for w, (r, a) in enumerate(zip(ref["windows"], acc["windows"])):
        assert max_abs_diff(r["weights"], a["weights"]) <= 1e-6, f"window {w}: weights"
        assert max_abs_diff(r["state"], a["state"]) <= 1e-6, f"window {w}: inner state"
    b_weights = [i for i, name in enumerate(acc["weight_names"]) if "branch_b" in name]
    b_state = [i for i, name in enumerate(acc["state_names"]) if "branch_b" in name]
    a_weights = [i for i, name in enumerate(acc["weight_names"]) if "branch_a" in name]
    assert len(b_weights) == len(a_weights) == 2 and b_state, (acc["weight_names"], acc["state_names"])
    assert np.any(acc["initial"][b_weights[0]] < 0)  # the constraint would have moved it
    not_b_state = [i for i in range(len(acc["state_names"])) if i not in b_state]
    for run, name in ((acc, "accumulating"), (ref, "large batch")):
        windows = run["windows"]
        assert_bitwise_equal([windows[0]["weights"][i] for i in b_weights], [acc["initial"][i] for i in b_weights],
                             f"{name}: b in window 0")
        assert_bitwise_equal([windows[4]["weights"][i] for i in b_weights],
                             [windows[3]["weights"][i] for i in b_weights], f"{name}: b in window 4")
        assert_bitwise_equal([windows[4]["state"][i] for i in b_state], [windows[3]["state"][i] for i in b_state],
                             f"{name}: b's inner variables in window 4")
        # ...while b did move in the windows that use it, and a and the rest
        # of the inner state (iterations, ...) moved in window 4.
        assert max_abs_diff([windows[3]["weights"][i] for i in b_weights], [acc["initial"][i] for i in b_weights]) > 1e-3
        assert max_abs_diff([windows[4]["weights"][i] for i in a_weights],
                            [windows[3]["weights"][i] for i in a_weights]) > 0
        assert max_abs_diff([windows[4]["state"][i] for i in not_b_state],
                            [windows[3]["state"][i] for i in not_b_state]) > 0
    # The wrapper leaves no instance attribute on the inner optimizer that
    # shadows its update method (the per-variable gating is undone).
    assert "update_step" not in acc["inner_attributes"]
