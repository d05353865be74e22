"""Keras 3's own ways to windows that equal any large batch (issue 9):
``CountedLoss`` and sample weights in ``fit``, masked tokens,
``FlushPartialWindow``, the weight through ``apply`` and ``apply_gradients``,
under MirroredStrategy and mixed precision, and schedules in Keras 3's own
serialization and ``.weights.h5`` files. (Weighted windows, flush, resume and
accumulation schedules in a custom loop, as every family has them:
tests/contract/.)

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

from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow
from support.reference import make_data, make_mlp, max_abs_diff, weights
from support.tokens import padded as _padded, token_data as _token_data

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


def _token_model(seed=0, vocab=12):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(vocab, 6, mask_zero=True),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(5),
    ])


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


@pytest.mark.parametrize("save_at", [2, 7])  # at a schedule boundary (update 2 starts), mid-window
def test_schedule_resume_is_exact(save_at, tmp_path):
    ref, ref_opt, model, opt = _schedule_run({0: 1, 2: 2, 4: 4}, [1, 1, 2, 2, 4, 4], b=2, save_at=save_at,
                                             tmp_path=tmp_path)
    _assert_same_training(ref, ref_opt, model, opt)


def test_dict_schedule_survives_json_config():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps={0: 1, 10: 4})
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    again = keras.saving.deserialize_keras_object(config)
    assert again.gradient_accumulation_steps == {0: 1, 10: 4}


def test_registered_callable_schedule_round_trips():
    @keras.saving.register_keras_serializable(package="test_windows")
    def doubling(update):
        return tf.minimum(tf.constant(1, tf.int64) << (update // 2), 8)

    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=doubling)
    again = AccumulatingOptimizer.from_config(json.loads(json.dumps(opt.get_config())))
    assert again.gradient_accumulation_steps is doubling
