"""Keras 2 saving: every format, what survives, and resuming mid-window.

Reference: the same compiled model (same seeded initial weights), the same
AdamW (weight decay, EMA) and the same samples in the same order, trained by
``fit`` for all 12 micro-steps without interruption. The interrupted run fits
6 micro-steps (N = 4: one update, then two micro-steps into the second
window, so the accumulators are non-zero), is saved in every format, and a
model loaded from each format fits the remaining 6. Where Keras 2 keeps an
optimizer's state the resumed weights and every optimizer variable must equal
the reference exactly (``np.testing.assert_array_equal``).

Which formats keep optimizer state is Keras 2's choice, checked here for the
plain inner optimizer too (``test_plain_keras2_keeps_optimizer_state_in_these_formats``):

=====================================  =========  ===================================
format                                 plain      AccumulatingOptimizer
=====================================  =========  ===================================
``model.save("m.keras")``              kept       kept
``model.save("m.h5")``                 kept       kept
``model.save("dir")`` (SavedModel)     dropped    dropped; wrapper rebuilt, same config
``save_weights("w.weights.h5")``       kept [1]_  kept (load_weights builds, restores)
``save_weights("ckpt")`` (TF format)   kept       kept
``save_weights("w.h5")``               dropped    dropped (model weights only)
``tf.train.Checkpoint``                kept       kept
=====================================  =========  ===================================

.. [1] into a built optimizer only; an unbuilt one skips it with a warning.
"""

from support.families import require

require("keras2")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import accum_optimizer  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.reference import make_data, make_mlp, optimizer_state, weights  # noqa: E402

keras = tf.keras
N, B = 4, 4
SAVE_AT, TOTAL = 6, 12
RESUME_SEED = 123  # models loaded with weights-only formats start elsewhere

KEPT = ["keras", "h5", "weights_h5", "weights_tf", "checkpoint"]
DROPPED = ["savedmodel", "weights_legacy_h5"]
PATHS = {
    "keras": "m.keras",
    "h5": "m.h5",
    "savedmodel": "saved_model_dir",
    "weights_h5": "w.weights.h5",
    "weights_tf": "w_ckpt",
    "weights_legacy_h5": "w.h5",
    "checkpoint": "tf_ckpt",
}


def make_inner():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.01, use_ema=True, ema_momentum=0.9)


def compiled(seed, inner=None, accumulate=True):
    model = make_mlp(seed)
    inner = make_inner() if inner is None else inner
    model.compile(optimizer=AccumulatingOptimizer(inner, N) if accumulate else inner, loss="mse")
    return model


def fit(model, x, y):
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)


@dataclass
class State:
    weights: list
    inner: list
    own: list
    micro_steps: int
    iterations: int


def state_of(model) -> State:
    opt = model.optimizer
    return State(
        weights(model),
        optimizer_state(opt.inner_optimizer),
        [np.array(v.numpy()) for v in opt._variables],
        int(opt.micro_steps.numpy()),
        int(opt.iterations.numpy()),
    )


def assert_same_state(actual: State, expected: State):
    assert (actual.micro_steps, actual.iterations) == (expected.micro_steps, expected.iterations)
    for name in ("weights", "inner", "own"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert len(a) == len(e), name
        for i, (x, y) in enumerate(zip(a, e)):
            np.testing.assert_array_equal(x, y, err_msg=f"{name}[{i}]")


def save(model, fmt, path, **kwargs):
    if fmt in ("keras", "h5", "savedmodel"):
        model.save(path, **kwargs)
    elif fmt == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(path)
    else:
        model.save_weights(path)


def load(fmt, path, accumulate=True):
    """A model from ``path``: ``load_model`` for model formats, else a fresh
    compiled model (other initial weights, unbuilt optimizer) loaded from it."""
    if fmt in ("keras", "h5", "savedmodel"):
        return keras.models.load_model(path)
    model = compiled(RESUME_SEED, accumulate=accumulate)
    if fmt == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path)
    else:
        model.load_weights(path)
    return model


@dataclass
class Runs:
    dir: str
    x: np.ndarray
    y: np.ndarray
    reference: State
    at_save: State
    config: dict


class SaveEverywhere(keras.callbacks.Callback):
    """After micro-step ``SAVE_AT`` of a fit, save the model in every format
    and record its state. (Mid-fit: ``fit`` ends with the inner optimizer's
    ``finalize_variable_values``, an EMA overwrite, so the interruption must
    fall inside one fit, as with ``ModelCheckpoint``.)"""

    def __init__(self, directory):
        super().__init__()
        self.directory, self.state = directory, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == SAVE_AT - 1:
            self.state = state_of(self.model)
            for fmt, name in PATHS.items():
                save(self.model, fmt, os.path.join(self.directory, name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("keras2_saving"))
    x, y = make_data(TOTAL * B)
    ref = compiled(0)
    fit(ref, x, y)
    reference = state_of(ref)
    assert (reference.micro_steps, reference.iterations) == (TOTAL, TOTAL // N)

    run = compiled(0)
    saver = SaveEverywhere(d)
    run.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[saver])
    at_save = saver.state
    # Mid-window: one update done, two micro-steps into the next window.
    assert (at_save.micro_steps, at_save.iterations) == (SAVE_AT, SAVE_AT // N)
    assert all(np.any(a) for a in at_save.own[2:])  # the accumulators
    # Saving does not perturb the run that saves.
    assert_same_state(state_of(run), reference)
    return Runs(d, x, y, reference, at_save, run.optimizer.get_config())


@pytest.mark.parametrize("fmt", KEPT)
def test_resume_mid_window_is_bitwise_identical(runs, fmt):
    model = load(fmt, os.path.join(runs.dir, PATHS[fmt]))
    assert isinstance(model.optimizer, AccumulatingOptimizer)
    if fmt in ("keras", "h5", "weights_h5"):  # load_model, load_weights build the optimizer and restore it
        assert_same_state(state_of(model), runs.at_save)
    else:  # TF checkpoints: TF restores the unbuilt optimizer's variables as the first step creates them
        assert not getattr(model.optimizer, "_built", False)
    fit(model, runs.x[SAVE_AT * B :], runs.y[SAVE_AT * B :])
    assert_same_state(state_of(model), runs.reference)


@pytest.mark.parametrize("fmt", DROPPED)
def test_formats_that_drop_optimizer_state_still_rebuild_the_wrapper(runs, fmt):
    model = load(fmt, os.path.join(runs.dir, PATHS[fmt]))
    opt = model.optimizer
    assert isinstance(opt, AccumulatingOptimizer)
    assert opt.get_config() == runs.config
    for w, w_saved in zip(weights(model), runs.at_save.weights):
        np.testing.assert_array_equal(w, w_saved)
    opt.build(model.trainable_variables)
    # A fresh window and a fresh inner optimizer, as plain Keras 2 gives.
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (0, 0)
    assert all(not np.any(a.numpy()) for a in opt.acc_grads)


def test_plain_keras2_keeps_optimizer_state_in_these_formats(tmp_path):
    # The table of the module docstring, for the plain inner optimizer.
    x, y = make_data(SAVE_AT * B)
    plain = compiled(0, accumulate=False)
    fit(plain, x, y)
    kept = {}
    for fmt, name in PATHS.items():
        path = str(tmp_path / name)
        save(plain, fmt, path)
        loaded = load(fmt, path, accumulate=False)
        loaded.optimizer.build(loaded.trainable_variables)
        kept[fmt] = int(loaded.optimizer.iterations.numpy()) == SAVE_AT
    # A .weights.h5 file restores into a built plain optimizer only.
    built = compiled(RESUME_SEED, accumulate=False)
    built.optimizer.build(built.trainable_variables)
    built.load_weights(str(tmp_path / PATHS["weights_h5"]))
    assert int(built.optimizer.iterations.numpy()) == SAVE_AT
    assert kept == {**{f: True for f in KEPT}, **{f: False for f in DROPPED}, "weights_h5": False}


def test_inner_state_is_saved_exactly_once_in_every_format(runs):
    d = runs.dir
    model = load("keras", os.path.join(d, PATHS["keras"]))
    opt = model.optimizer
    n_vars = len(opt.variables)  # own (2 counters + 4 slots) + inner's + mini_step, window_weight
    assert n_vars == len(opt._variables) + len(opt.inner_optimizer.variables) + 2 == 6 + 13 + 2
    # .keras: one store for the wrapper, holding each variable once; none
    # for the inner optimizer.
    with zipfile.ZipFile(os.path.join(d, PATHS["keras"])) as z:
        z.extract("model.weights.h5", d)
    with h5py.File(os.path.join(d, "model.weights.h5")) as f:
        groups = []
        f.visit(lambda name: groups.append(name) if "optimizer" in name and name.endswith("vars") else None)
        assert groups == ["optimizer/vars"]
        assert len(f["optimizer/vars"]) == n_vars
    # .h5: the optimizer's weights once each, by unique names.
    with h5py.File(os.path.join(d, PATHS["h5"])) as f:
        names = [n.decode() if isinstance(n, bytes) else n for n in f["optimizer_weights"].attrs["weight_names"]]
    assert len(names) == len(set(names)) == n_vars
    # TF checkpoints: each optimizer variable once (the inner `iterations`,
    # also reachable as the wrapper's `_iterations`, is one saved value).
    # Besides `variables`, the inner's learning-rate variable is saved.
    for fmt in ("weights_tf", "checkpoint"):
        keys = [k for k, _ in tf.train.list_variables(os.path.join(d, PATHS[fmt])) if k.startswith("optimizer/")]
        assert len(keys) == n_vars + 1, (fmt, keys)
        assert len([k for k in keys if k.endswith("_iterations/.ATTRIBUTES/VARIABLE_VALUE")]) == 1


def test_model_shipped_for_inference_holds_no_accumulator(runs, tmp_path):
    model = load("keras", os.path.join(runs.dir, PATHS["keras"]))
    model.save(str(tmp_path / "ship.h5"), include_optimizer=False)
    with h5py.File(str(tmp_path / "ship.h5")) as f:
        assert "optimizer_weights" not in f
    model.save(str(tmp_path / "ship_dir"), include_optimizer=False)
    keys = [k for k, _ in tf.train.list_variables(str(tmp_path / "ship_dir" / "variables" / "variables"))]
    assert keys and not [k for k in keys if "optimizer" in k or "acc_grad" in k]
    model.save_weights(str(tmp_path / "ship_weights.h5"))
    with h5py.File(str(tmp_path / "ship_weights.h5")) as f:
        datasets = []
        f.visit(lambda name: datasets.append(name) if isinstance(f[name], h5py.Dataset) else None)
    assert len(datasets) == len(model.weights)


@pytest.mark.parametrize(
    "make_inner_fn",
    [
        lambda: keras.optimizers.Lion(1e-3, weight_decay=0.1),
        lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5), weight_decay=0.05),
    ],
    ids=["lion", "adamw_schedule"],
)
def test_config_round_trip_through_keras2_serialization(make_inner_fn):
    # Lion's (and, on Keras 2.15, AdamW's) current-format config is one that
    # Keras 2's own optimizers.deserialize cannot resolve.
    opt = AccumulatingOptimizer(make_inner_fn(), 4, reduction="sum", name="acc")
    config = opt.get_config()
    via_keras = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    via_class = type(opt).from_config(json.loads(json.dumps(config)))
    via_dispatcher = accum_optimizer.AccumulatingOptimizer.from_config(config)
    for rebuilt in (via_keras, via_class, via_dispatcher):
        assert type(rebuilt) is type(opt)
        assert type(rebuilt.inner_optimizer) is type(opt.inner_optimizer)
        assert rebuilt.get_config() == config


def test_fresh_process_import_registers_the_wrapper_and_load_model_needs_nothing_else(runs):
    # `import accum_optimizer` in a fresh process registers the Keras 2
    # wrapper with the active tf.keras and imports neither Keras 3 (on TF 2.21
    # with TF_USE_LEGACY_KERAS=1) nor the Keras 3 family; then load_model
    # rebuilds the wrapper from each model format with nothing else imported.
    code = (
        "import sys, tensorflow as tf, accum_optimizer\n"
        "keras = sys.modules.get('keras')\n"
        "print(keras is None or keras.__version__.startswith('2.'), 'accum_optimizer.families.keras3' in sys.modules)\n"
        "registered = tf.keras.utils.get_registered_object('accum_optimizer>AccumulatingOptimizer')\n"
        "print(registered.__module__, registered.__name__)\n"
        "for p in sys.argv[1:]:\n"
        "    o = tf.keras.models.load_model(p).optimizer\n"
        "    built = getattr(o, '_built', False)\n"
        "    print(type(o) is registered, int(o.micro_steps.numpy()) if built else 'unbuilt')\n"
    )
    paths = [os.path.join(runs.dir, PATHS[f]) for f in ("keras", "h5", "savedmodel")]
    out = subprocess.run(
        [sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-5:] == [
        "True False",
        "accum_optimizer.families.keras2 AccumulatingOptimizer",
        f"True {SAVE_AT}",
        f"True {SAVE_AT}",
        "True unbuilt",
    ]


@pytest.mark.parametrize("api", ["new", "legacy"])
def test_float16_accumulators_of_earlier_versions_restore_into_the_default_wrapper(api, tmp_path):
    """Earlier versions gave a float16 variable a float16 accumulator in the
    Keras 2 and legacy families; the default (``accumulator_dtype=None``)
    keeps doing so, so a checkpoint saved mid-window by them restores, with
    the window's sum, bitwise (a float16 value does not restore into a
    float32 variable: RestoreV2 refuses the dtype)."""
    sgd = keras.optimizers.SGD if api == "new" else keras.optimizers.legacy.SGD

    def wrapper(v, **kwargs):
        opt = AccumulatingOptimizer(sgd(0.5), 2, **kwargs)
        opt.build([v])
        return opt

    v = tf.Variable(np.array([1.0, 2.0], np.float16))
    old = wrapper(v, accumulator_dtype="float16")  # the layout earlier versions saved
    old.apply_gradients([(tf.constant([0.25, -0.5], tf.float16), v)])
    path = tf.train.Checkpoint(opt=old, v=v).write(str(tmp_path / "ckpt"))

    v2 = tf.Variable(np.array([1.0, 2.0], np.float16))
    new = wrapper(v2)
    tf.train.Checkpoint(opt=new, v=v2).read(path).assert_existing_objects_matched()
    new.apply_gradients([(tf.constant([0.25, 0.5], tf.float16), v2)])  # closes the window
    old.apply_gradients([(tf.constant([0.25, 0.5], tf.float16), v)])
    np.testing.assert_array_equal(v2.numpy(), v.numpy())
    np.testing.assert_array_equal(v.numpy(), np.float16([1.0, 2.0]) - np.float16(0.5) * np.float16([0.25, 0.0]))
