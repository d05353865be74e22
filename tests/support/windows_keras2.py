"""Issue 9 (weighted windows, flush, schedules) for the two Keras 2 families.

One implementation of each check, run by ``test_keras2_windows.py`` (the
new-API optimizers, ``tf.keras.optimizers.*`` where ``tf.keras`` is Keras 2)
and ``test_legacy_windows.py`` (``tf.keras.optimizers.legacy.*``, the
``OptimizerV2`` classes): each passes its family's optimizer classes
(``opt_module``: ``keras.optimizers`` or ``keras.optimizers.legacy``).

Reference everywhere: the plain inner optimizer trained on the large batch
the window stands for (the window's micro-batches concatenated), from the
same initial weights, run the same way (a ``tf.function`` custom loop), or
values computed by hand with SGD. Tolerance: float32 rounding of a few
updates (1e-6, as ``test_windows.py``; the weighted window forms
``c * (S / c)`` instead of ``S``).

Import only from modules that called ``require("keras2")`` or
``require("legacy")`` first.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference_keras2 import make_data, make_mlp, max_abs_diff, mse, weights

keras = tf.keras
TOL = 1e-6


def inner_state(opt) -> list:
    """The inner optimizer's variables (iterations, slots), as arrays."""
    inner = getattr(opt, "inner_optimizer", opt)
    return [np.array(v.numpy()) for v in (inner.weights if _is_legacy(inner) else inner.variables)]


def _is_legacy(opt) -> bool:
    return hasattr(opt, "_hyper")  # OptimizerV2


def _signature(model):
    """Batch-size-agnostic ``input_signature`` of a step of ``model``: one
    trace for micro-batches of every size (the checks stay fast)."""
    in_dim, out_dim = int(model.inputs[0].shape[-1]), int(model.outputs[0].shape[-1])
    return [tf.TensorSpec([None, in_dim], tf.float32), tf.TensorSpec([None, out_dim], tf.float32)]


def _weighted_step(model, opt, traced=True):
    """A custom-loop step: the gradient of the micro-batch's mean loss,
    applied with ``weight`` (a float32 scalar tensor, or ``None``: no
    ``weight`` argument at all). ``traced``: a ``tf.function`` (one trace
    per kind of weight), else eager."""

    def step(x, y, weight=None):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if weight is None:
            opt.apply_gradients(zip(grads, model.trainable_variables))
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)

    if not traced:
        return step
    weighted = tf.function(step, input_signature=_signature(model) + [tf.TensorSpec([], tf.float32)])
    plain = tf.function(lambda x, y: step(x, y), input_signature=_signature(model))
    return lambda x, y, weight=None: plain(x, y) if weight is None else weighted(x, y, weight)


def _plain_step(model, opt):
    @tf.function(input_signature=_signature(model))
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    return step


def _assert_same_training(ref_model, ref_opt, model, opt, tol=TOL):
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy())
    assert max_abs_diff(weights(ref_model), weights(model)) <= tol
    assert max_abs_diff(inner_state(ref_opt), inner_state(opt)) <= tol


# ------------------------------------------------------ (a) weighted windows
def check_unequal_micro_batches_equal_their_concatenation(opt_module):
    """N = 3, micro-batches of 4, 4, 2 | 3, 1, 5 with weight = sample count:
    each window equals one Adam step on the batch of its 10 (then 9)
    samples. Without the weights the run differs (the check can fail)."""
    sizes = [4, 4, 2, 3, 1, 5]
    x, y = make_data(sum(sizes))
    ref, ref_opt = make_mlp(0), opt_module.Adam(0.05)
    ref_step = _plain_step(ref, ref_opt)
    start = 0
    for w in range(2):
        n = sum(sizes[3 * w: 3 * w + 3])
        ref_step(x[start: start + n], y[start: start + n])
        start += n
    runs = {}
    for weighted in (True, False):
        model = make_mlp(0)
        opt = AccumulatingOptimizer(opt_module.Adam(0.05), gradient_accumulation_steps=3)
        step = _weighted_step(model, opt)
        start = 0
        for b in sizes:
            step(x[start: start + b], y[start: start + b], tf.constant(float(b)) if weighted else None)
            start += b
        runs[weighted] = (model, opt)
    _assert_same_training(ref, ref_opt, *runs[True])
    assert max_abs_diff(weights(ref), weights(runs[False][0])) > 100 * TOL


def check_sum_reduction_multiplies_each_micro_gradient(opt_module):
    """reduction="sum": the window applies Σ cᵢ·gᵢ (hand-computed, SGD)."""
    v = tf.Variable([1.0, -2.0])
    opt = AccumulatingOptimizer(opt_module.SGD(0.5), gradient_accumulation_steps=2, reduction="sum")
    g1, g2 = np.array([0.25, 1.0], "float32"), np.array([-2.0, 0.5], "float32")
    opt.apply_gradients([(tf.constant(g1), v)], weight=3)
    opt.apply_gradients([(tf.constant(g2), v)], weight=0.5)
    np.testing.assert_allclose(v.numpy(), np.array([1.0, -2.0]) - 0.5 * (3 * g1 + 0.5 * g2), rtol=0, atol=1e-7)


# ------------------------------------------------------------- (b) flush
def check_flush_normalises_by_what_the_window_holds(opt_module):
    """SGD(0.5), N = 4, hand-computed. Unweighted: 2 micro-steps, then
    flush applies (g1 + g2) / 2; weighted (1 and 3): (1·g1 + 3·g2) / 4. A
    second flush on the empty window is a no-op; the next window is a full
    window of 4 again. Eagerly and inside tf.function."""
    g1, g2 = np.array([1.0, 2.0], "float32"), np.array([3.0, -6.0], "float32")
    for traced in (False, True):
        for w1, w2 in ((None, None), (1.0, 3.0)):
            v = tf.Variable([1.0, -1.0])
            opt = AccumulatingOptimizer(opt_module.SGD(0.5), gradient_accumulation_steps=4)
            opt.apply_gradients([(tf.constant(g1), v)], weight=w1)
            opt.apply_gradients([(tf.constant(g2), v)], weight=w2)
            flush = tf.function(opt.flush) if traced else opt.flush
            flush()
            c1, c2 = (1.0, 1.0) if w1 is None else (w1, w2)
            expected = np.array([1.0, -1.0], "float32") - 0.5 * (c1 * g1 + c2 * g2) / (c1 + c2)
            np.testing.assert_allclose(v.numpy(), expected, rtol=0, atol=1e-7)
            assert (int(opt.iterations.numpy()), int(opt.micro_steps.numpy()), int(opt.mini_step.numpy())) == (1, 2, 0)
            flush()
            np.testing.assert_allclose(v.numpy(), expected, rtol=0, atol=1e-7)
            assert int(opt.iterations.numpy()) == 1
            for _ in range(3):
                opt.apply_gradients([(tf.constant(g1), v)])
            assert int(opt.iterations.numpy()) == 1
            opt.apply_gradients([(tf.constant(g1), v)])
            assert int(opt.iterations.numpy()) == 2


def check_flush_before_any_step_is_a_no_op(opt_module):
    v = tf.Variable([1.0, -1.0])
    opt = AccumulatingOptimizer(opt_module.SGD(0.5), gradient_accumulation_steps=4)
    opt.flush()  # not built: nothing to apply
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])  # closes the window
    before = v.numpy().copy()
    opt.flush()
    np.testing.assert_array_equal(v.numpy(), before)
    assert int(opt.iterations.numpy()) == 1


# ----------------------------------------------------- (c) zero-count window
def check_window_of_zero_counts_applies_nothing(opt_module):
    """Counts all 0 (mean and sum), Adam: iterations does not move, weights
    and inner state bitwise unchanged, accumulators zero; flush of such a
    window applies nothing either."""
    for reduction in ("mean", "sum"):
        x, y = make_data(8)
        model = make_mlp(0)
        opt = AccumulatingOptimizer(opt_module.Adam(0.1), gradient_accumulation_steps=2, reduction=reduction)
        step = _weighted_step(model, opt, traced=False)
        step(x[:4], y[:4], tf.constant(0.0))  # builds
        before, state = weights(model), inner_state(opt)
        step(x[4:], y[4:], tf.constant(0.0))  # closes the window
        step(x[:4], y[:4], tf.constant(0.0))
        opt.flush()
        assert int(opt.iterations.numpy()) == 0
        assert int(opt.mini_step.numpy()) == 0 and int(opt.micro_steps.numpy()) == 3
        for a, b in zip(before + state, weights(model) + inner_state(opt)):
            np.testing.assert_array_equal(a, b)
        for acc in opt.acc_grads:
            np.testing.assert_array_equal(acc.numpy(), 0)


# ------------------------------------------------------------ (d) schedule
def check_dict_schedule_equals_growing_large_batches(opt_module, schedule=None):
    """{0: 1, 2: 2} over 1 + 1 + 2 + 2 micro-batches of B = 2 equals the
    large-batch run with batch sizes B, B, 2B, 2B (SGD with momentum)."""
    schedule = schedule or {0: 1, 2: 2}
    b, per_update = 2, [1, 1, 2, 2]
    x, y = make_data(b * sum(per_update))
    ref, ref_opt = make_mlp(0), opt_module.SGD(0.1, momentum=0.9)
    ref_step = _plain_step(ref, ref_opt)
    start = 0
    for n in per_update:
        ref_step(x[start: start + n * b], y[start: start + n * b])
        start += n * b
    model = make_mlp(0)
    opt = AccumulatingOptimizer(opt_module.SGD(0.1, momentum=0.9), gradient_accumulation_steps=schedule)
    step = _plain_step(model, opt)
    for k in range(sum(per_update)):
        step(x[k * b: (k + 1) * b], y[k * b: (k + 1) * b])
    _assert_same_training(ref, ref_opt, model, opt)
    assert int(opt.iterations.numpy()) == 4 and int(opt.micro_steps.numpy()) == 6


def check_schedule_config_round_trips(opt_module):
    """A dict schedule survives get_config -> JSON -> from_config (string
    keys) and still closes windows at the same micro-steps; an unregistered
    callable refuses get_config with a message naming the fix."""
    opt = AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps={0: 1, 2: 2})
    config = json.loads(json.dumps(opt.get_config()))
    assert config["gradient_accumulation_steps"] == {"0": 1, "2": 2}
    again = type(opt).from_config(config)
    assert again.gradient_accumulation_steps == {0: 1, 2: 2}
    v = tf.Variable(0.0)
    counts = []
    for _ in range(6):
        again.apply_gradients([(tf.constant(1.0), v)])
        counts.append(int(again.iterations.numpy()))
    assert counts == [1, 2, 2, 3, 3, 4]
    fn = AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps=lambda u: 2)
    with pytest.raises(ValueError, match="not a registered Keras object"):
        fn.get_config()


def check_callable_schedule_receives_the_update_index(opt_module):
    """N(u) = u + 1: windows of 1, 2, 3 micro-steps (updates after
    micro-steps 1, 3, 6)."""
    seen = []

    def n(update):
        seen.append(update.dtype)
        return update + 1

    v = tf.Variable(0.0)
    opt = AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps=n)
    counts = []
    for _ in range(6):
        opt.apply_gradients([(tf.constant(1.0), v)])
        counts.append(int(opt.iterations.numpy()))
    assert counts == [1, 1, 2, 2, 2, 3]
    assert set(seen) == {tf.int64}


def check_bad_schedule_gets_a_clear_error(opt_module, bad, error, words):
    with pytest.raises(error, match="gradient_accumulation_steps") as info:
        AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps=bad)
    assert words in str(info.value)


BAD_SCHEDULES = [
    ({0: 1, 30: 2, 20: 4}, ValueError, "key 20"),
    ({1: 2}, ValueError, "first key 1"),
    ({0: 0}, ValueError, "{0: 0}"),
    ({0: 1.5}, TypeError, "{0: 1.5}"),
]


# ------------------------------------------------------------- (e) resume
def _resume_run(opt_module, save, restore, flush=True):
    """N = 3, micro-batches of 2: 2 micro-steps, flush, 2 micro-steps
    (mid-window: mini_step 2, micro_steps 4, so micro_steps % N is 1, not
    2), [save; restore into a fresh model and optimizer], 4 more
    micro-steps; micro-step k has weight k + 1. Without ``flush``: no flush
    and no weights (what state saved before either existed can hold).
    Returns the final model and optimizer."""
    x, y = make_data(16)
    model = make_mlp(0)
    opt = AccumulatingOptimizer(opt_module.Adam(0.05), gradient_accumulation_steps=3)
    step = _weighted_step(model, opt, traced=False)
    for k in range(2):
        step(x[2 * k: 2 * k + 2], y[2 * k: 2 * k + 2], tf.constant(float(k + 1)) if flush else None)
    if flush:
        opt.flush()
    for k in range(2, 4):
        step(x[2 * k: 2 * k + 2], y[2 * k: 2 * k + 2], tf.constant(float(k + 1)) if flush else None)
    if save is not None:
        saved = save(model, opt)
        model = make_mlp(7)  # other initial weights: the restore must overwrite them
        opt = AccumulatingOptimizer(opt_module.Adam(0.05), gradient_accumulation_steps=3)
        build(model, opt)
        restore(model, opt, saved)
        step = _weighted_step(model, opt, traced=False)
    for k in range(4, 8):
        step(x[2 * k: 2 * k + 2], y[2 * k: 2 * k + 2], tf.constant(float(k + 1)) if flush else None)
    return model, opt


@functools.lru_cache(maxsize=None)
def _straight_run(opt_module, flush):
    """The uninterrupted run of :func:`_resume_run` (computed once per module
    and ``flush``; only read)."""
    return _resume_run(opt_module, None, None, flush=flush)


def check_resume_after_a_flush_is_exact(opt_module, save, restore):
    """Save mid-window after a flush, restore into a fresh model and
    optimizer, continue: bitwise the uninterrupted run."""
    straight_model, straight = _straight_run(opt_module, True)
    model, opt = _resume_run(opt_module, save, restore)
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy()), int(opt.mini_step.numpy())) == (8, 3, 0)
    for a, b in zip(weights(straight_model) + inner_state(straight), weights(model) + inner_state(opt)):
        np.testing.assert_array_equal(a, b)


def check_state_saved_without_the_window_variables_resumes(opt_module, save_old, restore_old):
    """State saved before mini_step/window_weight existed (without them;
    unweighted, no flush, so the window's position was micro_steps % N)
    resumes exactly: the position comes back as micro_steps % N."""
    straight_model, straight = _straight_run(opt_module, False)
    model, opt = _resume_run(opt_module, save_old, restore_old, flush=False)
    for a, b in zip(weights(straight_model) + inner_state(straight), weights(model) + inner_state(opt)):
        np.testing.assert_array_equal(a, b)


def build(model, opt):
    """Create the optimizer's variables for the model (both families)."""
    if _is_legacy(opt):
        opt._create_all_weights(model.trainable_variables)
    else:
        opt.build(model.trainable_variables)


def checkpoint_saver(directory):
    """``(save, restore)`` through ``tf.train.Checkpoint(model=, optimizer=)``."""

    def save(model, opt):
        return tf.train.Checkpoint(model=model, optimizer=opt).write(str(directory / "ckpt"))

    def restore(model, opt, path):
        tf.train.Checkpoint(model=model, optimizer=opt).read(path).assert_consumed()

    return save, restore


def weights_saver(drop_window=False):
    """``(save, restore)`` through ``opt.get_weights()``/``set_weights`` (what
    Keras 2's ``.h5`` format stores) and the model's weights; with
    ``drop_window``, the optimizer's weights without ``mini_step`` and
    ``window_weight`` (the last two), as state saved before they existed."""

    def save(model, opt):
        state = [np.array(v.numpy()) for v in (opt.weights if _is_legacy(opt) else opt.variables)]
        if drop_window:
            assert state[-2].dtype == np.int64 and state[-1].dtype == np.float32  # mini_step, window_weight
            state = state[:-2]
        return model.get_weights(), state

    def restore(model, opt, saved):
        model.set_weights(saved[0])
        opt.set_weights(saved[1])

    return save, restore


# ------------------------------------------------------------ (f) bad weight
BAD_WEIGHTS = [
    (-1.0, ValueError, "weight=-1.0"),
    (float("nan"), ValueError, "weight=nan"),
    ([1.0, 2.0], ValueError, "shape (2,)"),
    ("3", TypeError, "weight='3'"),
    (True, TypeError, "weight=True"),
]


def check_bad_weight_gets_a_clear_error_and_changes_nothing(opt_module, bad, error, words):
    v = tf.Variable([1.0, 2.0])
    opt = AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps=2)
    opt.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    with pytest.raises(error, match="weight") as info:
        opt.apply_gradients([(tf.constant([1.0, 1.0]), v)], weight=bad)
    assert words in str(info.value)
    assert int(opt.micro_steps.numpy()) == 1 and int(opt.mini_step.numpy()) == 1


def check_negative_weight_in_tf_function_stops_the_step_before_any_write(opt_module):
    v = tf.Variable([1.0, 2.0])
    opt = AccumulatingOptimizer(opt_module.SGD(0.1), gradient_accumulation_steps=2)

    @tf.function
    def step(weight):
        opt.apply_gradients([(tf.constant([1.0, 1.0]), v)], weight=weight)

    step(tf.constant(2.0))
    with pytest.raises(tf.errors.InvalidArgumentError, match="weight"):
        step(tf.constant(-1.0))
    assert int(opt.micro_steps.numpy()) == 1 and float(opt.window_weight.numpy()) == 2.0
    np.testing.assert_array_equal(opt.acc_grads[0].numpy(), [2.0, 2.0])


# ------------------------------------------------- (g) MirroredStrategy
# Per micro-step, the samples of each replica (2 replicas): unequal counts.
# Window 1 (N = 2): 3 + 1, then 2 + 4 samples; then a partial window of
# 2 + 1 samples, flushed.
MIRRORED_SPLITS = [(3, 1), (2, 4), (2, 1)]


def check_weighted_windows_and_flush_under_mirrored_strategy(opt_module, strategy):
    """2 replicas with unequal sample counts per micro-step, each passing its
    own count as ``weight`` and its mean loss divided by the replica count
    (Keras' convention); a flush applies the partial window. Equals the
    plain inner optimizer on ONE device on batches of the window's 10, then
    3, samples. Tolerance 1e-5, as the other MirroredStrategy tests: the
    cross-replica all-reduce sums in another order than one device."""
    splits = MIRRORED_SPLITS
    x, y = make_data(sum(sum(s) for s in splits))
    ref, ref_opt = make_mlp(0), opt_module.Adam(0.05)
    ref_step = _plain_step(ref, ref_opt)
    ref_step(x[:10], y[:10])
    ref_step(x[10:13], y[10:13])
    with strategy.scope():
        model = make_mlp(0)
        opt = AccumulatingOptimizer(opt_module.Adam(0.05), gradient_accumulation_steps=2)

    def replica_step(xs, ys):
        with tf.GradientTape() as tape:
            loss = mse(ys, model(xs, training=True)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables), weight=tf.cast(tf.shape(xs)[0], tf.float32))

    def step(xs, ys):  # eagerly: one trace per micro-batch shape would dominate the test's time
        strategy.run(replica_step, args=(xs, ys))

    start = 0
    for counts in splits:
        bounds = [start, start + counts[0], start + sum(counts)]
        start = bounds[-1]

        def part(ctx, data, bounds=bounds):
            r = ctx.replica_id_in_sync_group
            return tf.constant(data[bounds[r]: bounds[r + 1]])

        step(strategy.experimental_distribute_values_from_function(lambda ctx: part(ctx, x)),
             strategy.experimental_distribute_values_from_function(lambda ctx: part(ctx, y)))
    assert int(opt.iterations.numpy()) == 1 and int(opt.mini_step.numpy()) == 1
    assert float(opt.window_weight.numpy()) == 3.0  # summed over the replicas on read
    opt.flush()
    assert int(opt.iterations.numpy()) == 2 and int(opt.mini_step.numpy()) == 0
    _assert_same_training(ref, ref_opt, model, opt, tol=1e-5)
