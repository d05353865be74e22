"""Strategies that cannot accumulate are refused, by every ``tf.distribute``
family, through the same check (``families._tf_backend.check_strategy``):
``CentralStorageStrategy`` shares one copy of each variable between the
replicas, so the accumulators cannot be replica-local (measured before the
refusal: exactly the update of twice the learning rate, with no error).
(``ParameterServerStrategy`` needs a cluster: keras3/test_multiworker.py for
Keras 3; the check is the same function for every family.)

Reference: the message names the strategy, why, and what to use instead.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from support.drivers import FAMILIES, Inner, NotApplicable, driver, params

MATCH = r"does not support CentralStorageStrategy.*replica-local.*MirroredStrategy"


def _cases(d):
    if d.family == "tf1":
        return NotApplicable("tf.compat.v1 optimizers run under no tf.distribute strategy here (graph code with "
                             "sessions; their distribution is the estimator's)")
    return [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _cases))
def test_central_storage_strategy_is_refused_at_construction_and_at_build(family, case):
    """Refused when the wrapper is created under the strategy, and when one
    created outside is built under it (``compile``, then the first step, or
    a custom loop's ``build``); the pass-through
    (N = 1) is the inner optimizer and is not refused."""
    from accum_optimizer import AccumulatingOptimizer

    d = driver(family)
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        with pytest.raises(ValueError, match=MATCH):
            AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=4)
        model = d.R.make_mlp(seed=0)
    opt = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=4)
    with strategy.scope():
        with pytest.raises(ValueError, match=MATCH):
            opt.build(model.trainable_variables)
        AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.1)), gradient_accumulation_steps=1)
