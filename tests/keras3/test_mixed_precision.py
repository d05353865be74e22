"""Mixed precision and numerics: a loss scale that changes inside a window, the
``nonfinite=`` overflow policy, the accumulator dtype, exact resume under
``mixed_float16``, and equivalence under ``mixed_float16``/``mixed_bfloat16``.

References: values derived by hand (a one-weight linear model whose gradient
is its input, so every micro-gradient is known exactly), the uninterrupted run
(resume), or the same dtype policy trained with batch N*B (equivalence).
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import (
    UpdateWeights, epsilon_16, make_data, make_mlp, max_abs_diff, mixed_precision_tolerance, weights,
)
from support.distribution import ReductionCounter

LSO = keras.optimizers.LossScaleOptimizer


@contextlib.contextmanager
def dtype_policy(name):
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def linear_model():
    """``y = w * x`` with ``w = 0``: for the loss ``mean(y)`` over a batch of
    one sample, the gradient of ``w`` is exactly ``x``."""
    return keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )


def prediction_loss(y_true, y_pred):
    return y_pred


def run_micro_steps(model, optimizer, xs, mode):
    """One ``apply_gradients`` per sample of ``xs``, eagerly or in a tf.function."""

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(tf.reshape(x, (1, 1)), training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if mode == "function":
        step = tf.function(step)
    for x in xs:
        step(tf.constant(x, tf.float32))


def count(variable):
    return None if variable is None else int(variable.numpy())


# ------------------------------------------------- 1. loss scale in a window
@pytest.fixture(scope="module")
def growing_scale_runs():
    """SGD(1.0), N = 2, true micro-gradients 1 and 1, a LossScaleOptimizer
    outside with initial scale 4 that doubles after every finite step. By
    hand: the first micro-gradient is computed at scale 4 (scaled 4, unscaled
    4 / 4 = 1), the scale grows to 8, the second at scale 8 (8 / 8 = 1): the
    window gradient is (1 + 1) / 2 = 1 and w = 0 - 1.0 * 1 = -1.0. An
    implementation that adds the scaled gradients and unscales the sum with
    the scale at the update gets (4 + 8) / 8 / 2 = 0.75, w = -0.75."""
    runs = {}
    model = linear_model()
    lso = LSO(AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2), initial_scale=4.0, dynamic_growth_steps=1)
    run_micro_steps(model, lso, [1.0], "function")
    after_first = lso.inner_optimizer.acc_grads[0].numpy().item()
    run_micro_steps(model, lso, [1.0], "function")
    runs["custom_loop"] = (model, lso, after_first)

    with dtype_policy("mixed_float16"):
        model = linear_model()
        lso = LSO(AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2), initial_scale=4.0, dynamic_growth_steps=1)
        model.compile(optimizer=lso, loss=prediction_loss)
        seen = []

        class AfterFirst(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 0:
                    seen.append(lso.inner_optimizer.acc_grads[0].numpy().item())

        ones = np.ones((2, 1), "float32")
        model.fit(ones, ones, batch_size=1, shuffle=False, verbose=0, callbacks=[AfterFirst()])
    assert model.optimizer is lso  # compile keeps a LossScaleOptimizer it is given
    runs["fit_mixed_float16"] = (model, lso, seen[0])
    return runs


@pytest.mark.parametrize("mode", ["custom_loop", "fit_mixed_float16"])
def test_each_micro_gradient_is_unscaled_by_its_own_loss_scale(growing_scale_runs, mode):
    model, lso, after_first = growing_scale_runs[mode]
    assert after_first == 1.0  # accumulated unscaled, at scale 4
    assert int(lso.iterations.numpy()) == 1
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), [[-1.0]])


@pytest.mark.parametrize("mode", ["custom_loop", "fit_mixed_float16"])
def test_loss_scale_growth_counts_micro_steps(growing_scale_runs, mode):
    # Two finite micro-steps, one update: with dynamic_growth_steps=1 the
    # scale doubled twice, 4 -> 8 -> 16 (counting updates would give 8).
    _, lso, _ = growing_scale_runs[mode]
    assert int(lso.inner_optimizer.micro_steps.numpy()) == 2
    assert float(lso.dynamic_scale.numpy()) == 4.0 * 2**2
    assert int(lso.step_counter.numpy()) == 0


# --------------------------------------------------- 2. the nonfinite policy
# Micro-gradients (the inputs; /16 keeps x * 2**15 finite in float16): NaN in
# micro-batch 2 of the first window of N = 4. SGD(1.0) from w = 0.
X = np.array([1, np.nan, 3, 5, 7, 9, 11, 13], "float32") / 16
N_NAN = 4


def hand_expected(policy, lso):
    """(w, micro_steps, iterations, skipped_micro_steps, skipped_windows,
    accumulator) after the 8 micro-batches, by hand."""
    if policy == "propagate" and not lso:
        # Window 1 = mean(1, NaN, 3, 5): w is NaN, and stays NaN.
        return np.nan, 8, 2, None, None, 0.0
    if policy in ("propagate", "skip_micro_step"):
        # Micro-batch 2 dropped (by the LossScaleOptimizer, or here): window 1
        # is micro-batches 1, 3, 4, 5; 6, 7, 8 are accumulated, not applied.
        # ("propagate" keeps no skip counters.)
        skipped, windows = (None, None) if policy == "propagate" else (1, 0)
        return -np.mean(X[[0, 2, 3, 4]]), 7, 1, skipped, windows, X[5] + X[6] + X[7]
    # skip_window: window 1 (micro-batches 1-4) discarded; window 2 applied.
    return -np.mean(X[4:8]), 8, 1, 1, 1, 0.0


class SkipCounters(keras.callbacks.Callback):
    """The README's callback: the skip counters in the logs (History,
    CSVLogger, TensorBoard)."""

    def on_epoch_end(self, epoch, logs=None):
        opt = self.model.optimizer
        if isinstance(opt, keras.optimizers.LossScaleOptimizer):
            opt = opt.inner_optimizer
        if logs is not None and opt.skipped_micro_steps is not None:
            logs["skipped_micro_steps"] = int(opt.skipped_micro_steps.numpy())
            logs["skipped_windows"] = int(opt.skipped_windows.numpy())


def nan_run(policy, lso, mode):
    acc = AccumulatingOptimizer(keras.optimizers.SGD(1.0), N_NAN, nonfinite=policy)
    if mode == "fit":
        # With a LossScaleOptimizer: the one compile adds under mixed_float16.
        with dtype_policy("mixed_float16" if lso else "float32"):
            model = linear_model()
            model.compile(optimizer=acc, loss=prediction_loss)
            history = model.fit(
                X[:, None], X[:, None], batch_size=1, shuffle=False, verbose=0, callbacks=[SkipCounters()]
            )
        assert isinstance(model.optimizer, LSO) == lso
        return model, acc, model.optimizer, history.history
    model = linear_model()
    opt = LSO(acc) if lso else acc
    run_micro_steps(model, opt, X, mode)
    return model, acc, opt, None


@pytest.mark.parametrize("mode", ["eager", "function", "fit"])
@pytest.mark.parametrize("lso", [False, True], ids=["no_lso", "lso"])
@pytest.mark.parametrize("policy", ["propagate", "skip_micro_step", "skip_window"])
def test_nonfinite_micro_batch_follows_the_policy(policy, lso, mode):
    model, acc, opt, history = nan_run(policy, lso, mode)
    w, micro_steps, iterations, skipped, windows, accumulated = hand_expected(policy, lso)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), [[w]])
    assert count(acc.micro_steps) == micro_steps
    assert count(acc.iterations) == iterations  # what schedules and EMA see
    assert count(acc.skipped_micro_steps) == skipped
    assert count(acc.skipped_windows) == windows
    np.testing.assert_array_equal(acc.acc_grads[0].numpy(), [[accumulated]])
    if lso:  # the LossScaleOptimizer skipped the NaN step: its scale halved once
        assert float(opt.dynamic_scale.numpy()) == opt.initial_scale / 2
    if history is not None and skipped is not None:
        assert history["skipped_micro_steps"] == [skipped]
        assert history["skipped_windows"] == [windows]


def test_the_loss_scale_optimizer_compile_adds_is_found_when_it_builds():
    acc = AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2, nonfinite="skip_window")
    with dtype_policy("mixed_float16"):
        model = linear_model()
        model.compile(optimizer=acc, loss=prediction_loss)
        assert acc.outer_optimizer is None
        model.optimizer.build(model.trainable_variables)
    assert isinstance(model.optimizer, LSO) and acc.outer_optimizer is model.optimizer
    plain = AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2)
    plain.build(model.trainable_variables)
    assert plain.outer_optimizer is None


def test_nonfinite_argument_is_validated_and_serialized():
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of .*Received: nonfinite='skip'"):
        AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2, nonfinite="skip")
    opt = AccumulatingOptimizer(keras.optimizers.SGD(1.0), 2, nonfinite="skip_window", accumulator_dtype="float64")
    restored = AccumulatingOptimizer.from_config(opt.get_config())
    assert restored.nonfinite == "skip_window" and restored.accumulator_dtype == "float64"
    config = opt.get_config()
    del config["nonfinite"], config["accumulator_dtype"]  # a 0.1.0 config
    restored = AccumulatingOptimizer.from_config(config)
    assert restored.nonfinite == "propagate" and restored.accumulator_dtype is None


# ------------------------------ distribution (conftest's 2-replica strategy)
# Micro-batches of 2 samples, one per replica; NaN only in replica 1's sample
# of micro-batch 2. Each replica's gradient is x_r / 2 (Keras divides the loss
# by the replica count), so micro-batch k's gradient is the mean of its pair.
PAIRS = np.array([[1, 1], [3, np.nan], [3, 5], [5, 7], [7, 9], [9, 11], [11, 13], [13, 15]], "float32") / 16


def mirrored_expected(policy, lso):
    means = PAIRS.mean(axis=1)  # NaN for micro-batch 2
    if policy == "skip_micro_step":
        return -np.mean(means[[0, 2, 3, 4]]), 7, 1
    if policy == "skip_window":
        return -np.mean(means[4:8]), 8, 1
    # Keras' LossScaleOptimizer reads the finiteness of replica 0's gradients
    # only ("grads is all-reduced across replicas", which it is not here), so
    # it lets replica 1's NaN through: the window, then w, is NaN.
    return np.nan, 8, 2


@pytest.mark.parametrize(
    "policy, lso",
    [("skip_micro_step", False), ("skip_window", False), ("skip_window", True), ("propagate", True)],
)
def test_every_replica_skips_a_micro_step_that_is_non_finite_on_one(strategy, monkeypatch, policy, lso):
    counter = ReductionCounter(monkeypatch, strategy)

    def mirrored_fit(nonfinite, x):
        with strategy.scope():
            model = linear_model()
            acc = AccumulatingOptimizer(keras.optimizers.SGD(1.0), N_NAN, nonfinite=nonfinite)
            model.compile(optimizer=LSO(acc, initial_scale=2.0) if lso else acc, loss=prediction_loss)
        model.fit(tf.data.Dataset.from_tensor_slices((x, x)).batch(2), verbose=0)
        return model, acc

    measure = policy == "skip_micro_step"
    if measure:
        # Control: the default policy on finite data adds no reduction of its own.
        mirrored_fit("propagate", np.nan_to_num(PAIRS).reshape(-1, 1))
        control = counter.counts()
        for variable in (counter.all_reduce, counter.batch_reduce_to, counter.reduce_to):
            variable.assign(0)
    model, acc = mirrored_fit(policy, PAIRS.reshape(-1, 1))
    w, micro_steps, iterations = mirrored_expected(policy, lso)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), [[w]])
    assert count(acc.micro_steps) == micro_steps and count(acc.iterations) == iterations
    if policy != "propagate":
        assert count(acc.skipped_micro_steps) == 1
        # Both replicas dropped the NaN micro-batch: no NaN in either slot.
        for component in acc.acc_grads[0].value.values:
            assert np.all(np.isfinite(component.numpy()))
    if measure:
        # One scalar all-reduce per micro-step for the finiteness flag (on top
        # of what the control run reduces: Keras' logs); the gradients are
        # still all-reduced once per update.
        counts = counter.counts()
        assert control["batch_reduce_to"] == 2 and counts["batch_reduce_to"] == iterations
        assert counts["reduce_to"] == control["reduce_to"] + len(PAIRS)


# -------------------------------------------------- 3. the accumulator dtype
@pytest.mark.parametrize(
    "accumulator_dtype, expected",
    # float32 holds every integer up to 2**24. bfloat16 keeps 8 significant
    # bits: 256 + 1 = 257 lies halfway between 256 and 258 and rounds to even,
    # 256, so the running sum stalls at 256.
    [(None, 512.0), ("float32", 512.0), ("bfloat16", 256.0)],
)
def test_512_bfloat16_gradients_of_one_sum_to_512_in_the_default_accumulator(accumulator_dtype, expected):
    w = keras.Variable(np.zeros(3), dtype="bfloat16", name="w")
    opt = AccumulatingOptimizer(
        keras.optimizers.SGD(1.0), 512, reduction="sum", accumulator_dtype=accumulator_dtype
    )
    opt.build([w])
    one = tf.ones((3,), tf.bfloat16)

    @tf.function
    def window_but_last():
        for _ in tf.range(511):
            opt.apply([one], [w])

    window_but_last()
    assert opt.acc_grads[0].dtype == (accumulator_dtype or "float32")
    np.testing.assert_array_equal(opt.acc_grads[0].numpy().astype(np.float32), [min(511.0, expected)] * 3)
    opt.apply([one], [w])  # the 512th: the update applies the window sum once
    assert w.dtype == "bfloat16"
    np.testing.assert_array_equal(w.numpy().astype(np.float32), [-expected] * 3)


def test_default_accumulator_dtype_is_float32_for_16_bit_variables_else_the_variables_own():
    dtypes = ["float16", "bfloat16", "float32", "float64"]
    variables = [keras.Variable(np.zeros(2), dtype=d, name=f"v_{d}") for d in dtypes]
    default = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2)
    default.build(variables)
    assert [a.dtype for a in default.acc_grads] == ["float32", "float32", "float32", "float64"]
    explicit = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2, accumulator_dtype="float64")
    explicit.build(variables)
    assert [a.dtype for a in explicit.acc_grads] == ["float64"] * 4
    # Each window (mean of gradients 1 and 1) reaches the inner optimizer in
    # the variable's own dtype: the same as plain SGD given gradient 1 once
    # per window, in that dtype. Two windows per optimizer.
    reference = [keras.Variable(np.zeros(2), dtype=d, name=f"r_{d}") for d in dtypes]
    plain = keras.optimizers.SGD(0.1)
    for opt in (default, explicit):
        for _ in range(2):
            opt.apply([tf.ones(2, d) for d in dtypes], variables)
        plain.apply([tf.ones(2, d) for d in dtypes], reference)
    for v, r in zip(variables, reference):
        assert v.dtype == r.dtype
        np.testing.assert_array_equal(v.numpy(), r.numpy())
    with pytest.raises(ValueError, match=r"`accumulator_dtype` must be .*Received: accumulator_dtype='int32'"):
        AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2, accumulator_dtype="int32")


# ------------------------------------- 4. exact resume under mixed_float16
RN, RB = 4, 4  # gradient_accumulation_steps, micro-batch
SAVE_AT, TOTAL = 6, 12  # micro-steps: one update, then two into the second window
RESUME_SEED = 123  # every resumed model starts from other weights


def loss_scaled(nonfinite="propagate"):
    # dynamic_growth_steps=2: the scale doubles every other micro-step (16 at
    # the start, 128 at the checkpoint, 1024 at the end), so a resume that
    # restarted it, or its step counter, would end elsewhere.
    inner = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), RN, nonfinite=nonfinite)
    return LSO(inner, initial_scale=2.0**4, dynamic_growth_steps=2)


def mp_compiled(seed):
    model = make_mlp(seed, dtype=None)  # the global policy: mixed_float16
    model.compile(optimizer=loss_scaled(), loss="mse", jit_compile=False)
    return model


def full_state(model, optimizer=None):
    """Model weights, then every optimizer variable: the LossScaleOptimizer's
    own (step counter, scale), the wrapper's (counters, accumulators) and the
    inner Adam's, in order."""
    optimizer = optimizer or model.optimizer
    values = [np.array(w.numpy()) for w in model.weights] + [np.array(v.numpy()) for v in optimizer.variables]
    return values, float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy())


def assert_bitwise_equal(actual, expected):
    (values, scale, step), (ref_values, ref_scale, ref_step) = actual, expected
    assert (scale, step) == (ref_scale, ref_step)
    assert [(v.shape, v.dtype) for v in values] == [(v.shape, v.dtype) for v in ref_values]
    for i, (a, e) in enumerate(zip(values, ref_values)):
        np.testing.assert_array_equal(a, e, err_msg=f"state {i}")


@pytest.fixture(scope="module")
def mp_fit_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed_float16")
    x, y = make_data(TOTAL * RB)
    with dtype_policy("mixed_float16"):
        ref = mp_compiled(0)
        ref.fit(x, y, batch_size=RB, shuffle=False, verbose=0)
        at_save = {}

        class Snapshot(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == SAVE_AT - 1:
                    at_save["state"] = full_state(self.model)

        run = mp_compiled(0)
        run.fit(x, y, batch_size=RB, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(str(d / "mp_{batch}.keras"), save_freq=SAVE_AT),
            keras.callbacks.ModelCheckpoint(str(d / "mp_{batch}.weights.h5"), save_freq=SAVE_AT,
                                            save_weights_only=True),
            Snapshot(),
        ])
    reference = full_state(ref)
    assert_bitwise_equal(full_state(run), reference)  # saving does not perturb the run
    # The loss scale moved before and after the checkpoint.
    assert (at_save["state"][1], reference[1]) == (2.0**4 * 2**3, 2.0**4 * 2**6)
    assert int(ref.optimizer.inner_optimizer.micro_steps.numpy()) == TOTAL
    return dict(x=x, y=y, reference=reference, at_save=at_save["state"],
                keras_file=str(d / f"mp_{SAVE_AT}.keras"), weights_file=str(d / f"mp_{SAVE_AT}.weights.h5"))


def fit_rest(model, runs):
    model.fit(runs["x"][SAVE_AT * RB:], runs["y"][SAVE_AT * RB:], batch_size=RB, shuffle=False, verbose=0)


def test_resume_from_keras_file_under_mixed_float16_is_bitwise_identical(mp_fit_runs):
    with dtype_policy("mixed_float16"):
        model = keras.models.load_model(mp_fit_runs["keras_file"])
        assert isinstance(model.optimizer, LSO)
        assert_bitwise_equal(full_state(model), mp_fit_runs["at_save"])
        fit_rest(model, mp_fit_runs)
    assert_bitwise_equal(full_state(model), mp_fit_runs["reference"])


def test_resume_from_weights_into_a_fresh_model_restores_the_loss_scale(mp_fit_runs):
    with dtype_policy("mixed_float16"):
        model = mp_compiled(RESUME_SEED)  # compiled, never trained: nothing built
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.load_weights(mp_fit_runs["weights_file"])
        # Keras itself skips the unbuilt LossScaleOptimizer's state ...
        assert any("Skipping variable loading for optimizer 'loss_scale_optimizer" in str(w.message)
                   for w in caught)
        # ... the wrapper saved it with its own, builds both at load (as the
        # first step would) and restores it at once.
        assert model.optimizer.built
        assert_bitwise_equal(full_state(model), mp_fit_runs["at_save"])
        fit_rest(model, mp_fit_runs)
    assert_bitwise_equal(full_state(model), mp_fit_runs["reference"])


def test_resume_from_tf_checkpoint_under_mixed_float16_is_bitwise_identical(tmp_path):
    x, y = make_data(TOTAL * RB)

    def loop(model, opt, start, stop):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(yb - tf.cast(model(xb, training=True), tf.float32)))
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for s in range(start, stop):
            step(tf.constant(x[s * RB:(s + 1) * RB]), tf.constant(y[s * RB:(s + 1) * RB]))

    with dtype_policy("mixed_float16"):
        ref, ref_opt = make_mlp(0, dtype=None), loss_scaled()
        loop(ref, ref_opt, 0, TOTAL)
        run, run_opt = make_mlp(0, dtype=None), loss_scaled()
        loop(run, run_opt, 0, SAVE_AT)
        path = tf.train.Checkpoint(model=run, optimizer=run_opt).save(str(tmp_path / "ckpt"))
        model, opt = make_mlp(RESUME_SEED, dtype=None), loss_scaled()
        status = tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
        loop(model, opt, SAVE_AT, TOTAL)  # the first step builds, and restores
        status.assert_consumed()
    assert float(ref_opt.dynamic_scale.numpy()) == 2.0**4 * 2**6
    assert_bitwise_equal(full_state(model, opt), full_state(ref, ref_opt))


def test_resume_inside_a_poisoned_window_still_discards_it(tmp_path):
    # skip_window, NaN in micro-batch 2; saved after micro-batch 3 (the window
    # is marked, not yet closed), resumed into a fresh model and optimizer.
    def fresh(seed_weight):
        model = linear_model()
        model.layers[0].kernel.assign([[seed_weight]])
        opt = AccumulatingOptimizer(keras.optimizers.SGD(1.0), N_NAN, nonfinite="skip_window")
        model.compile(optimizer=opt, loss=prediction_loss)  # save_weights includes the optimizer
        return model, opt

    model, opt = fresh(0.0)
    run_micro_steps(model, opt, X[:3], "function")
    assert (count(opt.micro_steps), count(opt.window_poisoned), count(opt.skipped_micro_steps)) == (3, 1, 1)
    model.save_weights(str(tmp_path / "poisoned.weights.h5"))
    resumed, resumed_opt = fresh(7.0)
    resumed.load_weights(str(tmp_path / "poisoned.weights.h5"))
    run_micro_steps(resumed, resumed_opt, X[3:], "function")
    w, micro_steps, iterations, skipped, windows, _ = hand_expected("skip_window", False)
    np.testing.assert_array_equal(resumed.layers[0].kernel.numpy(), [[w]])
    assert (count(resumed_opt.micro_steps), count(resumed_opt.iterations)) == (micro_steps, iterations)
    assert (count(resumed_opt.skipped_micro_steps), count(resumed_opt.skipped_windows)) == (skipped, windows)


def test_state_saved_without_skip_counters_loads_into_a_skipping_optimizer(tmp_path):
    # "propagate" saves the layout of 0.1.0 (no skip counters); a skipping
    # optimizer loads it, counters from 0, and on finite gradients trains
    # exactly as the uninterrupted default would.
    x, y = make_data(TOTAL * RB)

    def train(model, opt, start, stop):
        for s in range(start, stop):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(y[s * RB:(s + 1) * RB] - model(x[s * RB:(s + 1) * RB])))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    ref, ref_opt = make_mlp(0), AccumulatingOptimizer(keras.optimizers.Adam(1e-2), RN)
    train(ref, ref_opt, 0, TOTAL)
    old, old_opt = make_mlp(0), AccumulatingOptimizer(keras.optimizers.Adam(1e-2), RN)
    old.compile(optimizer=old_opt, loss="mse")
    train(old, old_opt, 0, SAVE_AT)
    old.save_weights(str(tmp_path / "old_layout.weights.h5"))
    new, new_opt = make_mlp(RESUME_SEED), AccumulatingOptimizer(keras.optimizers.Adam(1e-2), RN, nonfinite="skip_window")
    new.compile(optimizer=new_opt, loss="mse")
    new.load_weights(str(tmp_path / "old_layout.weights.h5"))
    train(new, new_opt, SAVE_AT, TOTAL)
    counters = [new_opt.skipped_micro_steps, new_opt.skipped_windows, new_opt.window_poisoned]
    trackers = list(new_opt.touched_rows)
    # Saved after the inner optimizer's, before the window's mini_step/window_weight and the row trackers.
    t = len(trackers)
    assert [id(v) for v in new_opt.variables[-5 - t:]] == [
        id(v) for v in counters + [new_opt.mini_step, new_opt.window_weight] + trackers]
    assert [count(v) for v in counters] == [0, 0, 0]
    assert len(new_opt.variables) == len(ref_opt.variables) + 3
    without_counters = [v for v in new_opt.variables if not any(v is c for c in counters)]
    for a, e in zip(weights(new) + weights(without_counters), weights(ref) + weights(ref_opt.variables), strict=True):
        np.testing.assert_array_equal(a, e)
    # The other way round would lose the skip state: refused, with the reason.
    back = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), RN)
    back.build(new.trainable_variables)
    with pytest.raises(ValueError, match="nonfinite policy"):
        back.load_own_variables({str(i): v.numpy() for i, v in enumerate(new_opt.variables)})


# ----------------------- 5. equivalence under mixed_float16 / mixed_bfloat16
EQ_N, EQ_B, EQ_UPDATES = 4, 8, 20
EQ_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


@pytest.mark.parametrize("opt_name", sorted(EQ_OPTIMIZERS))
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_fit_matches_the_same_policy_at_batch_n_times_b(policy, opt_name):
    """Tolerance: :func:`reference.mixed_precision_tolerance`, the first-order
    effect on the weights of gradients that differ by the policy's 16-bit
    rounding (eps = 2**-10 for float16, 2**-7 for bfloat16), accumulated over
    the 20 updates through SGD's momentum or Adam's normalisation."""
    make_inner = EQ_OPTIMIZERS[opt_name]
    x, y = make_data(EQ_N * EQ_B * EQ_UPDATES)
    recorder = UpdateWeights()
    with dtype_policy(policy):
        ref = make_mlp(0, hidden=16, dtype=None)
        ref.compile(optimizer=make_inner(), loss="mse", jit_compile=False)
        ref.fit(x, y, batch_size=EQ_N * EQ_B, shuffle=False, verbose=0, callbacks=[recorder])
        acc = make_mlp(0, hidden=16, dtype=None)
        opt = AccumulatingOptimizer(make_inner(), EQ_N)
        acc.compile(optimizer=opt, loss="mse", jit_compile=False)
        acc.fit(x, y, batch_size=EQ_B, shuffle=False, verbose=0)
    assert ref.layers[0].compute_dtype == policy.split("_")[1] and ref.layers[0].kernel.dtype == "float32"
    assert int(opt.micro_steps.numpy()) == EQ_N * EQ_UPDATES and int(opt.iterations.numpy()) == EQ_UPDATES
    tol = mixed_precision_tolerance(make_inner().get_config(), epsilon_16(policy), recorder.history)
    moved = max_abs_diff(weights(ref), weights(make_mlp(0, hidden=16)))
    assert moved > tol  # the comparison means something
    assert max_abs_diff(weights(ref), weights(acc)) <= tol
