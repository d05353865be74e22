"""Comparing arrays, for every family's references (imports no framework)."""

from __future__ import annotations

import numpy as np


def max_abs_diff(a_list, b_list) -> float:
    """Max absolute difference between two equally long, non-empty lists of
    arrays (or anything ``np.asarray`` reads: variables, scalars) of equal
    shapes. NaN or inf anywhere counts as inf, so it never passes a
    ``<= tol`` check."""
    a_list, b_list = list(a_list), list(b_list)
    if len(a_list) != len(b_list) or not a_list:
        raise AssertionError(f"cannot compare {len(a_list)} arrays with {len(b_list)}")
    worst = 0.0
    for a, b in zip(a_list, b_list):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
        if a.size:
            d = float(np.max(np.abs(a - b)))
            worst = max(worst, d if np.isfinite(d) else np.inf)
    return worst


def trajectory_diff(ref_trajectory, acc_trajectory) -> float:
    """:func:`max_abs_diff` over two trajectories (a list of arrays after
    every update), which must be equally long."""
    assert len(ref_trajectory) == len(acc_trajectory), (len(ref_trajectory), len(acc_trajectory))
    return max(max_abs_diff(r, a) for r, a in zip(ref_trajectory, acc_trajectory))


def assert_bitwise_equal(a_list, b_list, what: str = "") -> None:
    a_list, b_list = list(a_list), list(b_list)
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}[{i}]")
