"""Every tensorflow-addons optimizer against the batch-N·B reference.

Same method as ``test_legacy_equivalence.py``: after every update, the
model's weights and every variable of the inner optimizer (slots, tfa's
Lookahead slow weights, MovingAverage/SWA averages, ``iterations``) equal the
plain inner optimizer's trained on batches of N·B. tfa's wrappers count
``iterations``: Lookahead syncs when ``(iterations + 1) % sync_period == 0``,
MovingAverage(dynamic_decay) and SWA average by ``iterations``, so a run that
counted micro-steps leaves another trajectory (checked to be outside the
tolerance below).
"""

from support.families import require

require("tfa")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import tensorflow_addons as tfa  # noqa: E402

from support import reference_keras2 as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.reference_keras2 import LEGACY_B as B, LEGACY_N as N, LEGACY_TOL as TOL, LEGACY_UPDATES as UPDATES, check_pair  # noqa: E402,E501

L = tf.keras.optimizers.legacy
T = tfa.optimizers


def _multi(model):
    # One optimizer per layer: Adam on the first, momentum SGD on the second.
    return T.MultiOptimizer([(L.Adam(0.05), model.layers[0]), (L.SGD(0.1, momentum=0.9), model.layers[1])])


TFA = {
    "AdamW": lambda m: T.AdamW(weight_decay=0.05, learning_rate=0.05),
    "SGDW": lambda m: T.SGDW(weight_decay=0.05, learning_rate=0.1, momentum=0.9),
    "LAMB": lambda m: T.LAMB(0.05, weight_decay=0.01),
    "LazyAdam": lambda m: T.LazyAdam(0.05),
    "NovoGrad": lambda m: T.NovoGrad(0.05, weight_decay=0.01),
    "Yogi": lambda m: T.Yogi(0.05),
    "AdaBelief": lambda m: T.AdaBelief(0.05),
    "ProximalAdagrad": lambda m: T.ProximalAdagrad(0.1, l1_regularization_strength=0.01,
                                                   l2_regularization_strength=0.01),
    "ConditionalGradient": lambda m: T.ConditionalGradient(0.1, lambda_=0.1),
    "COCOB": lambda m: T.COCOB(),
    "Lookahead": lambda m: T.Lookahead(L.Adam(0.05), sync_period=2, slow_step_size=0.5),
    "MovingAverage": lambda m: T.MovingAverage(L.SGD(0.1), average_decay=0.9, dynamic_decay=True),
    "SWA": lambda m: T.SWA(L.SGD(0.1), start_averaging=1, average_period=2),
    "MultiOptimizer": _multi,
    "CyclicalLearningRate": lambda m: L.SGD(T.CyclicalLearningRate(0.01, 0.3, step_size=1, scale_fn=lambda x: 1.0)),
    "AdamW(clipnorm)": lambda m: T.AdamW(weight_decay=0.05, learning_rate=0.05, clipnorm=0.05),
}


@pytest.mark.parametrize("name", list(TFA))
def test_equivalence_every_tfa_optimizer(name):
    ref, acc = R.run_pair(TFA[name], N, B, UPDATES)
    check_pair(ref, acc)


def test_equivalence_rectified_adam_both_branches_and_warmup():
    # RAdam's rectified branch starts once the SMA length exceeds 4 (update
    # 5 with beta_2=0.999), and its warmup counts iterations: 6 updates.
    make = lambda m: T.RectifiedAdam(0.05, total_steps=6, warmup_proportion=0.5, min_lr=0.01)  # noqa: E731
    ref, acc = R.run_pair(make, N, B, 6)
    check_pair(ref, acc, updates=6)


@pytest.mark.parametrize("name", ["Lookahead"])
def test_tfa_wrappers_count_updates_check_is_not_vacuous(name):
    # Counting micro-steps (sync/average at micro-step counts) changes the
    # trajectory by far more than the tolerance: the reference run with a
    # period N times shorter stands in for it.
    fast = {
        "Lookahead": lambda m: T.Lookahead(L.Adam(0.05), sync_period=1, slow_step_size=0.5),
        "SWA": lambda m: T.SWA(L.SGD(0.1), start_averaging=0, average_period=1),
    }[name]
    ref, _ = R.run_pair(TFA[name], N, B, UPDATES)
    wrong, _ = R.run_pair(fast, N, B, UPDATES)
    assert R.trajectory_diff(ref, wrong) > 100 * TOL


@pytest.mark.parametrize("outer", ["Lookahead", "MovingAverage", "SWA"])
def test_tfa_wrapper_around_accumulating_optimizer_is_refused_before_any_weight_moves(outer):
    model = R.dense_model()
    before = [w.numpy() for w in model.weights]
    acc = AccumulatingOptimizer(L.Adam(0.05), gradient_accumulation_steps=2)
    opt = {"Lookahead": T.Lookahead, "MovingAverage": T.MovingAverage, "SWA": T.SWA}[outer](acc)
    step = R.make_step(model, opt)
    x, y = R.dense_data(2)
    with pytest.raises(RuntimeError, match=r"AccumulatingOptimizer\(tfa.optimizers.Lookahead\(inner\)"):
        step(tf.constant(x), tf.constant(y))
    for b, w in zip(before, model.weights):
        np.testing.assert_array_equal(b, w.numpy())
    assert not acc._built  # not even the accumulators were made


def _two_branch():
    """A model of two towers whose second tower gets no gradient on some
    micro-steps (its output is dropped from the loss there)."""
    keras = tf.keras
    keras.utils.set_random_seed(0)
    inp = keras.Input((R.IN,))
    a = keras.layers.Dense(R.OUT, name="a")(inp)
    b = keras.layers.Dense(R.OUT, name="b")(inp)
    return keras.Model(inp, [a, b])


def test_no_gradient_in_a_window_means_no_weight_decay_no_slot_decay():
    # Window 1: both towers get gradients. Window 2: tower b gets none at
    # all. Large-batch reference: plain AdamW, whose apply_gradients drops
    # b's None gradients, so neither b's weights (no decoupled decay) nor
    # its moments move in update 2.
    x, y = R.dense_data(2 * N * B)
    runs = []
    for accumulate in (False, True):
        model = _two_branch()
        inner = T.AdamW(weight_decay=0.1, learning_rate=0.05)
        opt = AccumulatingOptimizer(inner, N) if accumulate else inner

        def step(xs, ys, use_b):
            with tf.GradientTape() as tape:
                pa, pb = model(xs)
                loss = R.mse(ys, pa) + (R.mse(ys, pb) if use_b else 0.0)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        steps = {True: tf.function(lambda xs, ys: step(xs, ys, True)),
                 False: tf.function(lambda xs, ys: step(xs, ys, False))}
        for u in range(2):
            xs, ys = x[u * N * B:(u + 1) * N * B], y[u * N * B:(u + 1) * N * B]
            chunks = [(xs[k * B:(k + 1) * B], ys[k * B:(k + 1) * B]) for k in range(N)] if accumulate else [(xs, ys)]
            for cx, cy in chunks:
                steps[u == 0](tf.constant(cx), tf.constant(cy))
            if u == 0:
                b_after_1 = [w.numpy() for w in model.get_layer("b").weights]
                slots_after_1 = [inner.get_slot(w, s).numpy() for w in model.get_layer("b").weights for s in ("m", "v")]
        b_layer = model.get_layer("b")
        for w0, w in zip(b_after_1, b_layer.weights):
            np.testing.assert_array_equal(w0, w.numpy())  # bitwise: no decay, no update
        for s0, s in zip(slots_after_1, [inner.get_slot(w, s).numpy() for w in b_layer.weights for s in ("m", "v")]):
            np.testing.assert_array_equal(s0, s)
        runs.append((model, inner))
    (ref_model, ref_inner), (acc_model, acc_inner) = runs
    assert R.max_diff(ref_model.get_weights(), acc_model.get_weights()) <= TOL
    assert R.max_diff([w.numpy() for w in ref_inner.weights], [w.numpy() for w in acc_inner.weights]) <= TOL
    # Tower a did move in update 2 (the check above is about b only).
    assert R.max_diff(ref_model.get_layer("a").get_weights(), [w.numpy() for w in _two_branch().get_layer("a").weights]) > 1e-3
