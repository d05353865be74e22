"""Saving and resuming mid-window, in every Keras 2 format.

For each format the test first measures what plain Keras 2 does with a plain
legacy optimizer (does the optimizer state survive save + load?), then
requires the same of the wrapper: where plain Keras keeps the state, resuming
the wrapper mid-window is bitwise identical to uninterrupted training
(weights, every inner slot, ``iterations``, ``micro_steps``, accumulators);
where plain Keras drops it, ``load_model`` still rebuilds the wrapper, with
an equal config. Measured on Keras 2.15 and tf_keras 2.21: ``.h5``
``model.save``, ``save_weights`` in the TF checkpoint format and
``tf.train.Checkpoint`` keep it; the SavedModel directory, ``.keras`` and
``save_weights(".h5")`` drop it (see the README table).
"""

from support.families import require

require("legacy")

import os  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import reference as R  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

keras = tf.keras
L = keras.optimizers.legacy
N = 3
BEFORE, AFTER = 5, 4  # micro-steps before saving (mid-window: 5 % 3 == 2) and after loading


def _optimizer(wrap):
    return AccumulatingOptimizer(L.Adam(0.05), N, name="acc") if wrap else L.Adam(0.05)


def _compiled(wrap):
    model = R.dense_model()
    model.compile(_optimizer(wrap), loss="mse")
    return model


def _fit(model, x, y):
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)


def _state(model, wrap):
    opt = model.optimizer
    inner = opt.inner_optimizer if wrap else opt
    out = [w.numpy() for w in model.weights]
    out += [inner.get_slot(v, s).numpy() for v in model.trainable_variables for s in ("m", "v")]
    out += [inner.iterations.numpy()]
    if wrap:
        out += [opt.micro_steps.numpy(), opt.grad_received.numpy()] + [a.numpy() for a in opt.acc_grads]
    return out


def _save_and_load(model, fmt, path, wrap):
    if fmt == "h5":
        model.save(path + ".h5")
        return keras.models.load_model(path + ".h5")
    if fmt == "savedmodel":
        model.save(path)
        return keras.models.load_model(path)
    if fmt == "keras":
        model.save(path + ".keras")
        return keras.models.load_model(path + ".keras")
    fresh = _compiled(wrap)
    if fmt == "weights_tf":
        model.save_weights(path)
        fresh.load_weights(path)
    elif fmt == "weights_h5":
        model.save_weights(path + ".h5")
        fresh.load_weights(path + ".h5")
    elif fmt == "checkpoint":
        saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(path)
        tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(saved).assert_existing_objects_matched()
    return fresh


def _resume(fmt, tmp_path, wrap):
    """(uninterrupted state, resumed state, loaded model); the loaded
    optimizer's config equals the saved one's."""
    x, y = R.dense_data(2 * (BEFORE + AFTER))
    model = _compiled(wrap)
    _fit(model, x[: 2 * BEFORE], y[: 2 * BEFORE])
    loaded = _save_and_load(model, fmt, os.path.join(str(tmp_path), f"m_{wrap}"), wrap)
    if fmt in ("h5", "savedmodel", "keras"):  # load_model rebuilt the optimizer from its config
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
    _fit(model, x[2 * BEFORE:], y[2 * BEFORE:])
    _fit(loaded, x[2 * BEFORE:], y[2 * BEFORE:])
    return _state(model, wrap), _state(loaded, wrap), loaded


FORMATS = ["h5", "savedmodel", "weights_tf", "weights_h5", "checkpoint"]
if hasattr(keras.saving, "save_model") and "keras" in keras.models.save_model.__doc__:
    FORMATS.append("keras")


def _bitwise(a, b):
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_mid_window_wherever_plain_keras_keeps_optimizer_state(fmt, tmp_path):
    plain_ref, plain_resumed, _ = _resume(fmt, tmp_path, wrap=False)
    plain_keeps = _bitwise(plain_ref, plain_resumed)
    ref, resumed, loaded = _resume(fmt, tmp_path, wrap=True)
    assert isinstance(loaded.optimizer, AccumulatingOptimizer)
    if plain_keeps:
        assert _bitwise(ref, resumed), f"{fmt}: plain Keras 2 resumes bitwise, the wrapper must too"
    else:
        # Plain Keras 2 drops the optimizer state here; so does the wrapper:
        # it restarts its window (micro_steps counts only the AFTER steps).
        assert int(loaded.optimizer.micro_steps.numpy()) == AFTER
    # What this leg found, for the README table.
    print(f"{fmt}: optimizer state kept by plain Keras 2: {plain_keeps}")


def test_model_shipped_without_optimizer_holds_no_accumulator(tmp_path):
    import h5py

    x, y = R.dense_data(2 * BEFORE)
    model = _compiled(True)
    _fit(model, x, y)
    path = os.path.join(str(tmp_path), "serve.h5")
    model.save(path, include_optimizer=False)
    with h5py.File(path, "r") as f:
        assert "optimizer_weights" not in f
        names = []
        f.visit(names.append)
    assert not any("acc_grad" in n or "micro_steps" in n for n in names)
    loaded = keras.models.load_model(path, compile=False)
    assert _bitwise(model.get_weights(), loaded.get_weights())


def test_checkpoint_saves_inner_slots_once_and_restores_before_build(tmp_path):
    x, y = R.dense_data(2 * BEFORE)
    model = _compiled(True)
    _fit(model, x, y)
    saved = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(os.path.join(str(tmp_path), "ck"))
    keys = [k for k, _ in tf.train.list_variables(saved)]
    slots = [k for k in keys if "OPTIMIZER_SLOT" in k]
    # One entry per (trainable variable, inner slot): the wrapper forwards
    # none of them as its own (that would be "re-used as a dependency").
    assert len(slots) == len(model.trainable_variables) * 2, slots
    assert all("/inner_optimizer/" in k or "inner_optimizer" in k for k in slots), slots
    assert sum("acc_grad" in k for k in keys) == len(model.trainable_variables)
    # Restored into an optimizer that is not built yet: the accumulators
    # and counters get their values when the first step builds them.
    fresh = _compiled(True)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(saved)
    assert not fresh.optimizer.built
    fresh.optimizer.build(fresh.trainable_variables)
    assert _bitwise(_state(model, True), _state(fresh, True))


@pytest.mark.parametrize("make_inner", [
    lambda: L.Adam(0.05), lambda: L.SGD(0.05, momentum=0.9), lambda: L.RMSprop(0.05, momentum=0.5, centered=True),
], ids=["Adam", "SGD-momentum", "RMSprop-centered"])
def test_slots_read_through_the_wrapper_are_the_inner_optimizers_and_saved_once(make_inner, tmp_path):
    """``opt.get_slot(var, name)`` and ``opt.get_slot_names()`` answer with
    the inner optimizer's slots (issue 17, bug 4), after 5 micro-steps (an
    update and a partial window): the same names, the same variables (so
    the same values) for every trained variable and slot name; and a
    ``tf.train.Checkpoint`` still saves each slot once, under the inner
    optimizer (the layout of earlier versions, which the committed fixtures
    pin)."""
    x, y = R.dense_data(2 * BEFORE)
    model = R.dense_model()
    inner = make_inner()
    opt = AccumulatingOptimizer(inner, N)
    model.compile(opt, loss="mse")
    _fit(model, x, y)
    names = inner.get_slot_names()
    assert names and opt.get_slot_names() == names
    for v in model.trainable_variables:
        for name in names:
            assert opt.get_slot(v, name) is inner.get_slot(v, name), (v.name, name)
            np.testing.assert_array_equal(opt.get_slot(v, name).numpy(), inner.get_slot(v, name).numpy())
    saved = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(str(tmp_path), "ck"))
    slots = [k for k, _ in tf.train.list_variables(saved) if "OPTIMIZER_SLOT" in k]
    assert len(slots) == len(model.trainable_variables) * len(names), slots
    assert all("/inner_optimizer/" in k for k in slots), slots


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "wrapped"])
def test_a_slot_added_with_a_nonstandard_shape_is_saved_and_created_by_the_restore(wrap, tmp_path):
    """tf_keras' ``testSlotWithNonstandardShapeRestoresBasedOnCheckpoint``
    through the wrapper: ``add_slot(var, name, shape=...)`` on the optimizer,
    a ``tf.train.Checkpoint`` save, then a fresh optimizer whose slot the
    restore creates (it was never added), found by ``get_slot`` with the
    saved shape and values. The plain optimizer (``wrap=False``) is the
    reference; the wrapper's slot is the inner optimizer's, saved once."""
    x = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    first = _optimizer(wrap)
    added = first.add_slot(x, "test_slot", "ones", shape=[2, 1])
    added.assign([[5.0], [7.0]])
    saved = tf.train.Checkpoint(var=x, optimizer=first).save(os.path.join(str(tmp_path), "ck"))
    slots = [k for k, _ in tf.train.list_variables(saved) if "test_slot" in k]
    assert len(slots) == 1, slots

    second = _optimizer(wrap)
    tf.train.Checkpoint(var=x, optimizer=second).restore(saved).assert_existing_objects_matched()
    restored = second.get_slot(x, "test_slot")
    assert restored.shape.as_list() == [2, 1]
    np.testing.assert_array_equal(restored.numpy(), [[5.0], [7.0]])
    if wrap:
        assert first.get_slot(x, "test_slot") is first.inner_optimizer.get_slot(x, "test_slot")
        assert restored is second.inner_optimizer.get_slot(x, "test_slot")
        assert "test_slot" in second.get_slot_names()
