"""Keras 2 new API: dispatch, identifiers, argument validation, import hygiene.

References: the plain inner optimizer (for identifiers), the same messages as
the Keras 3 wrapper (shared validators; tests/core/test_arguments.py), and the state
before a rejected call (bitwise).
"""

from support.families import require

require("keras2")

import importlib  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from accum_optimizer.families import keras2 as keras2_family  # noqa: E402
from support.reference import make_data, make_mlp, max_abs_diff, train, weights  # noqa: E402

keras = tf.keras
o = keras.optimizers
PACKAGE = sys.modules[o.Optimizer.__module__.split(".")[0]]  # tf_keras, or keras 2.15


def _all_of(*parts):
    return "".join(f"(?=.*{re.escape(p)})" for p in parts)


# ------------------------------------------------------------- dispatch
def test_dispatcher_returns_the_keras2_wrapper_of_the_active_tf_keras():
    opt = AccumulatingOptimizer(o.Adam(1e-3), 4)
    assert type(opt) is keras2_family.AccumulatingOptimizer
    assert isinstance(opt, o.Optimizer)  # what Keras 2's compile accepts
    assert isinstance(opt, AccumulatingOptimizer)
    assert PACKAGE.optimizers.Optimizer in type(opt).__mro__  # this package's base class
    assert PACKAGE.saving.get_registered_object("accum_optimizer>AccumulatingOptimizer") is type(opt)


def test_string_identifier_resolves_to_the_keras2_new_api():
    # What `tf.keras.optimizers.get("adam")` returns here is the new API (not
    # tf.keras.optimizers.legacy), and that is what the wrapper holds.
    plain = o.get("adam")
    assert isinstance(plain, o.Optimizer) and not isinstance(plain, o.legacy.Optimizer)
    opt = AccumulatingOptimizer("adam", 4)
    assert type(opt) is keras2_family.AccumulatingOptimizer
    assert type(opt.inner_optimizer) is type(plain) is o.Adam
    assert opt.inner_optimizer.get_config() == plain.get_config()


@pytest.mark.parametrize("identifier", ["adam", "serialized_lion"])
def test_identifier_trains_like_the_instance(identifier):
    n, b, windows = 2, 4, 3
    make = (lambda: o.Adam()) if identifier == "adam" else (lambda: o.Lion(1e-3))
    ident = "adam" if identifier == "adam" else o.serialize(make())
    x, y = make_data(n * b * windows)
    by_id = train(make_mlp(0), AccumulatingOptimizer(ident, n), x, y, b, n * windows, mode="eager")
    ref = train(make_mlp(0), make(), x, y, n * b, windows, mode="eager")
    assert max_abs_diff(weights(by_id), weights(make_mlp(0))) > 1e-4  # it trained
    assert max_abs_diff(weights(by_id), weights(ref)) <= 1e-6


class NotAnOptimizer:
    pass


def test_unsupported_family_gets_the_dispatchers_type_error():
    with pytest.raises(TypeError, match=_all_of("inner_optimizer", "NotAnOptimizer", "Keras 2 (tf_keras")):
        AccumulatingOptimizer(NotAnOptimizer(), 4)


@pytest.mark.parametrize(
    "make_inner, exc, received",
    [
        (lambda: object(), TypeError, "object"),
        (lambda: o.legacy.Adam(), TypeError, "legacy"),
        (lambda: keras.layers.Dense(2), TypeError, "Dense"),
        (lambda: "nonsense", ValueError, "'nonsense'"),
        (lambda: o.Adam, TypeError, "Adam"),  # the class, not an instance
    ],
    ids=["object", "legacy", "layer", "unknown-string", "class"],
)
def test_family_class_rejects_what_is_not_a_keras2_new_api_optimizer(make_inner, exc, received):
    with pytest.raises(exc, match=_all_of("inner_optimizer", "inner_optimizer=", received, f"{PACKAGE.__name__}.optimizers")):
        keras2_family.AccumulatingOptimizer(make_inner(), 2)


def test_loss_scale_and_nested_accumulation_inside_are_rejected():
    lso = keras.mixed_precision.LossScaleOptimizer(o.Adam())
    with pytest.raises(ValueError, match=_all_of("LossScaleOptimizer", "outside")):
        AccumulatingOptimizer(lso, 2)
    nested = AccumulatingOptimizer(o.Adam(), 3)
    with pytest.raises(ValueError, match=_all_of("inner_optimizer", "AccumulatingOptimizer", "gradient_accumulation_steps=3")):
        AccumulatingOptimizer(nested, 2)


# ------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "value, exc",
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (4.0, TypeError), (True, TypeError), ("4", TypeError), (None, TypeError)],
    ids=["zero", "negative", "float", "integral-float", "bool", "str", "none"],
)
def test_gradient_accumulation_steps_validation(value, exc):
    with pytest.raises(exc, match=_all_of("gradient_accumulation_steps", f"gradient_accumulation_steps={value!r}", "int")):
        AccumulatingOptimizer(o.SGD(), gradient_accumulation_steps=value)


def test_gradient_accumulation_steps_accepts_numpy_int():
    opt = AccumulatingOptimizer(o.SGD(), gradient_accumulation_steps=np.int64(3))
    assert opt.gradient_accumulation_steps == 3 and type(opt.gradient_accumulation_steps) is int


@pytest.mark.parametrize("value", ["avg", "MEAN", None, 1])
def test_reduction_validation(value):
    with pytest.raises(ValueError, match=_all_of("reduction", f"reduction={value!r}", "'mean'", "'sum'")):
        AccumulatingOptimizer(o.SGD(), gradient_accumulation_steps=2, reduction=value)


def test_unknown_kwargs_are_rejected_naming_the_argument_and_value():
    with pytest.raises(TypeError, match=_all_of("bogus_option", "12345", "gradient_accumulation_steps", "reduction")):
        AccumulatingOptimizer(o.SGD(), 2, bogus_option=12345)


def test_missing_required_arguments_are_named():
    with pytest.raises(TypeError, match=_all_of("missing the required argument", "`gradient_accumulation_steps`")):
        AccumulatingOptimizer(o.SGD())
    with pytest.raises(TypeError, match=_all_of("missing the required argument", "`inner_optimizer`")):
        keras2_family.AccumulatingOptimizer(gradient_accumulation_steps=2)


def test_numerics_arguments_of_the_keras3_family_are_kept():
    """``nonfinite`` and ``accumulator_dtype`` are the Keras 3 family's
    (their behaviour: tests/contract/test_nonfinite.py)."""
    opt = AccumulatingOptimizer(o.SGD(), 2, nonfinite="skip_window", accumulator_dtype="float64")
    assert type(opt) is keras2_family.AccumulatingOptimizer
    assert (opt.nonfinite, opt.accumulator_dtype) == ("skip_window", "float64")
    with pytest.raises(ValueError, match=_all_of("`nonfinite` must be one of", "nonfinite='skip'")):
        AccumulatingOptimizer(o.SGD(), 2, nonfinite="skip")


def _one_good_micro_step():
    model = make_mlp(0)
    vs = model.trainable_variables
    opt = AccumulatingOptimizer(o.Adam(0.01), gradient_accumulation_steps=3)
    opt.apply_gradients(zip([tf.ones_like(v) for v in vs], vs))
    return vs, opt


def _state(opt, vs):
    return [np.array(v.numpy()) for v in list(opt.variables) + list(vs)]


def _assert_unchanged(before, after):
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_bad_apply_gradients_calls_raise_and_leave_state_untouched(strategy):
    vs, opt = _one_good_micro_step()
    before = _state(opt, vs)
    bad = [tf.ones_like(v) for v in vs]
    bad[2] = tf.ones((3, 3))
    for call in (lambda gs: opt.apply_gradients(zip(gs, vs)), tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)))):
        with pytest.raises(ValueError, match=_all_of("(3, 3)", "(5, 3)", vs[2].name, "shape")):
            call(bad)
    with pytest.raises(ValueError, match=_all_of("No gradients", vs[0].name, vs[3].name)):
        opt.apply_gradients(zip([None] * len(vs), vs))
    stranger = tf.Variable(tf.ones((2,)), name="stranger")
    with pytest.raises(ValueError, match=_all_of("Unknown variable", "stranger")):
        opt.apply_gradients([(tf.ones((2,)), stranger)])
    with strategy.scope():
        with pytest.raises(ValueError, match=_all_of("replica context", "cross-replica")):
            opt.apply_gradients(zip([tf.ones_like(v) for v in vs], vs))
    with pytest.raises(TypeError, match="bogus"):
        opt.apply_gradients(zip([tf.ones_like(v) for v in vs], vs), bogus=1)
    _assert_unchanged(before, _state(opt, vs))
    # The window still completes: two more good micro-steps make one update.
    for _ in range(2):
        opt.apply_gradients(zip([tf.ones_like(v) for v in vs], vs))
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (3, 1)


def test_variables_are_the_wrappers_then_every_inner_variable():
    model = make_mlp(0)
    opt = AccumulatingOptimizer(o.Nadam(1e-2, use_ema=True), 2)
    opt.build(model.trainable_variables)
    inner = opt.inner_optimizer
    own = [opt.micro_steps, opt.grad_received, *opt.acc_grads]
    window = [opt.mini_step, opt.window_weight]  # last: state saved without them is a prefix
    assert [id(v) for v in opt.variables] == [id(v) for v in own + list(inner.variables) + window]
    assert [id(v) for v in opt.variables()] == [id(v) for v in opt.variables]  # Keras 2's CallableList
    assert opt.iterations is inner.iterations
    assert all(a.dtype == v.dtype and a.shape == v.shape for a, v in zip(opt.acc_grads, model.trainable_variables))


def test_settings_of_the_inner_optimizer_are_read_and_assigned_through_the_wrapper():
    """Issue 22, item 5 (the Keras 2 new API had the legacy family's fault):
    the inner optimizer's hyperparameters, clip, EMA and weight decay
    settings read through the wrapper, and assignments reaching it.
    Reference: the inner's values; then N = 2 trained with ``clipnorm`` set
    through the wrapper against the plain optimizer given it, at batch 2·B
    (the clipping is active: without it the weights differ)."""
    inner = o.Adam(1e-2, beta_1=0.8, epsilon=1e-3, amsgrad=True, clipnorm=0.5, use_ema=True, ema_momentum=0.9)
    opt = AccumulatingOptimizer(inner, 2)
    read = (opt.beta_1, opt.epsilon, opt.amsgrad, opt.clipnorm, opt.clipvalue, opt.global_clipnorm,
            opt.use_ema, opt.ema_momentum, opt.weight_decay)
    assert read == (0.8, 1e-3, True, 0.5, None, None, True, 0.9, inner.weight_decay)
    opt.beta_1, opt.clipnorm = 0.7, 0.01
    assert (inner.beta_1, inner.clipnorm) == (0.7, 0.01) and not {"beta_1", "clipnorm"} & set(vars(opt))

    x, y = make_data(2 * 4 * 3)
    ref = train(make_mlp(0), o.Adam(1e-2, beta_1=0.7, clipnorm=0.01), x, y, 8, 3)
    acc_opt = AccumulatingOptimizer(o.Adam(1e-2, beta_1=0.7), 2)
    acc_opt.clipnorm = 0.01
    acc = train(make_mlp(0), acc_opt, x, y, 4, 6)
    free = train(make_mlp(0), o.Adam(1e-2, beta_1=0.7), x, y, 8, 3)
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-5 < max_abs_diff(weights(ref), weights(free))


# --------------------------------------------------------- import hygiene
# (What `import accum_optimizer` imports and registers in a fresh process is
# checked in test_keras2_saving, in the process that loads the saved models.)
def _python(code, drop_legacy_env=False):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if drop_legacy_env:
        env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(PACKAGE.__name__ != "tf_keras", reason="needs tf_keras (the tfkeras leg)")
def test_tf_keras_optimizer_is_wrapped_when_tf_keras_is_not_the_active_tf_keras():
    # TF 2.21 without TF_USE_LEGACY_KERAS: tf.keras is Keras 3, yet code that
    # imports tf_keras directly (as transformers does) gets the Keras 2
    # wrapper of tf_keras.
    code = (
        "import tf_keras, accum_optimizer\n"
        "from accum_optimizer import AccumulatingOptimizer\n"
        "opt = AccumulatingOptimizer(tf_keras.optimizers.Adam(), 2)\n"
        "import tensorflow as tf\n"
        "print(type(opt).__module__, isinstance(opt, tf_keras.optimizers.Optimizer),"
        " tf.keras.optimizers.Optimizer.__module__.split('.')[0])\n"
    )
    assert _python(code, drop_legacy_env=True) == "accum_optimizer.families.keras2 True keras"


# ------------------------------------------------- two Keras 2 packages
# Keras 2 is `tf_keras` or TF <= 2.15's `keras`; both can be imported in one
# process, and each family makes one wrapper class per package (issue 17,
# bug 7). `isinstance(w, accum_optimizer.AccumulatingOptimizer)` must hold
# for every one of them, not only for the active package's.
FAMILY_BASES = {
    "keras2": lambda package: package.optimizers.Optimizer,
    "legacy": lambda package: package.optimizers.legacy.Optimizer,
}


def _family_module(family):
    return importlib.import_module(f"accum_optimizer.families.{family}")


def _other_keras2_package():
    """A Keras 2 package importable beside the active one (tf_keras 2.15
    beside TF 2.15's keras), or skip: no leg of `make test` installs two."""
    other = {"keras": "tf_keras", "tf_keras": "keras"}[PACKAGE.__name__]
    try:
        module = importlib.import_module(other)
    except ImportError:
        module = None
    if module is None or not str(module.__version__).startswith("2."):
        pytest.skip(f"needs a second Keras 2 package beside {PACKAGE.__name__} {PACKAGE.__version__} "
                    f"(e.g. pip install 'tf_keras==2.15.*' in the tf215 leg)")
    return module


@pytest.mark.parametrize("family", ["keras2", "legacy"])
def test_every_keras2_packages_wrapper_is_an_accumulating_optimizer(family):
    other = _other_keras2_package()
    inner = other.optimizers.legacy.Adam() if family == "legacy" else other.optimizers.Adam()
    module = _family_module(family)
    opt = AccumulatingOptimizer(inner, 2)
    assert type(opt) is module.wrapper_class(other) and type(opt) is not module.AccumulatingOptimizer
    assert isinstance(opt, FAMILY_BASES[family](other))  # what that package's compile accepts
    assert isinstance(opt, AccumulatingOptimizer)
    assert issubclass(type(opt), AccumulatingOptimizer)
    primary = AccumulatingOptimizer(PACKAGE.optimizers.legacy.SGD() if family == "legacy" else PACKAGE.optimizers.SGD(), 2)
    assert type(primary) is module.AccumulatingOptimizer and isinstance(primary, AccumulatingOptimizer)


@pytest.mark.parametrize("family", ["keras2", "legacy"])
def test_a_wrapper_class_made_for_another_keras2_package_is_an_accumulating_optimizer(family):
    """What the test above checks, where one Keras 2 package imports (every
    leg): the family's class for a stand-in package (its own subclass of this
    package's optimizer base; a registry of its own) is a subclass of the
    facade, and an instance of it an instance."""
    base = FAMILY_BASES[family](PACKAGE)
    own_base = type("StandInOptimizer", (base,), {})
    registered = []
    stand_in = types.SimpleNamespace(
        __name__=f"stand_in_keras2_{family}",
        optimizers=types.SimpleNamespace(Optimizer=own_base, legacy=types.SimpleNamespace(Optimizer=own_base)),
        utils=types.SimpleNamespace(register_keras_serializable=lambda **kw: lambda c: registered.append(c) or c),
    )
    module = _family_module(family)
    cls = module.wrapper_class(stand_in)
    assert registered == [cls] and cls is not module.AccumulatingOptimizer and issubclass(cls, own_base)
    assert issubclass(cls, AccumulatingOptimizer)
    assert isinstance(cls.__new__(cls), AccumulatingOptimizer)  # (no inner: the class' own instance, not built)
    assert not isinstance(own_base.__new__(own_base), AccumulatingOptimizer)


# ------------------------------------------- a wrapper in another Keras
def test_a_wrapper_compiled_into_another_keras_model_names_its_family():
    """Keras' "Could not interpret optimizer identifier: ..." prints the
    wrapper: it names the family and the Keras whose models it trains, both
    ways (Keras 3 wrapper into a Keras 2 model, Keras 2 wrapper into a Keras 3
    model). Needs Keras 3 beside the Keras 2 package (tf_keras on TF 2.21)."""
    keras3 = pytest.importorskip("keras")
    if not keras3.__version__.startswith("3."):
        pytest.skip(f"`keras` is Keras {keras3.__version__} here: no Keras 3 beside {PACKAGE.__name__}")
    model2 = keras.Sequential([keras.layers.Dense(1, input_shape=(2,))])
    with pytest.raises(ValueError, match=_all_of(
            "Could not interpret optimizer identifier", "Keras 3 family", f"keras {keras3.__version__} models")):
        model2.compile(AccumulatingOptimizer(keras3.optimizers.Adam(), 2), "mse")
    model3 = keras3.Sequential([keras3.Input((2,)), keras3.layers.Dense(1)])
    with pytest.raises(ValueError, match=_all_of(
            "Could not interpret optimizer identifier", "Keras 2 new API family",
            f"{PACKAGE.__name__} {PACKAGE.__version__} models")):
        model3.compile(AccumulatingOptimizer(o.Adam(), 2), "mse")


# ------------------------------------------- CountedLoss, FlushPartialWindow
def test_counted_loss_and_flush_are_the_active_keras_classes_and_load_with_the_model(tmp_path):
    """``from accum_optimizer import CountedLoss, FlushPartialWindow`` gives
    subclasses of this Keras 2 package's ``Loss`` and ``Callback`` (what its
    ``compile`` and ``fit`` accept); a model compiled with the counted loss
    saves and loads in the ``.keras`` and ``.h5`` formats with it, no
    ``custom_objects``; a non-scalar reduction is refused with a message
    naming it and what is accepted."""
    from accum_optimizer import CountedLoss, FlushPartialWindow

    assert issubclass(CountedLoss, keras.losses.Loss) and issubclass(FlushPartialWindow, keras.callbacks.Callback)
    model = make_mlp(0)
    model.compile(AccumulatingOptimizer(o.Adam(1e-2), 2), CountedLoss("mse"))
    x, y = make_data(4)
    model.fit(x, y, batch_size=2, verbose=0, callbacks=[FlushPartialWindow()])
    for name in ("m.keras", "m.h5"):
        model.save(str(tmp_path / name))
        loaded = keras.models.load_model(str(tmp_path / name))
        assert type(loaded.loss) is CountedLoss and loaded.loss.get_config() == model.loss.get_config()
    with pytest.raises(ValueError, match=_all_of("CountedLoss", "reduction='none'", "'sum_over_batch_size'")):
        CountedLoss(keras.losses.MeanSquaredError(reduction="none"))
