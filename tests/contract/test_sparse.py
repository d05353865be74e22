"""Sparse (``tf.IndexedSlices``) gradients stay sparse while they
accumulate: the traced micro-step scatter-adds an embedding table's gradient
into its accumulator and never makes it dense.

Reference: the op types of the micro-step's graph (a 200,000 x 8 table, N =
8): on an accumulate-only micro-step, the ops outside the window's ``cond``
and those of its false branch. On an update (its true branch) the gradient
is scatter-added too; the inner update there may be dense (once per
window). The check is shown not to be vacuous on the same step with the
plain inner optimizer, which densifies the slices (an ``UnsortedSegmentSum``)
or writes its slots densely.
"""

from __future__ import annotations

import pytest

from support.drivers import FAMILIES, NotApplicable, driver, params

VOCAB, DIM, N = 200_000, 8, 8


def _cases(d):
    if d.family == "legacy":
        return NotApplicable("legacy/test_sparse.py::test_micro_step_scatter_adds_and_never_densifies reads the "
                             "graph's functions too, on its own embedding model")
    if d.family == "tf1":
        return NotApplicable("tf1/test_semantics.py::test_sparse_gradients_are_scatter_added_never_densified "
                             "(graph code: its train op's ops)")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_micro_step_graph_scatter_adds_and_never_densifies_a_large_table(family, case):
    from support.reference import densifications

    d = driver(family)
    ops = d.sparse_step_ops(VOCAB, DIM, n=N)
    assert [op.type for op in ops].count("ResourceScatterAdd") == 1  # the table's accumulator
    assert densifications(ops, VOCAB, DIM) == []
    assert densifications(d.sparse_step_ops(VOCAB, DIM), VOCAB, DIM) != []  # the check is not vacuous
    update = d.sparse_step_ops(VOCAB, DIM, n=N, branch="then_branch")
    assert [op.type for op in update].count("ResourceScatterAdd") == 1  # the closing micro-step's, into the table
