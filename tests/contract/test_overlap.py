"""On an update micro-step the inner update can start while the backward
pass still runs, as with Keras' built-in accumulation: the window's
``cond`` in a traced step (``tf.function``, XLA off) waits for no variable
write and no gradient, as the built-in's; every write in its branches waits
for a gradient instead (a step whose input ends writes nothing); each
window gradient waits for its own gradient and the guard (the last
variable's, which the backward pass computes first).

Reference: the graph itself (:mod:`support.graph_deps`); Keras 3's built-in
accumulation, whose ``cond`` waits for no gradient at all and whose branches
hold writes that wait for none, is the reference of
``tests/keras3/test_tracing.py``. Before the window's writes moved into the
``cond``'s branches, the ``cond`` waited for every gradient; before each
write waited for a gradient itself, it waited for one.
"""

from __future__ import annotations

import pytest

from support.drivers import FAMILIES, NotApplicable, driver, params
from support.drivers.base import Inner
from support.graph_deps import own_and_guard

N = 4


def _cases(d):
    if d.family == "tf1":
        return NotApplicable("TF1 graph code has no automatic control dependencies: its train op orders its "
                             "writes explicitly (tf1/test_semantics.py)")
    return [None]


def _traced(family):
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer
    from support.graph_deps import Traced

    d = driver(family)
    model = d.pair_model()
    optimizer = AccumulatingOptimizer(d.make_inner(Inner("adam", 1e-3)), gradient_accumulation_steps=N)
    x, y = d.pair_data(3)
    step = d.R.make_train_step(model, optimizer, mode="graph")
    return Traced(step.get_concrete_function(tf.constant(x), tf.constant(y)).graph, model), optimizer


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_window_waits_for_no_gradient_and_no_write(family, case):
    traced, _ = _traced(family)
    assert len(traced.gradient_inputs) == len(traced.model.trainable_variables)
    assert traced.cond_waits_for() == ([], [])


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_every_write_in_the_branches_waits_for_a_gradient(family, case):
    """So a step whose input ends (``OutOfRange``) writes nothing: no
    phantom micro-step (``tests/keras3/test_hardening.py``)."""
    traced, _ = _traced(family)
    assert traced.unguarded_writes() == []


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_each_window_gradient_waits_for_its_own_gradient_and_the_guard(family, case):
    traced, optimizer = _traced(family)
    waits = traced.window_gradients_wait_for(optimizer.acc_grads)
    found = own_and_guard(waits)
    assert found is not None, waits
    assert sorted(found[1]) == sorted(traced.gradient_inputs)
