"""Save and resume: the accumulators and the micro-step counter are optimizer state.

Every resume test compares against an independent reference: the same model
(same seeded initial weights), the same optimizer and the same samples in the
same order, trained for all 12 micro-steps without interruption. The
interrupted run saves after 6 micro-steps with N = 4 (one update done, two
micro-steps into the second window, so the accumulators are non-zero), a fresh
model with *different* initial weights and a fresh optimizer load the state, and
train the remaining 6 micro-steps. Weights and every optimizer variable must then
be exactly equal (``np.testing.assert_array_equal``) to the reference.

The inner optimizer is AdamW with weight decay and EMA, so the inner state is
large (momentum, velocity, EMA copies, iterations, learning rate).

Expensive runs (uninterrupted references, the runs that write checkpoints) are
module-scoped fixtures shared by the tests.
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, make_train_step, weights

N = 4  # gradient_accumulation_steps
B = 4  # micro-batch size
SAVE_AT = 6  # micro-steps before the checkpoint: 1 update + 2 micro-steps
TOTAL = 12  # micro-steps of the uninterrupted reference
RESUME_SEED = 123  # initial weights of every resumed model differ from seed 0


def make_inner():
    return keras.optimizers.AdamW(
        learning_rate=1e-2, weight_decay=0.01, use_ema=True, ema_momentum=0.9
    )


def make_optimizer():
    return AccumulatingOptimizer(make_inner(), gradient_accumulation_steps=N)


def compiled(seed, optimizer=None):
    model = make_mlp(seed)
    model.compile(
        optimizer=make_optimizer() if optimizer is None else optimizer,
        loss="mse",
        jit_compile=False,
    )
    return model


def fit(model, x, y):
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)


def data():
    return make_data(TOTAL * B)


# ---------------------------------------------------------------- state utils
@dataclass
class State:
    weights: list
    opt_values: list
    opt_specs: list  # (shape, dtype) of each optimizer variable
    opt_paths: list
    micro_steps: int
    iterations: int
    acc_grads: list
    grad_received: np.ndarray


def state_of(model, opt) -> State:
    return State(
        weights=weights(model),
        opt_values=[np.array(v.numpy()) for v in opt.variables],
        opt_specs=[(tuple(v.shape), str(v.dtype)) for v in opt.variables],
        opt_paths=[v.path for v in opt.variables],
        micro_steps=int(opt.micro_steps.numpy()),
        iterations=int(opt.iterations.numpy()),
        acc_grads=[np.array(a.numpy()) for a in opt.acc_grads],
        grad_received=np.array(opt.grad_received.numpy()),
    )


def assert_same_state(actual: State, expected: State):
    """Weights and every optimizer variable exactly equal, in order."""
    assert actual.micro_steps == expected.micro_steps
    assert actual.iterations == expected.iterations
    assert len(actual.weights) == len(expected.weights)
    for i, (a, e) in enumerate(zip(actual.weights, expected.weights)):
        np.testing.assert_array_equal(a, e, err_msg=f"model weight {i}")
    assert actual.opt_specs == expected.opt_specs
    for a, e, path in zip(actual.opt_values, expected.opt_values, expected.opt_paths):
        np.testing.assert_array_equal(a, e, err_msg=f"optimizer variable {path}")
    for i, (a, e) in enumerate(zip(actual.acc_grads, expected.acc_grads)):
        np.testing.assert_array_equal(a, e, err_msg=f"acc_grads[{i}]")
    np.testing.assert_array_equal(actual.grad_received, expected.grad_received)


def assert_mid_window(state: State):
    """The checkpoint really is mid-window: 1 update, 2 micro-steps into the next."""
    assert state.micro_steps == SAVE_AT
    assert state.iterations == SAVE_AT // N
    np.testing.assert_array_equal(state.grad_received, np.ones_like(state.grad_received))
    assert len(state.acc_grads) == 4
    for a in state.acc_grads:
        assert np.any(a != 0)


class Snapshot(keras.callbacks.Callback):
    """Record the full training state after micro-step ``SAVE_AT``."""

    def __init__(self):
        super().__init__()
        self.state = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == SAVE_AT - 1:
            self.state = state_of(self.model, self.model.optimizer)


def h5_datasets(path, group=None):
    """``{dataset path: (shape, dtype)}`` of an HDF5 file (or one of its groups)."""
    out = {}
    with h5py.File(path, "r") as f:
        root = f if group is None else f[group]

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (tuple(obj.shape), str(obj.dtype))

        root.visititems(visit)
    return out


def variable_specs(variables):
    return sorted((tuple(v.shape), keras.backend.standardize_dtype(v.dtype)) for v in variables)


# ------------------------------------------------------------------ fixtures
@dataclass
class FitRuns:
    dir: object
    x: np.ndarray
    y: np.ndarray
    reference: State  # 12 micro-steps, one uninterrupted fit
    at_save: State  # the checkpointing run's state after SAVE_AT micro-steps
    keras_file: str
    weights_file: str
    plain_model: keras.Model  # same model, plain AdamW, SAVE_AT steps
    plain_weights_file: str


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fit")
    x, y = data()

    ref = compiled(seed=0)
    fit(ref, x, y)
    reference = state_of(ref, ref.optimizer)
    assert reference.micro_steps == TOTAL and reference.iterations == TOTAL // N

    # The checkpointing run: the same 12-micro-step fit, with Keras'
    # ModelCheckpoint writing a .keras file and a weights-only file every
    # SAVE_AT batches (so mid-window, at batch SAVE_AT).
    run = compiled(seed=0)
    snapshot = Snapshot()
    fit_with_callbacks = [
        keras.callbacks.ModelCheckpoint(str(d / "full_{batch}.keras"), save_freq=SAVE_AT),
        keras.callbacks.ModelCheckpoint(
            str(d / "w_{batch}.weights.h5"), save_freq=SAVE_AT, save_weights_only=True
        ),
        snapshot,
    ]
    run.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=fit_with_callbacks)
    # Saving must not perturb the run that saves.
    assert_same_state(state_of(run, run.optimizer), reference)
    assert_mid_window(snapshot.state)

    plain = make_mlp(0)
    plain.compile(optimizer=make_inner(), loss="mse", jit_compile=False)
    fit(plain, x[: SAVE_AT * B], y[: SAVE_AT * B])
    plain.save_weights(str(d / "plain.weights.h5"))

    return FitRuns(
        dir=d,
        x=x,
        y=y,
        reference=reference,
        at_save=snapshot.state,
        keras_file=str(d / f"full_{SAVE_AT}.keras"),
        weights_file=str(d / f"w_{SAVE_AT}.weights.h5"),
        plain_model=plain,
        plain_weights_file=str(d / "plain.weights.h5"),
    )


def run_steps(step, x, y, start, stop):
    for s in range(start, stop):
        step(tf.constant(x[s * B : (s + 1) * B]), tf.constant(y[s * B : (s + 1) * B]))


@dataclass
class LoopRuns:
    dir: object
    x: np.ndarray
    y: np.ndarray
    reference: State  # 12 micro-steps of the custom loop, uninterrupted
    at_save: State
    weights_file: str
    tf_checkpoint: str | None
    tf_checkpoint_error: Exception | None

    def tf_checkpoint_path(self) -> str:
        if self.tf_checkpoint_error is not None:
            raise self.tf_checkpoint_error
        return self.tf_checkpoint


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    x, y = data()

    ref_model, ref_opt = make_mlp(0), make_optimizer()
    run_steps(make_train_step(ref_model, ref_opt), x, y, 0, TOTAL)
    reference = state_of(ref_model, ref_opt)
    assert reference.micro_steps == TOTAL and reference.iterations == TOTAL // N

    # The checkpointing run: SAVE_AT micro-steps, then save both ways.
    model, opt = make_mlp(0), make_optimizer()
    model.compile(optimizer=opt, loss="mse")  # so save_weights includes the optimizer
    run_steps(make_train_step(model, opt), x, y, 0, SAVE_AT)
    at_save = state_of(model, opt)
    assert_mid_window(at_save)
    model.save_weights(str(d / "loop.weights.h5"))
    ckpt, error = None, None
    try:
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt).save(str(d / "tf_ckpt"))
    except Exception as e:  # reported by the tests that need the checkpoint
        error = e
    return LoopRuns(d, x, y, reference, at_save, str(d / "loop.weights.h5"), ckpt, error)


# ------------------------------------------------------ resume: .keras file
def test_resume_mid_window_from_keras_file_is_bitwise_identical(fit_runs):
    # No custom_objects: the class is registered with Keras' serialization.
    model = keras.models.load_model(fit_runs.keras_file)
    opt = model.optimizer
    assert isinstance(opt, AccumulatingOptimizer)
    assert type(opt.inner_optimizer) is keras.optimizers.AdamW
    assert opt.gradient_accumulation_steps == N
    restored = state_of(model, opt)
    assert_mid_window(restored)
    assert_same_state(restored, fit_runs.at_save)

    fit(model, fit_runs.x[SAVE_AT * B :], fit_runs.y[SAVE_AT * B :])
    assert_same_state(state_of(model, opt), fit_runs.reference)


# ---------------------------------------- resume: save_weights / ModelCheckpoint
def test_resume_mid_window_from_model_checkpoint_weights_into_never_trained_model_is_bitwise_identical(
    fit_runs,
):
    model = compiled(seed=RESUME_SEED)  # compiled, never trained: optimizer unbuilt
    model.load_weights(fit_runs.weights_file)
    assert model.optimizer.built  # built by the load, as the first step would
    fit(model, fit_runs.x[SAVE_AT * B :], fit_runs.y[SAVE_AT * B :])
    assert_same_state(state_of(model, model.optimizer), fit_runs.reference)


def test_weights_loaded_into_unbuilt_optimizer_are_restored_at_load(fit_runs):
    """The optimizer is built by ``load_weights`` (with the model's
    trainable variables, as the first step would) and holds the saved state
    at once: nothing waits for the first step (issue 17, bug 3)."""
    model = compiled(seed=RESUME_SEED)
    opt = model.optimizer
    assert not opt.built
    model.load_weights(fit_runs.weights_file)
    assert opt.built
    restored = state_of(model, opt)
    assert_mid_window(restored)
    assert_same_state(restored, fit_runs.at_save)

    fit(model, fit_runs.x[SAVE_AT * B :], fit_runs.y[SAVE_AT * B :])
    assert_same_state(state_of(model, opt), fit_runs.reference)


def test_weights_loaded_into_built_optimizer_resume_mid_window_bitwise_identical(loop_runs):
    model, opt = make_mlp(RESUME_SEED), make_optimizer()
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    model.load_weights(loop_runs.weights_file)
    assert_same_state(state_of(model, opt), loop_runs.at_save)

    run_steps(make_train_step(model, opt), loop_runs.x, loop_runs.y, SAVE_AT, TOTAL)
    assert_same_state(state_of(model, opt), loop_runs.reference)


def test_load_weights_under_a_strategy_builds_the_optimizer_in_its_scope(loop_runs, strategy):
    """``load_weights`` (outside the scope) into a model made under
    MirroredStrategy builds the unbuilt optimizer under the model's strategy:
    its variables are distributed as those built by a train step (replica-local
    accumulators, mirrored inner state) and hold the saved values."""
    with strategy.scope():
        model, opt = make_mlp(RESUME_SEED), make_optimizer()
        model.compile(optimizer=opt, loss="mse")
        built_by_step = make_optimizer()
        built_by_step.build(model.trainable_variables)
    model.load_weights(loop_runs.weights_file)
    assert opt.built
    assert [type(v.value).__name__ for v in opt.variables] == [type(v.value).__name__ for v in built_by_step.variables]
    assert {type(a.value).__name__ for a in opt.acc_grads} == {"SyncOnReadVariable"}
    assert_same_state(state_of(model, opt), loop_runs.at_save)


def test_resume_mid_window_from_save_weights_in_custom_loop_is_bitwise_identical(loop_runs):
    model, opt = make_mlp(RESUME_SEED), make_optimizer()
    model.compile(optimizer=opt, loss="mse")
    model.load_weights(loop_runs.weights_file)
    assert opt.built  # by the load: the first step's tf.function finds it built
    run_steps(make_train_step(model, opt), loop_runs.x, loop_runs.y, SAVE_AT, TOTAL)
    assert_same_state(state_of(model, opt), loop_runs.reference)


def test_state_saved_before_the_window_position_resumes_bitwise(loop_runs):
    """State in the layout of versions before ``mini_step``, ``window_weight``
    and the row trackers (the wrapper's own variables and the inner
    optimizer's: a prefix of today's) resumes two micro-steps into its window:
    the position is ``micro_steps % N`` again, and training on ends bitwise
    equal to the uninterrupted run (the same restore routine as the Keras 2
    and legacy families)."""
    model, opt = make_mlp(0), make_optimizer()
    run_steps(make_train_step(model, opt), loop_runs.x, loop_runs.y, 0, SAVE_AT)
    blocks = {id(v) for v in [opt.mini_step, opt.window_weight, *opt.touched_rows]}
    old_layout = [v.numpy() for v in opt.variables if id(v) not in blocks]
    assert len(old_layout) == len(opt.variables) - len(blocks)
    resumed, resumed_opt = make_mlp(RESUME_SEED), make_optimizer()
    resumed_opt.build(resumed.trainable_variables)
    resumed_opt.load_own_variables({str(i): value for i, value in enumerate(old_layout)})
    resumed.set_weights(weights(model))
    assert int(resumed_opt.mini_step.numpy()) == SAVE_AT % N
    assert float(resumed_opt.window_weight.numpy()) == SAVE_AT % N
    run_steps(make_train_step(resumed, resumed_opt), loop_runs.x, loop_runs.y, SAVE_AT, TOTAL)
    # Every weight and optimizer variable bitwise, but the row trackers: a
    # save without them marks each row of a non-zero restored accumulator
    # (rows a sparse window would have marked; dense windows never clear
    # them), where the uninterrupted dense run marked none.
    actual, expected = state_of(resumed, resumed_opt), loop_runs.reference
    trackers = [i for i, v in enumerate(resumed_opt.variables) if any(v is t for t in resumed_opt.touched_rows)]
    assert trackers and all(np.all(actual.opt_values[i] == 1) for i in trackers)
    def without_trackers(state: State) -> State:
        return dataclasses.replace(state, **{
            name: [x for i, x in enumerate(getattr(state, name)) if i not in trackers]
            for name in ("opt_values", "opt_specs", "opt_paths")
        })

    assert_same_state(without_trackers(actual), without_trackers(expected))


def test_loading_into_unbuilt_optimizer_does_not_warn_that_state_was_skipped(fit_runs):
    model = compiled(seed=RESUME_SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(fit_runs.weights_file)
        model.optimizer.build(model.trainable_variables)
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    assert skipped == []
    assert_same_state(state_of(model, model.optimizer), fit_runs.at_save)


# -------------------------------------------------- resume: tf.train.Checkpoint
def test_resume_mid_window_from_tf_checkpoint_is_bitwise_identical(loop_runs):
    path = loop_runs.tf_checkpoint_path()
    model, opt = make_mlp(RESUME_SEED), make_optimizer()
    opt.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
    status.assert_consumed()
    restored = state_of(model, opt)
    assert_mid_window(restored)
    assert_same_state(restored, loop_runs.at_save)

    run_steps(make_train_step(model, opt), loop_runs.x, loop_runs.y, SAVE_AT, TOTAL)
    assert_same_state(state_of(model, opt), loop_runs.reference)


@pytest.mark.parametrize("built_by", ["explicit_build", "first_train_step"])
def test_tf_checkpoint_restore_into_unbuilt_optimizer_applies_when_it_builds(loop_runs, built_by):
    path = loop_runs.tf_checkpoint_path()
    model, opt = make_mlp(RESUME_SEED), make_optimizer()
    status = tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
    assert not opt.built
    if built_by == "explicit_build":
        opt.build(model.trainable_variables)
        status.assert_consumed()
        restored = state_of(model, opt)
        assert_mid_window(restored)
        assert_same_state(restored, loop_runs.at_save)
    # Otherwise the first step builds the optimizer inside its tf.function.
    run_steps(make_train_step(model, opt), loop_runs.x, loop_runs.y, SAVE_AT, TOTAL)
    status.assert_consumed()
    assert_same_state(state_of(model, opt), loop_runs.reference)


# ------------------------------------------------------------------ counters
def test_restored_counters_are_assignable_int64_variables(fit_runs):
    model = keras.models.load_model(fit_runs.keras_file)
    opt = model.optimizer
    for counter in (opt.micro_steps, opt.iterations, opt.mini_step):
        assert isinstance(counter, keras.Variable)
        assert counter.dtype == "int64"
    assert opt.iterations is opt.inner_optimizer.iterations
    assert int(opt.micro_steps.numpy()) == SAVE_AT
    assert int(opt.iterations.numpy()) == SAVE_AT // N
    assert int(opt.mini_step.numpy()) == SAVE_AT % N

    # Jump to the last micro-step of the window: the next micro-step updates.
    opt.mini_step.assign(N - 1)
    weights_before = weights(model)
    x, y = fit_runs.x[:B], fit_runs.y[:B]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - model(x, training=True)))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    assert int(opt.micro_steps.numpy()) == SAVE_AT + 1
    assert int(opt.iterations.numpy()) == SAVE_AT // N + 1
    assert int(opt.mini_step.numpy()) == 0
    assert all(np.any(a != b) for a, b in zip(weights(model), weights_before))
    for a in opt.acc_grads:
        np.testing.assert_array_equal(a.numpy(), np.zeros(a.shape, a.dtype))

    opt.iterations.assign(7)
    assert int(opt.inner_optimizer.iterations.numpy()) == 7
    assert opt.micro_steps.dtype == "int64" and opt.iterations.dtype == "int64"


# ------------------------------------------------------- what is saved where
def test_saved_optimizer_state_is_accumulators_counters_and_inner_state_only(fit_runs):
    model = keras.models.load_model(fit_runs.keras_file)
    opt = model.optimizer
    model_ids = {id(v) for v in model.weights}
    assert [v for v in opt.variables if id(v) in model_ids] == []
    expected_vars = [opt.micro_steps, opt.grad_received, *opt.acc_grads, *opt.inner_optimizer.variables,
                     opt.mini_step, opt.window_weight, *opt.touched_rows]
    assert [id(v) for v in opt.variables] == [id(v) for v in expected_vars]

    # In the file: the plain AdamW's state + micro_steps + grad_received + one
    # accumulator per trainable variable + mini_step + window_weight + one
    # float16 row tracker per trainable variable of rank >= 1 (its first axis).
    saved = sorted(h5_datasets(fit_runs.weights_file, "optimizer/vars").values())
    plain = list(h5_datasets(fit_runs.plain_weights_file, "optimizer/vars").values())
    own = [((), "int64"), ((len(model.trainable_variables),), "int64"), ((), "int64"), ((), "float32")]
    acc = [(tuple(v.shape), "float32") for v in model.trainable_variables]
    rows = [(tuple(v.shape[:1]), "float16") for v in model.trainable_variables if len(v.shape) >= 1]
    assert saved == sorted(plain + own + acc + rows)


def test_exported_saved_model_holds_no_optimizer_state(fit_runs, tmp_path):
    model = keras.models.load_model(fit_runs.keras_file)  # mid-window: non-zero accumulators
    assert_mid_window(state_of(model, model.optimizer))
    assert len(model.weights) == len(fit_runs.plain_model.weights) == 4
    model.export(str(tmp_path / "acc"), verbose=False)
    fit_runs.plain_model.export(str(tmp_path / "plain"), verbose=False)

    acc_vars = tf.saved_model.load(str(tmp_path / "acc")).variables
    plain_vars = tf.saved_model.load(str(tmp_path / "plain")).variables
    assert len(acc_vars) == len(plain_vars) == len(model.weights)
    assert variable_specs(acc_vars) == variable_specs(plain_vars) == variable_specs(model.weights)
    names = " ".join(v.name for v in acc_vars)
    assert "acc_grad" not in names and "micro_steps" not in names and "grad_received" not in names


def test_weights_saved_without_optimizer_hold_no_optimizer_state(fit_runs, tmp_path):
    acc_model = keras.models.load_model(fit_runs.keras_file)
    plain_model = fit_runs.plain_model
    bare = make_mlp(0)  # never compiled: no optimizer at all
    bare.save_weights(str(tmp_path / "bare.weights.h5"))
    expected = h5_datasets(tmp_path / "bare.weights.h5")
    assert not any(k.startswith("optimizer") for k in expected)

    # Keras 3 save_weights with the optimizer skipped.
    for name, m in [("acc", acc_model), ("plain", plain_model)]:
        keras.saving.save_weights(m, str(tmp_path / f"{name}.weights.h5"), objects_to_skip=[m.optimizer])
    assert h5_datasets(tmp_path / "acc.weights.h5") == expected
    assert h5_datasets(tmp_path / "plain.weights.h5") == h5_datasets(tmp_path / "acc.weights.h5")

    # Legacy HDF5 full-model save with include_optimizer=False.
    acc_model.save(str(tmp_path / "acc.h5"), include_optimizer=False)
    plain_model.save(str(tmp_path / "plain.h5"), include_optimizer=False)
    # (legacy files key datasets by layer name, which differs between models)
    acc_h5 = h5_datasets(tmp_path / "acc.h5")
    plain_h5 = h5_datasets(tmp_path / "plain.h5")
    assert sorted(acc_h5.values()) == sorted(plain_h5.values()) == sorted(expected.values())
    assert not any("optimizer" in k for k in acc_h5)


# ------------------------------------------------------------ wrong state
@pytest.mark.parametrize("when", ["built", "unbuilt"])
def test_loading_state_of_a_different_optimizer_raises_value_error(fit_runs, when):
    sgd = AccumulatingOptimizer(keras.optimizers.SGD(1e-2, momentum=0.9), gradient_accumulation_steps=N)
    model = compiled(seed=RESUME_SEED, optimizer=sgd)
    if when == "built":
        sgd.build(model.trainable_variables)
        with pytest.raises(ValueError, match="variables"):
            model.load_weights(fit_runs.weights_file)
    else:  # built by the load, which then fails at once
        with pytest.raises(ValueError, match="variables"):
            model.load_weights(fit_runs.weights_file)


def test_loading_weights_without_optimizer_state_keeps_a_fresh_optimizer(fit_runs, tmp_path):
    make_mlp(0).save_weights(str(tmp_path / "pretrained.weights.h5"))  # no optimizer state
    model = compiled(seed=RESUME_SEED)
    model.load_weights(str(tmp_path / "pretrained.weights.h5"))
    # Same initial weights (seed 0), fresh optimizer: the uninterrupted reference.
    fit(model, fit_runs.x, fit_runs.y)
    assert_same_state(state_of(model, model.optimizer), fit_runs.reference)


# ------------------------------------------------------------------ config
CONFIG_CASES = [
    (
        lambda: keras.optimizers.AdamW(
            learning_rate=keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=10, decay_rate=0.9),
            weight_decay=0.02,
            beta_1=0.8,
            amsgrad=True,
            clipnorm=1.5,
            use_ema=True,
            ema_momentum=0.95,
            ema_overwrite_frequency=7,
        ),
        3,
        "sum",
    ),
    (lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.5, nesterov=True), 2, "mean"),
]


@pytest.mark.parametrize("make, steps, reduction", CONFIG_CASES)
def test_config_round_trip_preserves_inner_optimizer_steps_and_reduction(make, steps, reduction):
    inner = make()
    opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=steps, reduction=reduction, name="acc")
    expected_inner = inner.get_config()

    assert keras.saving.get_registered_name(type(opt)) == "accum_optimizer>AccumulatingOptimizer"
    serialized = json.loads(json.dumps(keras.optimizers.serialize(opt)))
    assert serialized["registered_name"] == "accum_optimizer>AccumulatingOptimizer"
    for restored in (
        AccumulatingOptimizer.from_config(opt.get_config()),
        keras.optimizers.deserialize(serialized),
    ):
        assert type(restored) is type(opt)
        assert restored.gradient_accumulation_steps == steps
        assert restored.reduction == reduction
        assert restored.name == "acc"
        assert type(restored.inner_optimizer) is type(inner)
        assert restored.inner_optimizer.get_config() == expected_inner
    # Hand-checked values of the first case.
    if isinstance(inner, keras.optimizers.AdamW):
        cfg = restored.inner_optimizer.get_config()
        assert cfg["weight_decay"] == 0.02 and cfg["use_ema"] is True
        assert cfg["ema_momentum"] == 0.95 and cfg["ema_overwrite_frequency"] == 7
        assert cfg["clipnorm"] == 1.5 and cfg["amsgrad"] is True and cfg["beta_1"] == 0.8
        lr = restored.inner_optimizer._learning_rate
        assert isinstance(lr, keras.optimizers.schedules.ExponentialDecay)
        assert lr.get_config()["initial_learning_rate"] == 1e-3
        assert lr.get_config()["decay_steps"] == 10 and lr.get_config()["decay_rate"] == 0.9


def test_load_model_in_a_fresh_process_needs_only_the_package_import(fit_runs, tmp_path):
    out = tmp_path / "restored.npz"
    script = (
        "import sys, numpy as np, keras, accum_optimizer\n"
        "m = keras.models.load_model(sys.argv[1])\n"
        "o = m.optimizer\n"
        "assert type(o).__module__ == 'accum_optimizer.families.keras3', type(o)\n"
        "arrays = {'micro_steps': o.micro_steps.numpy(), 'iterations': o.iterations.numpy(),\n"
        "          'grad_received': o.grad_received.numpy()}\n"
        "arrays.update({f'acc_{i}': a.numpy() for i, a in enumerate(o.acc_grads)})\n"
        "arrays.update({f'weight_{i}': w.numpy() for i, w in enumerate(m.weights)})\n"
        "arrays.update({f'opt_{i}': v.numpy() for i, v in enumerate(o.variables)})\n"
        "np.savez(sys.argv[2], **arrays)\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", script, fit_runs.keras_file, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = fit_runs.at_save
    with np.load(out) as f:
        got = State(
            weights=[f[f"weight_{i}"] for i in range(len(want.weights))],
            opt_values=[f[f"opt_{i}"] for i in range(len(want.opt_values))],
            opt_specs=[(tuple(f[f"opt_{i}"].shape), str(f[f"opt_{i}"].dtype)) for i in range(len(want.opt_values))],
            opt_paths=want.opt_paths,
            micro_steps=int(f["micro_steps"]),
            iterations=int(f["iterations"]),
            acc_grads=[f[f"acc_{i}"] for i in range(len(want.acc_grads))],
            grad_received=f["grad_received"],
        )
        assert len(f.files) == 3 + len(want.acc_grads) + len(want.weights) + len(want.opt_values)
    assert_mid_window(got)
    assert_same_state(got, want)
