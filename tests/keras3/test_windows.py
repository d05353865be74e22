"""Windows that equal any large batch: weighted micro-batches, the partial
window, accumulation schedules (issue 9).

Reference everywhere: the same model (same initial weights, same sample
order) trained with the plain inner optimizer on the large batch the window
stands for, with the same loss (``fit(..., batch_size=N*B)``, or the window's
micro-batches concatenated). Tolerances are float32 rounding of a few
updates (1e-6; the weighted window forms ``c * (S / c)`` instead of ``S``).
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import accum_optimizer
from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow
from support.reference import make_data, make_mlp, max_abs_diff, weights

TOL = 1e-6


def _state(opt):
    """The inner optimizer's variables (moments, iterations, ...), as arrays."""
    inner = getattr(opt, "inner_optimizer", opt)
    return [np.array(v.numpy()) for v in inner.variables]


def _assert_same_training(ref_model, ref_opt, model, opt, tol=TOL):
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy())
    assert max_abs_diff(weights(ref_model), weights(model)) <= tol
    assert max_abs_diff(_state(ref_opt), _state(opt)) <= tol


class _Record(keras.callbacks.Callback):
    """Weights and inner-optimizer state at every epoch end (after any
    callback before it in the list)."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((weights(self.model), _state(self.model.optimizer)))


def _assert_same_epochs(ref, acc, tol=TOL):
    assert len(ref.epochs) == len(acc.epochs)
    for (rw, rs), (aw, as_) in zip(ref.epochs, acc.epochs):
        assert max_abs_diff(rw, aw) <= tol
        assert max_abs_diff(rs, as_) <= tol


# ------------------------------------------------------ 1. weighted windows
def test_unequal_micro_batches_equal_one_batch_of_ten():
    """(a) 10 samples, B = 4, N = 3: micro-batches of 4, 4, 2 (Keras' last
    batch is smaller) with CountedLoss equal one batch of 10, every epoch."""
    x, y = make_data(10)
    ref, ref_rec = make_mlp(0), _Record()
    ref.compile(keras.optimizers.Adam(0.05), "mse")
    ref.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0, callbacks=[ref_rec])
    model, rec = make_mlp(0), _Record()
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=3)
    model.compile(opt, CountedLoss("mse"))
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[rec])
    _assert_same_epochs(ref_rec, rec)
    _assert_same_training(ref, ref.optimizer, model, opt)
    # Without the count the last micro-batch of 2 weighs as much as one of 4.
    plain = make_mlp(0)
    plain.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.05), 3), "mse")
    plain.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert max_abs_diff(weights(ref), weights(plain)) > 100 * TOL


def test_custom_loop_weight_equals_the_large_batch():
    """apply(grads, vars, weight=c) and apply_gradients(..., weight=c) with
    each micro-batch's sample count: the window equals the concatenated
    batch. Micro-batch sizes 3, 1, 5 | 2, 2, 6."""
    sizes = [3, 1, 5, 2, 2, 6]
    x, y = make_data(sum(sizes))
    ref, model = make_mlp(0), make_mlp(0)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=3)
    mse = keras.losses.MeanSquaredError()

    def grads(m, xs, ys):
        with tf.GradientTape() as tape:
            loss = mse(ys, m(xs))
        return tape.gradient(loss, m.trainable_variables)

    start = 0
    for w in range(2):
        n = sum(sizes[3 * w : 3 * w + 3])
        ref_opt.apply(grads(ref, x[start : start + n], y[start : start + n]), ref.trainable_variables)
        for k, b in enumerate(sizes[3 * w : 3 * w + 3]):
            g = grads(model, x[start : start + b], y[start : start + b])
            if k % 2:
                opt.apply_gradients(zip(g, model.trainable_variables), weight=b)
            else:
                opt.apply(g, model.trainable_variables, weight=tf.constant(b, tf.float32))
            start += b
    _assert_same_training(ref, ref_opt, model, opt)


def _token_data(seed, n, max_len=9, vocab=12):
    """Sequences of very different lengths (1..max_len), ids in 1..vocab-1,
    padded with 0; targets are per-token classes."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, max_len + 1, size=n)
    lengths[0], lengths[1] = 1, max_len
    x = np.zeros((n, max_len), "int32")
    y = np.zeros((n, max_len), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, vocab, size=length)
        y[i, :length] = rng.randint(0, 5, size=length)
    return x, y


def _token_model(seed=0, vocab=12):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(vocab, 6, mask_zero=True),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(5),
    ])


def _padded(x, y, batch):
    """Each batch padded to its own longest sequence (what padded_batch does)."""
    lengths = (x > 0).sum(axis=1)

    def gen():
        for i in range(0, len(x), batch):
            t = int(lengths[i : i + batch].max())
            yield x[i : i + batch, :t], y[i : i + batch, :t]

    spec = (tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None, None), tf.int32))
    batches = -(-len(x) // batch)
    return tf.data.Dataset.from_generator(gen, output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(batches))


def test_masked_tokens_equal_the_large_batch_masked_mean():
    """(b) padded token sequences, Embedding(mask_zero=True), lengths 1..9
    per sequence, each micro-batch padded to its own length: CountedLoss
    counts unmasked tokens and the window equals the large batch's masked
    mean over all its tokens. (SGD with momentum: Keras 3's Adam squares
    each slice of a sparse gradient with repeated ids before combining them,
    so the large batch's own Embedding update is not a function of its
    gradient; see README, "What exactly like the large batch assumes".)"""
    x, y = _token_data(0, 24)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = _token_model()
    ref.compile(keras.optimizers.SGD(0.2, momentum=0.5), loss)
    ref.fit(_padded(x, y, 12), epochs=2, verbose=0)
    model = _token_model()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.2, momentum=0.5), gradient_accumulation_steps=3)
    model.compile(opt, CountedLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    model.fit(_padded(x, y, 4), epochs=2, verbose=0)
    _assert_same_training(ref, ref.optimizer, model, opt)
    unweighted = _token_model()
    unweighted.compile(AccumulatingOptimizer(keras.optimizers.SGD(0.2, momentum=0.5), 3), loss)
    unweighted.fit(_padded(x, y, 4), epochs=2, verbose=0)
    assert max_abs_diff(weights(ref), weights(unweighted)) > 100 * TOL


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight"])
def test_sample_weight_with_zeros_equals_the_large_batch(reduction):
    """(c) sample_weight with zeros, whole micro-batches of zeros included:
    the count follows the loss's own reduction (number of samples for
    "sum_over_batch_size", the sum of the weights for
    "mean_with_sample_weight"); 10 samples, B = 2, N = 5."""
    x, y = make_data(20)
    sw = np.array([1, 0, 2, 0.5, 0, 0, 3, 1, 0, 1, 1, 1, 0, 0, 2, 2, 0.5, 0, 1, 0], "float32")
    ref = make_mlp(0)
    ref.compile(keras.optimizers.Adam(0.05), keras.losses.MeanSquaredError(reduction=reduction))
    ref.fit(x, y, sample_weight=sw, batch_size=10, epochs=2, shuffle=False, verbose=0)
    model = make_mlp(0)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=5)
    model.compile(opt, CountedLoss(keras.losses.MeanSquaredError(reduction=reduction)))
    model.fit(x, y, sample_weight=sw, batch_size=2, epochs=2, shuffle=False, verbose=0)
    _assert_same_training(ref, ref.optimizer, model, opt)


def test_all_masked_micro_batch_contributes_nothing():
    """(d) a micro-batch whose every token is masked has count 0: it adds
    nothing, divides by nothing, and the window equals the batch of the
    other micro-batches."""
    x, y = _token_data(1, 6)
    x_empty = np.zeros((2, 4), "int32")
    y_empty = np.zeros((2, 4), "int32")
    loss = CountedLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref, model = _token_model(), _token_model()
    ref_opt = keras.optimizers.SGD(0.2, momentum=0.5)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.2, momentum=0.5), gradient_accumulation_steps=3)

    def step(m, o, xs, ys):
        with tf.GradientTape() as tape:
            value = loss(ys, m(xs))
        o.apply(tape.gradient(value, m.trainable_variables), m.trainable_variables)

    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = plain(y, ref(x))
    ref_opt.apply(tape.gradient(value, ref.trainable_variables), ref.trainable_variables)
    step(model, opt, x[:3], y[:3])
    step(model, opt, x_empty, y_empty)
    step(model, opt, x[3:], y[3:])
    assert np.isfinite(np.concatenate([w.ravel() for w in weights(model)])).all()
    _assert_same_training(ref, ref_opt, model, opt)


def test_window_of_zero_counts_applies_nothing():
    """A window whose counts are all 0 (mean and sum): the inner optimizer
    is not called, iterations does not move, weights and slots are bitwise
    unchanged, and the next window starts clean."""
    for reduction in ("mean", "sum"):
        x, y = make_data(8)
        model = make_mlp(0)
        opt = AccumulatingOptimizer(keras.optimizers.Adam(0.1), gradient_accumulation_steps=2, reduction=reduction)
        opt.build(model.trainable_variables)
        before, state = weights(model), _state(opt)
        for k in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(y[k * 4 : (k + 1) * 4] - model(x[k * 4 : (k + 1) * 4])))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables, weight=0)
        assert int(opt.iterations.numpy()) == 0
        assert int(opt.mini_step.numpy()) == 0 and int(opt.micro_steps.numpy()) == 2
        for a, b in zip(before + state, weights(model) + _state(opt)):
            np.testing.assert_array_equal(a, b)
        for acc in opt.acc_grads:
            np.testing.assert_array_equal(acc.numpy(), 0)


def test_sum_reduction_multiplies_each_micro_gradient_by_its_weight():
    """reduction="sum": the window applies Σ cᵢ·gᵢ (hand-computed with SGD)."""
    v = keras.Variable([1.0, -2.0])
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=2, reduction="sum")
    g1, g2 = np.array([0.25, 1.0], "float32"), np.array([-2.0, 0.5], "float32")
    opt.apply([tf.constant(g1)], [v], weight=3)
    opt.apply([tf.constant(g2)], [v], weight=0.5)
    np.testing.assert_allclose(v.numpy(), np.array([1.0, -2.0]) - 0.5 * (3 * g1 + 0.5 * g2), rtol=0, atol=1e-7)


def test_weight_one_everywhere_equals_no_weight():
    """weight=1 on every micro-step is the unweighted window, bitwise."""
    x, y = make_data(12)
    results = []
    for weight in (None, 1):
        model = make_mlp(0)
        opt = AccumulatingOptimizer(keras.optimizers.Adam(0.1), gradient_accumulation_steps=3)
        for k in range(6):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(y[2 * k : 2 * k + 2] - model(x[2 * k : 2 * k + 2])))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables, weight=weight)
        results.append(weights(model))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad, error, words", [
    (-1.0, ValueError, "weight=-1.0"),
    (float("nan"), ValueError, "weight=nan"),
    (float("inf"), ValueError, "weight=inf"),
    ([1.0, 2.0], ValueError, "shape (2,)"),
    ("3", TypeError, "weight='3'"),
    (True, TypeError, "weight=True"),
])
def test_bad_weight_gets_a_clear_error_and_changes_nothing(bad, error, words):
    v = keras.Variable([1.0, 2.0])
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)
    opt.apply([tf.constant([1.0, 1.0])], [v])
    with pytest.raises(error, match="weight") as info:
        opt.apply([tf.constant([1.0, 1.0])], [v], weight=bad)
    assert words in str(info.value)
    assert int(opt.micro_steps.numpy()) == 1 and int(opt.mini_step.numpy()) == 1


def test_negative_weight_inside_tf_function_stops_the_step_before_any_write():
    v = keras.Variable([1.0, 2.0])
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)

    @tf.function
    def step(weight):
        opt.apply([tf.constant([1.0, 1.0])], [v], weight=weight)

    step(tf.constant(2.0))
    acc_before = [a.numpy().copy() for a in opt.acc_grads]
    with pytest.raises(tf.errors.InvalidArgumentError, match="weight"):
        step(tf.constant(-1.0))
    assert int(opt.micro_steps.numpy()) == 1 and float(opt.window_weight.numpy()) == 2.0
    for a, b in zip(acc_before, opt.acc_grads):
        np.testing.assert_array_equal(a, b.numpy())


def test_masked_tokens_under_mirrored_strategy_equal_the_single_device_large_batch(strategy):
    """(e) MirroredStrategy with 2 replicas, unequal token counts per replica
    (each replica's half of a micro-batch has its own lengths): the counts of
    all replicas and micro-steps enter one normalisation, and the window
    equals the single-device large batch's masked mean."""
    x, y = _token_data(2, 24)
    ref = _token_model()
    ref.compile(keras.optimizers.SGD(0.2, momentum=0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(_padded(x, y, 12), epochs=1, verbose=0)
    with strategy.scope():
        model = _token_model()
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.2, momentum=0.5), gradient_accumulation_steps=3)
        model.compile(opt, CountedLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    # Per replica: 2 sequences of the 4 in each micro-batch; the halves have
    # different numbers of tokens.
    model.fit(_padded(x, y, 4), epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2
    assert max_abs_diff(weights(ref), weights(model)) <= 1e-5


def test_counts_reach_the_optimizer_through_the_loss_scale_optimizer_of_mixed_float16():
    """compile under "mixed_float16" puts a LossScaleOptimizer outside, which
    applies inside a cond branch: the count still arrives. 10 samples, B = 4,
    N = 4: after the epoch's 3 micro-batches (4, 4, 2) the window's count is
    10 (it would be 3 without the counts)."""
    x, y = make_data(10)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = make_mlp(0, dtype=None)
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=4)
        model.compile(opt, CountedLoss("mse"))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy(previous)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(opt.mini_step.numpy()) == 3
    assert float(opt.window_weight.numpy()) == 10.0


# -------------------------------------------------------- 2. partial window
def test_flush_at_epoch_end_equals_fit_with_the_large_batch_every_epoch():
    """10 samples, N = 3, B = 2 (5 micro-batches per epoch: windows of 3 and
    2) with FlushPartialWindow equal fit(batch_size=6) (batches of 6 and 4),
    weights and all optimizer state, at every epoch end."""
    x, y = make_data(10)
    ref, ref_rec = make_mlp(0), _Record()
    ref.compile(keras.optimizers.AdamW(0.05, weight_decay=0.1), "mse")
    ref.fit(x, y, batch_size=6, epochs=3, shuffle=False, verbose=0, callbacks=[ref_rec])
    model, rec = make_mlp(0), _Record()
    opt = AccumulatingOptimizer(keras.optimizers.AdamW(0.05, weight_decay=0.1), gradient_accumulation_steps=3)
    model.compile(opt, "mse")
    model.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0, callbacks=[FlushPartialWindow(), rec])
    _assert_same_epochs(ref_rec, rec)
    _assert_same_training(ref, ref.optimizer, model, opt)
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy()), int(opt.mini_step.numpy())) == (15, 6, 0)


def test_flush_with_weighting_when_the_batch_size_does_not_divide_the_data():
    """11 samples, B = 2, N = 3: micro-batches 2,2,2 | 2,2,1 per epoch; with
    CountedLoss and flush, equal to fit(batch_size=6) (6 and 5), with
    validation after each epoch seeing the flushed weights."""
    x, y = make_data(11)
    xv, yv = make_data(5, seed=7)
    ref = make_mlp(0)
    ref.compile(keras.optimizers.Adam(0.05), "mse")
    h_ref = ref.fit(x, y, batch_size=6, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv))
    model = make_mlp(0)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=3)
    model.compile(opt, CountedLoss("mse"))
    h = model.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv),
                  callbacks=[FlushPartialWindow()])
    _assert_same_training(ref, ref.optimizer, model, opt)
    np.testing.assert_allclose(h.history["val_loss"], h_ref.history["val_loss"], rtol=1e-5)


def test_weighted_sparse_window_with_flush_equals_the_large_batch():
    """Plain SGD gets the window of an Embedding as IndexedSlices over its
    touched rows (the sparse window); with token counts and a flush at the
    epoch end it still equals the large batch's masked mean: 26 sequences,
    B = 4, N = 3 (windows of 12, 12 and 2 sequences) against batches of 12."""
    x, y = _token_data(3, 26)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = _token_model()
    ref.compile(keras.optimizers.SGD(0.3), loss)
    ref.fit(_padded(x, y, 12), epochs=2, verbose=0)
    model = _token_model()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.3), gradient_accumulation_steps=3)
    model.compile(opt, CountedLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)))
    model.fit(_padded(x, y, 4), epochs=2, verbose=0, callbacks=[FlushPartialWindow()])
    _assert_same_training(ref, ref.optimizer, model, opt)


def test_flush_normalises_by_what_the_window_holds_eagerly_and_in_tf_function():
    """Hand-computed with SGD: after 2 micro-steps of a window of 4, flush
    applies (g1 + g2) / 2; a second flush on the empty window is a no-op;
    the same inside tf.function."""
    for traced in (False, True):
        v = keras.Variable([1.0, -1.0])
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.5), gradient_accumulation_steps=4)
        g1, g2 = np.array([1.0, 2.0], "float32"), np.array([3.0, -6.0], "float32")
        opt.apply([tf.constant(g1)], [v])
        opt.apply([tf.constant(g2)], [v])
        flush = tf.function(opt.flush) if traced else opt.flush
        flush()
        expected = np.array([1.0, -1.0], "float32") - 0.5 * (g1 + g2) / 2
        np.testing.assert_allclose(v.numpy(), expected, rtol=0, atol=1e-7)
        assert (int(opt.iterations.numpy()), int(opt.micro_steps.numpy()), int(opt.mini_step.numpy())) == (1, 2, 0)
        flush()
        np.testing.assert_allclose(v.numpy(), expected, rtol=0, atol=1e-7)
        assert int(opt.iterations.numpy()) == 1
        # The next window is a full window of 4 again.
        for _ in range(3):
            opt.apply([tf.constant(g1)], [v])
        assert int(opt.iterations.numpy()) == 1
        opt.apply([tf.constant(g1)], [v])
        assert int(opt.iterations.numpy()) == 2


def test_flush_under_mirrored_strategy_equals_the_single_device_large_batch(strategy):
    x, y = make_data(20)
    ref = make_mlp(0)
    ref.compile(keras.optimizers.Adam(0.05), "mse")
    ref.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = make_mlp(0)
        opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=3)
        model.compile(opt, "mse")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[FlushPartialWindow()])
    assert int(opt.iterations.numpy()) == 4
    assert max_abs_diff(weights(ref), weights(model)) <= 1e-5


def test_resume_after_a_flush_is_exact(tmp_path):
    """Save after a flush and mid-window, load into a fresh model, go on:
    the same as training without interruption (the window's position is
    mini_step, saved and restored, not micro_steps % N)."""
    x, y = make_data(14)

    def run(stop=None):
        model = make_mlp(0)
        model.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=3), "mse")
        model.fit(x[:10], y[:10], batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[FlushPartialWindow()])
        model.fit(x[10:], y[10:], batch_size=2, epochs=1, shuffle=False, verbose=0)  # 2 of 3 micro-steps
        if stop:
            model.save(tmp_path / "m.keras")
            model = keras.models.load_model(tmp_path / "m.keras")
        model.fit(x[:6], y[:6], batch_size=2, epochs=1, shuffle=False, verbose=0)
        return model

    straight, resumed = run(), run(stop=True)
    opt = resumed.optimizer
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy()), int(opt.mini_step.numpy())) == (10, 3, 2)
    for a, b in zip(weights(straight) + _state(straight.optimizer), weights(resumed) + _state(opt)):
        np.testing.assert_array_equal(a, b)


def test_flush_partial_window_needs_an_accumulating_optimizer():
    model = make_mlp(0)
    model.compile(keras.optimizers.Adam(), "mse")
    x, y = make_data(4)
    with pytest.raises(ValueError, match="FlushPartialWindow needs"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[FlushPartialWindow()])


# ------------------------------------------------- 3. accumulation schedules
def _schedule_run(schedule, sizes_per_update, b, extra_updates=0, save_at=None, tmp_path=None):
    """Train with `schedule` on micro-batches of b; reference: plain SGD with
    momentum on batches of b*N(u). Returns (ref weights, acc weights, opt)."""
    total_micro = sum(sizes_per_update)
    x, y = make_data(b * total_micro)
    ref, model = make_mlp(0), make_mlp(0)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=schedule)

    def grads(m, xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ys - m(xs)))
        return tape.gradient(loss, m.trainable_variables)

    start = 0
    for n in sizes_per_update:
        ref_opt.apply(grads(ref, x[start : start + n * b], y[start : start + n * b]), ref.trainable_variables)
        start += n * b
    start = 0
    for k in range(total_micro):
        if save_at is not None and k == save_at:
            path = tmp_path / f"resume{k}.weights.h5"
            model.compile(opt, "mse")
            model.save_weights(path)
            model = make_mlp(5)
            opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=schedule)
            model.compile(opt, "mse")
            model.load_weights(path)
        opt.apply(grads(model, x[start : start + b], y[start : start + b]), model.trainable_variables)
        start += b
    return ref, ref_opt, model, opt


def test_dict_schedule_equals_growing_large_batches():
    """{0: 1, 2: 2, 4: 4} over 2 + 4 + 8 + 4*2 micro-batches equals the
    large-batch run with batch sizes B, B, 2B, 2B, 4B, 4B, 4B, 4B."""
    ref, ref_opt, model, opt = _schedule_run({0: 1, 2: 2, 4: 4}, [1, 1, 2, 2, 4, 4, 4, 4], b=2)
    _assert_same_training(ref, ref_opt, model, opt)
    assert int(opt.iterations.numpy()) == 8


@pytest.mark.parametrize("save_at", [2, 7])  # at a schedule boundary (update 2 starts), mid-window
def test_schedule_resume_is_exact(save_at, tmp_path):
    ref, ref_opt, model, opt = _schedule_run({0: 1, 2: 2, 4: 4}, [1, 1, 2, 2, 4, 4], b=2, save_at=save_at,
                                             tmp_path=tmp_path)
    _assert_same_training(ref, ref_opt, model, opt)


def test_callable_schedule_receives_the_update_index():
    seen = []

    def n_of(update):
        seen.append(update.dtype)
        return tf.where(update < 2, tf.constant(1, tf.int64), tf.constant(3, tf.int64))

    ref, ref_opt, model, opt = _schedule_run(n_of, [1, 1, 3, 3], b=2)
    _assert_same_training(ref, ref_opt, model, opt)
    assert seen and all(d == tf.int64 for d in seen)


@pytest.mark.parametrize("bad, error, words", [
    ({0: 1, 30: 2, 20: 4}, ValueError, "key 20 (value 4) after key 30"),
    ({1: 2}, ValueError, "first key 1"),
    ({0: 0}, ValueError, "{0: 0}"),
    ({0: 2.0}, TypeError, "{0: 2.0}"),
    ({0.5: 2}, TypeError, "key 0.5"),
    ({}, ValueError, "empty dict"),
    (2.0, TypeError, "gradient_accumulation_steps=2.0"),
])
def test_bad_schedule_gets_a_clear_error(bad, error, words):
    with pytest.raises(error, match="gradient_accumulation_steps") as info:
        AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=bad)
    assert words in str(info.value)


def test_dict_schedule_survives_json_config():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps={0: 1, 10: 4})
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    again = keras.saving.deserialize_keras_object(config)
    assert again.gradient_accumulation_steps == {0: 1, 10: 4}


def test_unregistered_callable_schedule_refuses_get_config():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=lambda u: 2)
    with pytest.raises(ValueError, match="not a registered Keras object"):
        opt.get_config()


def test_registered_callable_schedule_round_trips():
    @keras.saving.register_keras_serializable(package="test_windows")
    def doubling(update):
        return tf.minimum(tf.constant(1, tf.int64) << (update // 2), 8)

    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=doubling)
    again = AccumulatingOptimizer.from_config(json.loads(json.dumps(opt.get_config())))
    assert again.gradient_accumulation_steps is doubling


# ------------------------------------------------------------ property test
# Each example trains two eager models: a third of the profile's examples
# (13 in CI's profile, 50 in `make test-full`).
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(
    data=st.data(),
    schedule=st.one_of(st.integers(1, 4), st.just({0: 1, 1: 3}), st.just({0: 2, 2: 1, 3: 4})),
    b=st.integers(1, 4),
    n_samples=st.integers(3, 24),
    weighting=st.sampled_from(["none", "sample_weight", "mean_with_sample_weight"]),
)
def test_property_windows_equal_the_large_batch(data, schedule, b, n_samples, weighting):
    """hypothesis: N or a schedule, B, the dataset size (B need not divide
    it), sample weights (with zeros); micro-batches of B with CountedLoss
    and a flush at the end equal the large batches the windows stand for."""
    x, y = make_data(n_samples, in_dim=3, out_dim=2, seed=data.draw(st.integers(0, 50)))
    sw = None
    if weighting != "none":
        sw = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=n_samples,
                                         max_size=n_samples)), "float32")
    reduction = "mean_with_sample_weight" if weighting == "mean_with_sample_weight" else "sum_over_batch_size"
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    counted = CountedLoss(keras.losses.MeanSquaredError(reduction=reduction))
    ref, model = make_mlp(3, in_dim=3, out_dim=2), make_mlp(3, in_dim=3, out_dim=2)
    ref_opt = keras.optimizers.Adam(0.05)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.05), gradient_accumulation_steps=schedule)
    n_of = accum_optimizer._accumulation.window_length(accum_optimizer._accumulation.validate_accumulation_schedule(schedule))

    def apply(o, m, lo, s, e):
        with tf.GradientTape() as tape:
            value = lo(y[s:e], m(x[s:e]), sample_weight=None if sw is None else sw[s:e])
        o.apply(tape.gradient(value, m.trainable_variables), m.trainable_variables)

    # Reference: batches of b*N(u) (the last one what is left). A batch
    # whose count is 0 (all sample weights 0 under mean_with_sample_weight)
    # has no samples to learn from: the window applies nothing (documented),
    # so the reference skips it too and the update index stays.
    start, update = 0, 0
    while start < n_samples:
        n = int(n_of(update)) if callable(n_of) else n_of
        end = min(n_samples, start + n * b)
        if not (reduction == "mean_with_sample_weight" and sw[start:end].sum() == 0):
            apply(ref_opt, ref, loss, start, end)
            update += 1
        start = end
    for s in range(0, n_samples, b):
        apply(opt, model, counted, s, min(n_samples, s + b))
    opt.flush()
    _assert_same_training(ref, ref_opt, model, opt, tol=2e-6)
