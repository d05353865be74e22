"""Between updates nothing moves; missing gradients lose nothing.

References: snapshots of the same run (bitwise), and the plain optimizer fed
the gradient of the window's mean loss, computed on one tape over all the
window's micro-batch losses (hand-built large batch), where a variable that no
micro-batch loss touches gets ``None`` exactly as in large-batch training.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, max_abs_diff, mse, weights


def _snapshot(model, opt):
    return [np.array(v.numpy()) for v in model.weights] + [
        np.array(v.numpy()) for v in opt.inner_optimizer.variables
    ]


def _assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _rich_inner():
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=10, warmup_target=2e-2, warmup_steps=2)
    return keras.optimizers.AdamW(schedule, weight_decay=0.05, use_ema=True, ema_momentum=0.9)


def test_non_update_micro_steps_leave_weights_and_inner_state_bitwise_untouched():
    n = 4
    model = make_mlp()
    opt = AccumulatingOptimizer(_rich_inner(), gradient_accumulation_steps=n)
    x, y = make_data(3 * 12)
    step = tf.function(
        lambda xb, yb: opt.apply_gradients(
            zip(_grads(model, xb, yb), model.trainable_variables)
        )
    )
    opt.build(model.trainable_variables)
    before = _snapshot(model, opt)
    for m in range(1, 13):
        step(tf.constant(x[(m - 1) * 3 : m * 3]), tf.constant(y[(m - 1) * 3 : m * 3]))
        after = _snapshot(model, opt)
        if m % n:
            _assert_bitwise_equal(before, after)
            # ...while the accumulators did move.
            assert any(np.any(a.numpy() != 0) for a in opt.acc_grads)
        else:
            assert max_abs_diff(before, after) > 0
            assert all(np.all(a.numpy() == 0) for a in opt.acc_grads)
        before = after


def _grads(model, xb, yb):
    with tf.GradientTape() as tape:
        loss = mse(yb, model(xb, training=True))
    return tape.gradient(loss, model.trainable_variables)


class _StateRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(_snapshot(self.model, self.model.optimizer))


def test_fit_non_update_batches_leave_inner_state_bitwise_untouched():
    n = 4
    model = make_mlp()
    model.compile(optimizer=AccumulatingOptimizer(_rich_inner(), n), loss="mse")
    x, y = make_data(2 * 12)
    rec = _StateRecorder()
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    assert len(rec.states) == 12
    for m in range(1, 12):
        if (m + 1) % n:  # batch m (0-based) is micro-step m+1
            _assert_bitwise_equal(rec.states[m - 1], rec.states[m])
        else:
            assert max_abs_diff(rec.states[m - 1], rec.states[m]) > 0


# ----------------------------------------------------------- missing grads
def _two_branch_model():
    """y = a(x) + b(x); b's kernel has a NonNeg constraint and starts with
    negative entries, so constraining it without an update would show."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    a = keras.layers.Dense(2, name="branch_a")
    b = keras.layers.Dense(
        2, name="branch_b", kernel_constraint=keras.constraints.NonNeg(),
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=5),
    )
    model = keras.Model(inp, [a(inp), b(inp)])
    return model


def _micro_loss(model, xb, yb, uses_b):
    pa, pb = model(xb)
    return mse(yb, pa + pb) if uses_b else mse(yb, pa)


# Which micro-steps of each window use branch b (N = 4). Window 0: never
# (b must not move at all); window 1: only the first micro-step; window 2:
# all but the last micro-step (Keras' built-in loses this sum); window 3: all.
PATTERN = [[False] * 4, [True, False, False, False], [True, True, True, False], [True] * 4]


def _run_pattern(model, step_fn, x, y, mb):
    k = 0
    for window in PATTERN:
        for uses_b in window:
            step_fn(model, x[k * mb : (k + 1) * mb], y[k * mb : (k + 1) * mb], uses_b)
            k += 1


def _reference_pattern(inner_fn, x, y, mb, n=4):
    model = _two_branch_model()
    opt = inner_fn()
    k = 0
    b_unconstrained_after_first_window = None
    for w, window in enumerate(PATTERN):
        with tf.GradientTape() as tape:
            losses = [
                _micro_loss(model, x[(k + i) * mb : (k + i + 1) * mb], y[(k + i) * mb : (k + i + 1) * mb], u)
                for i, u in enumerate(window)
            ]
            loss = tf.add_n(losses) / n  # mean over the window's N*B samples
        k += n
        grads = tape.gradient(loss, model.trainable_variables)
        assert (grads[2] is None) == (not any(window))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if w == 0:
            b_unconstrained_after_first_window = bool(np.any(model.get_layer("branch_b").kernel.numpy() < 0))
    assert b_unconstrained_after_first_window, "reference must leave b untouched in window 0"
    return model, opt


# The plain reference optimizer warns about b's missing gradient in window 0.
@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
@pytest.mark.parametrize("subset", [False, True], ids=["none_grads", "variable_subset"])
@pytest.mark.parametrize(
    "inner_fn",
    [
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.2),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1),
    ],
    ids=["adamw", "sgd_momentum"],
)
def test_missing_gradients_lose_nothing_and_unused_variables_do_not_move(inner_fn, subset):
    mb, n = 2, 4
    x, y = make_data(16 * mb, in_dim=4, out_dim=2)
    ref_model, ref_opt = _reference_pattern(inner_fn, x, y, mb)

    model = _two_branch_model()
    opt = AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=n)
    opt.build(model.trainable_variables)
    a_vars = [v for v in model.trainable_variables if "branch_a" in v.path]

    @tf.function
    def step(xb, yb, uses_b):
        with tf.GradientTape() as tape:
            loss = _micro_loss(model, xb, yb, uses_b)
        grads = tape.gradient(loss, model.trainable_variables)
        if subset and not uses_b:
            opt.apply_gradients(zip(grads[:2], a_vars))
        else:
            opt.apply_gradients(zip(grads, model.trainable_variables))

    def step_fn(model, xb, yb, uses_b):
        step(tf.constant(xb), tf.constant(yb), uses_b)

    _run_pattern(model, step_fn, x, y, mb)
    assert int(opt.iterations.numpy()) == 4
    assert max_abs_diff(weights(ref_model), weights(model)) <= 1e-6
    ref_state = [v.numpy() for v in ref_opt.variables]
    acc_state = [v.numpy() for v in opt.inner_optimizer.variables]
    assert max_abs_diff(ref_state, acc_state) <= 1e-6


def test_missing_gradient_on_last_micro_step_keeps_the_window_sum_by_hand():
    # Plain SGD, lr 1, N = 4, mean. Per micro-step gradients
    #   w: 1, 2, 3, None  ->  w = 0 - (1 + 2 + 3) / 4 = -1.5
    #   v: 10, None, 20, 30 -> v = 0 - (10 + 20 + 30) / 4 = -15
    w, v = keras.Variable(0.0, name="w"), keras.Variable(0.0, name="v")
    opt = AccumulatingOptimizer(keras.optimizers.SGD(1.0), gradient_accumulation_steps=4)
    for gw, gv in [(1.0, 10.0), (2.0, None), (3.0, 20.0), (None, 30.0)]:
        opt.apply([None if g is None else tf.constant(g) for g in (gw, gv)], [w, v])
    assert float(w.numpy()) == -1.5
    assert float(v.numpy()) == -15.0
    assert int(opt.iterations.numpy()) == 1


def test_trains_only_variables_whose_name_lacks_vgg():
    """The design's source document fine-tunes everything but the 'VGG'
    feature extractor: `apply_gradients` gets that subset only."""
    n, mb = 4, 3

    def model_fn():
        keras.utils.set_random_seed(11)
        inp = keras.Input((6,))
        h = keras.layers.Dense(5, activation="relu", name="VGG_features")(inp)
        out = keras.layers.Dense(3, name="head")(h)
        return keras.Model(inp, out)

    def trained_vars(model):
        return [v for v in model.trainable_variables if "VGG" not in v.path]

    x, y = make_data(3 * n * mb)
    ref, acc = model_fn(), model_fn()
    ref_opt = keras.optimizers.Adam(1e-2)
    acc_opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=n)

    def make_step(model, opt):
        tv = trained_vars(model)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb))
            opt.apply_gradients(zip(tape.gradient(loss, tv), tv))

        return step

    ref_step, acc_step = make_step(ref, ref_opt), make_step(acc, acc_opt)
    for s in range(3):
        ref_step(x[s * n * mb : (s + 1) * n * mb], y[s * n * mb : (s + 1) * n * mb])
    for s in range(3 * n):
        acc_step(x[s * mb : (s + 1) * mb], y[s * mb : (s + 1) * mb])
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6
    vgg = [v for v in acc.weights if "VGG" in v.path]
    init = [v for v in model_fn().weights if "VGG" in v.path]
    for v, v0 in zip(vgg, init):
        np.testing.assert_array_equal(v.numpy(), v0.numpy())
    # Accumulators exist only for the trained subset.
    assert len(acc_opt.acc_grads) == len(trained_vars(acc)) == 2
