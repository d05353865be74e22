"""Composing with the rest of Keras: loss scaling, MultiOptimizer, weight-decay
exclusion, set_weights, array gradients.

References: the plain optimizer (or the same composition without accumulation)
trained with batch N*B, or a hand-derived value.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, max_abs_diff, train, weights


def test_loss_scale_optimizer_inside_is_rejected_with_the_fix():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"(?s)inner_optimizer.*LossScaleOptimizer\(AccumulatingOptimizer"):
        AccumulatingOptimizer(inner, gradient_accumulation_steps=4)


def test_loss_scale_optimizer_outside_matches_large_batch():
    # Loss scaling by a power of two is exact in float32, so the reference is
    # plain Adam at batch N*B and the comparison keeps the usual tolerance.
    n, mb, windows = 4, 3, 3
    x, y = make_data(n * mb * windows)
    ref, acc = make_mlp(), make_mlp()
    ref_opt = keras.optimizers.Adam(1e-2)
    acc_opt = keras.optimizers.LossScaleOptimizer(
        AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=n),
        initial_scale=2.0**12,
    )
    train(ref, ref_opt, x, y, n * mb, windows)
    train(acc, acc_opt, x, y, mb, n * windows)  # scales the loss via scale_loss
    assert int(acc_opt.inner_optimizer.micro_steps.numpy()) == n * windows
    assert int(acc_opt.iterations.numpy()) == windows
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-5


def test_mixed_float16_fit_wraps_accumulation_in_loss_scaling_once():
    n, mb = 4, 4
    x, y = make_data(n * mb * 3)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref, acc = make_mlp(dtype=None), make_mlp(dtype=None)
        ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        acc.compile(optimizer=AccumulatingOptimizer(keras.optimizers.SGD(0.1), n), loss="mse")
        ref.fit(x, y, batch_size=n * mb, shuffle=False, verbose=0)
        acc.fit(x, y, batch_size=mb, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(acc.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(acc.optimizer.inner_optimizer, AccumulatingOptimizer)
    assert int(acc.optimizer.inner_optimizer.micro_steps.numpy()) == 3 * n
    # float16 activations and gradients round differently in micro-batches of
    # 4 than in batches of 16: allow float16's epsilon (9.8e-4) relative to
    # how far training moved the weights, times 10 (measured: 1.6e-5 of a
    # 0.057 move). A double unscale would shrink the update ~32768-fold.
    moved = max_abs_diff(weights(ref), weights(make_mlp()))
    assert moved > 1e-2
    assert max_abs_diff(weights(ref), weights(acc)) <= 10 * float(np.finfo(np.float16).eps) * moved


def _multi():
    o = keras.optimizers
    return o.MultiOptimizer(
        lambda v: o.AdamW(1e-2, weight_decay=0.3) if "kernel" in v.path else o.SGD(0.1, momentum=0.9, weight_decay=0.2)
    )


def test_multi_optimizer_skips_variables_without_gradient_in_the_window():
    # Hand reference: variable b gets no gradient in the window, so neither
    # its AdamW update nor its weight decay may run; a gets SGD with
    # momentum 0.9 on g = (1 + 3) / 2 = 2: a = 1 - 0.1 * 2 - 0.1 * 0.2 * 1.
    a = keras.Variable(np.ones(2, "float32"), name="bias_a")
    b = keras.Variable(np.ones(2, "float32"), name="kernel_b")
    opt = AccumulatingOptimizer(_multi(), gradient_accumulation_steps=2)
    for g in (1.0, 3.0):
        opt.apply([tf.fill((2,), g), None], [a, b])
    np.testing.assert_array_equal(b.numpy(), np.ones(2, "float32"))
    np.testing.assert_allclose(a.numpy(), 1 - 0.1 * 2 - 0.1 * 0.2 * 1, rtol=1e-6)


def test_exclude_from_weight_decay_on_the_wrapper_reaches_the_inner():
    n, mb, windows = 4, 3, 3
    x, y = make_data(n * mb * windows)
    ref, acc = make_mlp(), make_mlp()
    ref_opt = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
    ref_opt.exclude_from_weight_decay(var_names=["bias"])
    acc_opt = AccumulatingOptimizer(keras.optimizers.AdamW(1e-2, weight_decay=0.5), n)
    acc_opt.exclude_from_weight_decay(var_names=["bias"])
    train(ref, ref_opt, x, y, n * mb, windows)
    train(acc, acc_opt, x, y, mb, n * windows)
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6


def test_set_weights_round_trips_the_whole_state():
    n, mb = 4, 3
    x, y = make_data(n * mb * 2)
    model = make_mlp()
    opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), n)
    train(model, opt, x, y, mb, n + 2)  # mid-window
    saved = [v.numpy() for v in opt.variables]
    clone = make_mlp()
    clone.set_weights(model.get_weights())
    opt2 = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), n)
    opt2.build(clone.trainable_variables)
    opt2.set_weights(saved)
    for a, b in zip(opt2.variables, saved):
        np.testing.assert_array_equal(a.numpy(), b)
    # micro_steps, grad_received, 4 accumulators; Adam: iterations, lr, 4 + 4
    # moments; mini_step, window_weight; 4 row trackers (one per variable).
    assert len(saved) == 2 + 4 + 2 + 8 + 2 + 4
    with pytest.raises(ValueError, match="expected 22, received 21"):
        opt2.set_weights(saved[:-1])
    train(model, opt, x[(n + 2) * mb :], y[(n + 2) * mb :], mb, n - 2)
    train(clone, opt2, x[(n + 2) * mb :], y[(n + 2) * mb :], mb, n - 2)
    assert max_abs_diff(weights(model), weights(clone)) == 0.0


def test_numpy_and_list_gradients_are_accepted():
    # Hand-computed: SGD lr 0.1, N = 2, mean of [1, 1, 1] and [3, 3, 3].
    w = keras.Variable(np.zeros(3, "float32"), name="w")
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)
    opt.apply([np.ones(3, "float64")], [w])
    opt.apply_gradients([([3.0, 3.0, 3.0], w)])
    np.testing.assert_allclose(w.numpy(), -0.1 * 2.0 * np.ones(3), rtol=1e-6)
