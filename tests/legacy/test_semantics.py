"""Semantics of the legacy ``OptimizerV2`` wrapper, each against an
independent reference (the batch-N·B run of the plain inner optimizer, the
state before a micro-step, or the plain optimizer itself)."""

from support.families import require

require("legacy")

import copy  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference as R  # noqa: E402
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
    assert R.max_abs_diff(ref_model.get_weights(), acc_model.get_weights()) <= TOL
    assert int(acc_inner.iterations.numpy()) == epochs * updates


def test_hyperparameters_and_clip_settings_are_read_and_assigned_through_the_wrapper():
    """Issue 22, item 5: what user code and Keras 2's own tests read and
    assign on the optimizer they compiled with reaches the inner optimizer
    (the wrapper had no ``beta_1``/``epsilon``, and its own unused clip
    defaults). Reference: the inner optimizer's values; then training with
    the settings assigned through the wrapper against the plain optimizer
    given them directly (N = 1: bitwise; N = 3: the batch-N·B run, whose
    clipping by norm is active: without it the weights differ)."""
    inner = L.Adam(0.05, beta_1=0.8, epsilon=1e-3, amsgrad=True, clipnorm=0.5)
    opt = AccumulatingOptimizer(inner, N)
    assert float(keras.backend.get_value(opt.beta_1)) == pytest.approx(0.8)
    assert float(keras.backend.get_value(opt._get_hyper("beta_1"))) == pytest.approx(0.8)
    assert (opt.epsilon, opt.amsgrad, opt.clipnorm, opt.clipvalue, opt.global_clipnorm) == (1e-3, True, 0.5, None, None)
    with pytest.raises(AttributeError, match="no_such_setting"):
        opt.no_such_setting
    assert not hasattr(opt, "momentum")  # (Adam has none)

    def configure(o):
        o.beta_1 = 0.7
        o._set_hyper("beta_2", 0.9)
        o.epsilon = 1e-4
        o.clipnorm = 0.05

    configure(opt)
    assert float(keras.backend.get_value(inner._get_hyper("beta_1"))) == pytest.approx(0.7)
    assert float(keras.backend.get_value(inner._get_hyper("beta_2"))) == pytest.approx(0.9)
    assert (inner.epsilon, inner.clipnorm) == (1e-4, 0.05)
    assert not {"beta_1", "epsilon", "clipnorm"} & set(vars(opt))  # nothing shadowed on the wrapper

    updates = 2
    x, y = R.dense_data(N * B * updates)
    for n in (1, N):
        ref_inner, acc_inner = L.Adam(0.05, amsgrad=True), L.Adam(0.05, amsgrad=True)
        configure(ref_inner)
        acc = AccumulatingOptimizer(acc_inner, n)
        configure(acc)
        ref = R.train(R.dense_model(), ref_inner, x, y, n * B, updates)
        trained = R.train(R.dense_model(), acc, x, y, B, n * updates)
        diff = R.max_abs_diff(ref.get_weights(), trained.get_weights())
        if n == 1:
            assert diff == 0.0
        else:
            unclipped = L.Adam(0.05, amsgrad=True)
            configure(unclipped)
            unclipped.clipnorm = None
            free = R.train(R.dense_model(), unclipped, x, y, n * B, updates)
            assert diff <= TOL < R.max_abs_diff(ref.get_weights(), free.get_weights())


def test_inner_slots_reachable():
    ref, acc = R.run_pair(lambda m: L.Adam(0.05), N, B, 2)
    inner = acc["opt"].inner_optimizer
    assert inner.get_slot_names() == ref["inner"].get_slot_names() == ["m", "v"]
    for v_ref, v_acc in zip(ref["model"].trainable_variables, acc["model"].trainable_variables):
        for s in ("m", "v"):
            assert R.max_abs_diff([ref["inner"].get_slot(v_ref, s).numpy()], [inner.get_slot(v_acc, s).numpy()]) <= TOL
    # Read through the wrapper too (issue 17, bug 4; saved once: tests/legacy/test_saving.py).
    assert acc["opt"].get_slot_names() == ["m", "v"]
    assert all(acc["opt"].get_slot(v, s) is inner.get_slot(v, s)
               for v in acc["model"].trainable_variables for s in ("m", "v"))


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
    assert not opt.built
    opt.apply_gradients([(tf.zeros_like(w), w) for w in v])
    with pytest.raises(ValueError, match="Unknown variable"):
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


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built_mid_window"])
def test_a_deep_copy_trains_like_the_original(built):
    """``copy.deepcopy`` of the wrapper works as the plain ``OptimizerV2``'s
    does (it raised: the strategy it keeps cannot be copied): the copy holds
    copies of the accumulators, counters and inner slots and trains the same
    model variables. Reference: plain Adam on the large batch (N·B) over the
    same samples, reached by the copy from the point of copying (mid-window
    when built: the partial window is copied), and by the original resumed
    from that point after the copy trained (the copy shares no state with it)."""
    updates = 2
    micro_steps = N * updates
    x, y = R.dense_data(B * micro_steps)
    reference = R.train(R.dense_model(), L.Adam(0.05), x, y, N * B, updates)

    model = R.dense_model()
    original = AccumulatingOptimizer(L.Adam(0.05), N)

    def run(optimizer, first, last):
        step = R.make_train_step(model, optimizer)
        for s in range(first, last):
            step(tf.constant(x[s * B:(s + 1) * B]), tf.constant(y[s * B:(s + 1) * B]))

    copied_at = N + 1 if built else 0
    run(original, 0, copied_at)
    weights_at_copy = model.get_weights()
    copied = copy.deepcopy(original)
    assert type(copied) is type(original) and copied.inner_optimizer is not original.inner_optimizer
    assert copied.built == built

    run(copied, copied_at, micro_steps)
    assert R.max_abs_diff(reference.get_weights(), model.get_weights()) <= TOL
    assert int(copied.iterations.numpy()) == updates

    model.set_weights(weights_at_copy)
    run(original, copied_at, micro_steps)
    assert R.max_abs_diff(reference.get_weights(), model.get_weights()) <= TOL
    assert int(original.iterations.numpy()) == updates


class _WithMethods(L.SGD):
    """A legacy optimizer with public methods of its own, one named like an
    update entry point of another Keras API."""

    def scaled_learning_rate(self, factor):
        return float(self.learning_rate.numpy()) * factor

    def apply(self, grads, trainable_variables):  # Keras 3's name: would update at once
        return self.apply_gradients(zip(grads, trainable_variables))

    def _private_helper(self):
        return "private"


def test_public_methods_of_the_inner_are_reached_but_never_an_update():
    """A public method of the inner optimizer that the wrapper does not have
    is called through it (as on the optimizer compiled with); a private one
    is not; ``apply_gradients``/``minimize`` stay the wrapper's (a
    micro-step moves nothing: reference, the weights before it), and an
    inner method named like an update entry point (``apply``) is refused
    with the reason, before anything moves."""
    inner = _WithMethods(0.5)
    opt = AccumulatingOptimizer(inner, N)
    assert opt.scaled_learning_rate(4.0) == 2.0
    with pytest.raises(AttributeError, match="_private_helper"):
        opt._private_helper()
    model = R.dense_model()
    before = model.get_weights()
    with pytest.raises(AttributeError, match="bypassing the accumulation"):
        opt.apply([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables)
    opt.apply_gradients(zip([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables))
    assert R.max_abs_diff(before, model.get_weights()) == 0.0
    assert int(opt.micro_steps.numpy()) == 1 and int(inner.iterations.numpy()) == 0
