"""Semantics of the legacy ``OptimizerV2`` wrapper, each against an
independent reference (the batch-N·B run of the plain inner optimizer, the
state before a micro-step, or the plain optimizer itself)."""

from support.families import require

require("legacy")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference_keras2 as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from accum_optimizer.families import legacy  # noqa: E402

keras = tf.keras
L = keras.optimizers.legacy
N, B = 3, 2
TOL = 1e-5


def _everything(opt, model):
    """Every variable the update could touch: weights, every inner variable
    (iterations, slots), the inner hyperparameter variables."""
    inner = opt.inner_optimizer
    hypers = [v for v in inner._hyper.values() if isinstance(v, tf.Variable)]
    return [v.numpy().copy() for v in list(model.weights) + list(inner.weights) + hypers]


@pytest.mark.parametrize("eager", [False, True])
def test_nothing_moves_between_updates_bitwise(eager):
    model = R.dense_model()
    opt = AccumulatingOptimizer(L.RMSprop(0.01, momentum=0.5, centered=True), N)
    step = R.make_step(model, opt, eager=eager)
    x, y = R.dense_data(2 * N * B)
    for m in range(2 * N):
        before = _everything(opt, model) if opt._built else None
        step(tf.constant(x[m * B:(m + 1) * B]), tf.constant(y[m * B:(m + 1) * B]))
        after = _everything(opt, model)
        assert int(opt.micro_steps.numpy()) == m + 1
        assert int(opt.iterations.numpy()) == (m + 1) // N
        if before is not None and (m + 1) % N:
            for b, a in zip(before, after):
                np.testing.assert_array_equal(b, a)
        if (m + 1) % N == 0:  # an update moved the weights
            assert R.max_diff(before[:4], after[:4]) > 0


def test_learning_rate_and_lr_forwarded_getter_and_setter():
    inner = L.Adam(0.05)
    opt = AccumulatingOptimizer(inner, N)
    assert opt.learning_rate is inner.learning_rate and opt.lr is inner.lr
    opt.learning_rate = 0.25
    assert float(inner.learning_rate.numpy()) == 0.25
    opt.lr = 0.125
    assert float(inner.lr.numpy()) == 0.125
    keras.backend.set_value(opt.lr, 0.5)  # what Keras 2's callbacks do
    assert float(keras.backend.get_value(inner.learning_rate)) == 0.5


@pytest.mark.parametrize("callback", ["LearningRateScheduler", "ReduceLROnPlateau"])
def test_fit_lr_callbacks_act_on_the_inner_optimizer(callback):
    # Reference: plain Adam at batch N*B with the same callback. The
    # callbacks read and write `optimizer.lr` once per epoch.
    epochs, updates = 3, 2
    x, y = R.dense_data(N * B * updates)

    def cb():
        if callback == "LearningRateScheduler":
            return keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
        return keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)

    runs = []
    for accumulate in (False, True):
        model = R.dense_model()
        inner = L.Adam(0.05)
        model.compile(AccumulatingOptimizer(inner, N) if accumulate else inner, loss="mse")
        model.fit(x, y, batch_size=B if accumulate else N * B, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[cb()])
        runs.append((model, inner))
    (ref_model, ref_inner), (acc_model, acc_inner) = runs
    lr = float(acc_inner.learning_rate.numpy())
    assert lr == float(ref_inner.learning_rate.numpy()) < 0.05
    assert R.max_diff(ref_model.get_weights(), acc_model.get_weights()) <= TOL
    assert int(acc_inner.iterations.numpy()) == epochs * updates


def _two_vars():
    keras.utils.set_random_seed(0)
    return tf.Variable(tf.random.normal((R.IN, R.OUT))), tf.Variable(tf.random.normal((R.IN, R.OUT)), constraint=lambda w: tf.clip_by_value(w, -0.6, 0.6))


def _losses(w1, w2, x, y, use_w2):
    loss = R.mse(y, x @ w1)
    return loss + R.mse(y, tf.tanh(x @ w2)) if use_w2 else loss


@pytest.mark.parametrize("eager", [False, True])
def test_missing_gradients(eager):
    """Window 1: w2 gets gradients on micro-steps 1 and 2 but None on the last
    one (its window sum must be kept). Window 2: w2 gets no gradient at all
    (not updated: weight, Adam moments and its constraint all untouched).

    Reference: the large-batch loss of each window is the mean of the
    micro-batch losses, (1/N) sum_k loss_k, with w2's term only in the
    micro-batches that use it, trained with the plain inner optimizer, which
    drops w2's None gradient in window 2."""
    use = [[True, True, False], [False, False, False]]
    x, y = R.dense_data(2 * N * B)
    xs = [tf.constant(x[i * B:(i + 1) * B]) for i in range(2 * N)]
    ys = [tf.constant(y[i * B:(i + 1) * B]) for i in range(2 * N)]
    results = []
    for accumulate in (False, True):
        w1, w2 = _two_vars()
        inner = L.Adam(0.05)
        opt = AccumulatingOptimizer(inner, N) if accumulate else inner

        def step(xb, yb, flags):
            with tf.GradientTape() as tape:
                if accumulate:
                    loss = _losses(w1, w2, xb[0], yb[0], flags[0])
                else:
                    loss = tf.add_n([_losses(w1, w2, a, b, f) for a, b, f in zip(xb, yb, flags)]) / N
            grads = tape.gradient(loss, [w1, w2])
            opt.apply_gradients(zip(grads, [w1, w2]))

        run = step if eager else tf.function(step)
        snapshots = []
        for u in range(2):
            window = range(u * N, (u + 1) * N)
            if accumulate:
                for k, i in enumerate(window):
                    run([xs[i]], [ys[i]], [use[u][k]])
            else:
                run([xs[i] for i in window], [ys[i] for i in window], use[u])
            snapshots.append([w1.numpy(), w2.numpy(), inner.get_slot(w2, "m").numpy(), inner.get_slot(w2, "v").numpy()])
        results.append(snapshots)
    ref, acc = results
    for r, a in zip(ref, acc):
        assert R.max_diff(r, a) <= TOL
    # Window 1 moved w2 (its gradients from micro-steps 1-2 were applied);
    # window 2 left w2 and its moments bitwise as they were.
    w2_init = _two_vars()[1].numpy()
    assert R.max_diff([acc[0][1]], [w2_init]) > 1e-3
    for k in (1, 2, 3):
        np.testing.assert_array_equal(acc[0][k], acc[1][k])


def test_pass_through_n1_is_the_inner_optimizer_bitwise():
    x, y = R.dense_data(4 * B)
    runs = []
    for wrap in (False, True):
        model = R.dense_model()
        inner = L.Adam(0.05)
        opt = AccumulatingOptimizer(inner, 1) if wrap else inner
        step = R.make_step(model, opt)
        for i in range(4):
            step(tf.constant(x[i * B:(i + 1) * B]), tf.constant(y[i * B:(i + 1) * B]))
        runs.append((model, inner, opt))
    (rm, ri, _), (am, ai, ao) = runs
    for a, b in zip(rm.weights + ri.weights, am.weights + ai.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(ao.micro_steps.numpy()) == 4 == int(ao.iterations.numpy())
    assert ao.acc_grads == [] and len(ao.weights) == len(ai.weights) + 1  # micro_steps only


def test_inner_slots_reachable():
    ref, acc = R.run_pair(lambda m: L.Adam(0.05), N, B, 2)
    inner = acc["opt"].inner_optimizer
    assert inner.get_slot_names() == ref["inner"].get_slot_names() == ["m", "v"]
    for v_ref, v_acc in zip(ref["model"].trainable_variables, acc["model"].trainable_variables):
        for s in ("m", "v"):
            assert R.max_diff([ref["inner"].get_slot(v_ref, s).numpy()], [inner.get_slot(v_acc, s).numpy()]) <= TOL
    assert acc["opt"].get_slot_names() == []  # none forwarded: each slot is saved once


def test_config_round_trip_and_registration():
    opt = AccumulatingOptimizer(L.Adam(0.05, clipnorm=1.0), 4, reduction="sum", name="acc")
    config = opt.get_config()
    again = type(opt).from_config(config)
    assert again.get_config() == config
    via_top = AccumulatingOptimizer.from_config(config)
    assert type(via_top) is type(opt) and via_top.get_config() == config
    ser = keras.optimizers.serialize(opt)
    assert keras.optimizers.deserialize(ser).get_config() == config
    assert keras.utils.get_registered_name(type(opt)) == "accum_optimizer>LegacyAccumulatingOptimizer"


def test_dispatch_returns_the_legacy_wrapper():
    opt = AccumulatingOptimizer(L.SGD(0.1), 2)
    assert type(opt) is legacy.AccumulatingOptimizer
    assert isinstance(opt, AccumulatingOptimizer) and isinstance(opt, L.Optimizer)
    assert legacy.AccumulatingOptimizer._keras.__name__ == keras.optimizers.Optimizer.__module__.split(".")[0]


def test_validation_errors_name_argument_value_and_what_is_accepted():
    cls = legacy.AccumulatingOptimizer
    with pytest.raises(TypeError, match=r"gradient_accumulation_steps=2.0 of type float"):
        cls(L.SGD(), 2.0)
    with pytest.raises(TypeError, match=r"gradient_accumulation_steps=True"):
        cls(L.SGD(), True)
    with pytest.raises(ValueError, match=r"int >= 1.*gradient_accumulation_steps=0"):
        cls(L.SGD(), 0)
    with pytest.raises(ValueError, match=r"`reduction` must be one of \('mean', 'sum'\).*reduction='avg'"):
        cls(L.SGD(), 2, reduction="avg")
    with pytest.raises(TypeError, match=r"Keras 2 legacy optimizer.*inner_optimizer=.*of type builtins.object"):
        cls(object(), 2)
    with pytest.raises(TypeError, match=r"of type .*optimizers\.(adam|optimizer).*Adam"):
        cls(keras.optimizers.Adam(), 2)  # the Keras 2 new API is another family
    with pytest.raises(ValueError, match=r"already an AccumulatingOptimizer \(gradient_accumulation_steps=2\)"):
        cls(cls(L.SGD(), 2), 3)
    with pytest.raises(ValueError, match=r"does not take `clipnorm` \(received clipnorm=1.0\)"):
        cls(L.SGD(), 2, clipnorm=1.0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): steps=2.*Did you mean `steps` -> `gradient_accumulation_steps`"):
        cls(L.SGD(), steps=2)
    with pytest.raises(TypeError, match=r"missing the required argument `gradient_accumulation_steps`"):
        cls(L.SGD())
    with pytest.raises(ValueError, match=r"must not be a LossScaleOptimizer"):
        cls(keras.mixed_precision.LossScaleOptimizer(L.SGD()), 2)
    with pytest.raises(TypeError, match=r"supported family.*Keras 2 legacy OptimizerV2.*of type builtins.object"):
        AccumulatingOptimizer(object(), 2)
    # Defaults of base-optimizer arguments are accepted (generic configs).
    cls(L.SGD(), 2, clipnorm=None, decay=0.0)


def test_gradient_errors_before_any_state_changes():
    model = R.dense_model()
    opt = AccumulatingOptimizer(L.SGD(0.1), N)
    v = model.trainable_variables
    with pytest.raises(ValueError, match=r"Gradient shape \(2, 2\) does not match the shape \(5, 4\)"):
        opt.apply_gradients([(tf.zeros((2, 2)), v[0])])
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        opt.apply_gradients([(None, w) for w in v])
    assert not opt._built
    opt.apply_gradients([(tf.zeros_like(w), w) for w in v])
    with pytest.raises(ValueError, match="were not among the variables of the first"):
        opt.apply_gradients([(tf.zeros(()), tf.Variable(0.0))])
    assert int(opt.micro_steps.numpy()) == 1


def test_import_loads_no_keras3_and_registers_the_legacy_wrapper():
    code = (
        "import sys, tensorflow as tf, accum_optimizer\n"
        "k = sys.modules.get('keras')\n"
        "assert k is None or k.__version__.startswith('2.'), k.__version__\n"
        "assert 'accum_optimizer.families.legacy' in sys.modules\n"
        "assert 'accum_optimizer.families.keras3' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
