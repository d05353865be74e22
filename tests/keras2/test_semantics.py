"""Keras 2 new API: the learning rate and its callbacks, ``fit`` (also
XLA-compiled) and a LossScaleOptimizer outside against the large batch;
Nadam when the first variable has no gradient in a window, traced. (The
properties every family has, nothing moving between updates under ``fit``
among them, are in tests/contract/.)

References: the plain optimizer trained
by ``fit`` at batch N*B, or fed each window's mean gradient (``None`` for a
variable no micro-batch gave one) in the same mode; hand-derived values.
"""

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.reference import make_data, make_mlp, max_abs_diff, mse, optimizer_state, weights  # noqa: E402

keras = tf.keras
o = keras.optimizers


# --------------------------------------------------------- learning rate
def test_learning_rate_and_lr_forward_to_the_inner_optimizer():
    inner = o.Adam(1e-3)
    opt = AccumulatingOptimizer(inner, 4)
    assert opt.learning_rate is inner.learning_rate and opt.lr is inner.learning_rate
    opt.learning_rate = 0.05
    np.testing.assert_allclose(inner.learning_rate.numpy(), 0.05)
    opt.lr = 0.25
    np.testing.assert_allclose(inner.learning_rate.numpy(), 0.25)
    keras.backend.set_value(opt.lr, 0.5)  # what Keras 2's callbacks do
    np.testing.assert_allclose(inner.learning_rate.numpy(), 0.5)
    scheduled = AccumulatingOptimizer(o.Adam(o.schedules.ExponentialDecay(0.1, 1, 0.5)), 4)
    with pytest.raises(TypeError, match="not settable"):  # as the plain inner raises
        scheduled.learning_rate = 0.1


def _fit_pair(callback_fn, epochs, lr=0.1):
    n, mb, windows = 4, 3, 2
    x, y = make_data(n * mb * windows)
    ref, acc = make_mlp(0), make_mlp(0)
    ref.compile(optimizer=o.SGD(lr, momentum=0.5), loss="mse")
    acc.compile(optimizer=AccumulatingOptimizer(o.SGD(lr, momentum=0.5), n), loss="mse")
    ref_hist = ref.fit(x, y, batch_size=n * mb, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback_fn()])
    acc_hist = acc.fit(x, y, batch_size=mb, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback_fn()])
    return ref, acc, ref_hist, acc_hist


def test_learning_rate_scheduler_callback_drives_the_inner_learning_rate():
    rates = [0.1, 0.05, 0.01]
    ref, acc, ref_hist, acc_hist = _fit_pair(
        lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: rates[epoch]), epochs=3
    )
    np.testing.assert_allclose(acc_hist.history["lr"], rates, rtol=1e-6)
    np.testing.assert_allclose(acc_hist.history["lr"], ref_hist.history["lr"])
    np.testing.assert_allclose(acc.optimizer.inner_optimizer.learning_rate.numpy(), rates[-1], rtol=1e-6)
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6


def test_reduce_lr_on_plateau_callback_lowers_the_inner_learning_rate():
    # min_delta=1e9: after the first epoch (an improvement on the initial
    # best, +inf) no epoch counts as one, so with patience 0 the rate halves
    # after epochs 2 and 3: 0.1 * 0.5**2.
    def plateau():
        return keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=0)

    ref, acc, ref_hist, acc_hist = _fit_pair(plateau, epochs=3)
    np.testing.assert_allclose(acc.optimizer.inner_optimizer.learning_rate.numpy(), 0.1 * 0.5**2, rtol=1e-6)
    np.testing.assert_allclose(acc_hist.history["lr"], ref_hist.history["lr"])
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-6


# ------------------------------------------------------------ model.fit / XLA
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_fit_matches_fit_at_batch_n_b(jit_compile):
    # model.fit (Keras 2 `minimize`), as plain and as XLA-compiled train step.
    n, mb, windows = 4, 3, 3
    x, y = make_data(n * mb * windows)
    ref, acc = make_mlp(0), make_mlp(0)
    make = lambda: o.AdamW(o.schedules.ExponentialDecay(2e-2, 2, 0.5), weight_decay=0.05, use_ema=True)  # noqa: E731
    ref.compile(optimizer=make(), loss="mse", jit_compile=jit_compile)
    acc.compile(optimizer=AccumulatingOptimizer(make(), n), loss="mse", jit_compile=jit_compile)
    ref.fit(x, y, batch_size=n * mb, epochs=2, shuffle=False, verbose=0)
    acc.fit(x, y, batch_size=mb, epochs=2, shuffle=False, verbose=0)
    assert int(acc.optimizer.iterations.numpy()) == 2 * windows
    assert max_abs_diff(weights(ref), weights(make_mlp(0))) > 1e-3
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-5
    assert max_abs_diff(optimizer_state(ref.optimizer), optimizer_state(acc.optimizer.inner_optimizer)) <= 1e-5


def test_loss_scale_optimizer_outside_matches_its_large_batch():
    # Keras 2's LossScaleOptimizer (dynamic scale) around the wrapper, the
    # placement for mixed precision, against the same LossScaleOptimizer
    # around the plain inner at batch N*B.
    n, mb, windows = 4, 3, 4
    x, y = make_data(n * mb * windows)

    def run(opt, model, batch, steps):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = opt.get_scaled_loss(mse(yb, model(xb)))
            grads = opt.get_unscaled_gradients(tape.gradient(loss, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for s in range(steps):
            step(tf.constant(x[s * batch : (s + 1) * batch]), tf.constant(y[s * batch : (s + 1) * batch]))

    ref, acc = make_mlp(0), make_mlp(0)
    ref_opt = keras.mixed_precision.LossScaleOptimizer(o.Adam(1e-2))
    acc_opt = keras.mixed_precision.LossScaleOptimizer(AccumulatingOptimizer(o.Adam(1e-2), n))
    run(ref_opt, ref, n * mb, windows)
    run(acc_opt, acc, mb, n * windows)
    assert (int(acc_opt.inner_optimizer.micro_steps.numpy()), int(acc_opt.inner_optimizer.iterations.numpy())) == (n * windows, windows)
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-5
    assert max_abs_diff(optimizer_state(ref_opt.inner_optimizer), optimizer_state(acc_opt.inner_optimizer.inner_optimizer)) <= 1e-5


# Which micro-steps of each window (N = 2) give the FIRST variable v0 a
# gradient (v1 always has one): absent from a whole window (the first, at
# the first update, and a later one), present, present then absent (the
# window closes on a micro-step without it).
NADAM_PATTERN = [[False, False], [True, True], [False, False], [True, False], [True, True]]


def _nadam_windows(mode, accumulate):
    """v0, v1 and Nadam's ``_u_product`` after each window: the wrapper (two
    micro-step functions, with and without v0's gradient), or the plain
    Nadam fed each window's mean gradient, ``None`` for v0 where no
    micro-step gave one, through functions of the same two shapes."""
    rng = np.random.default_rng(0)
    grads = [[(rng.normal(size=2).astype("float32"), rng.normal(size=2).astype("float32")) for _ in w]
             for w in NADAM_PATTERN]
    v0, v1 = tf.Variable([1.0, 2.0], name="v0"), tf.Variable([3.0, 4.0], name="v1")
    inner = o.Nadam(0.1)
    opt = AccumulatingOptimizer(inner, 2) if accumulate else inner
    opt.build([v0, v1])  # (a plain Keras 2 Nadam built inside tf.function never moves its _u_product)

    def both(g0, g1):
        opt.apply_gradients([(g0, v0), (g1, v1)])

    def only_v1(g1):
        opt.apply_gradients([(None, v0), (g1, v1)])

    if mode == "graph":
        both, only_v1 = tf.function(both), tf.function(only_v1)
    states = []
    for window, uses in zip(grads, NADAM_PATTERN):
        if accumulate:
            for (g0, g1), use in zip(window, uses):
                both(tf.constant(g0), tf.constant(g1)) if use else only_v1(tf.constant(g1))
        else:
            g1 = tf.constant(sum(g for _, g in window) / 2)
            if any(uses):
                both(tf.constant(sum(g for (g, _), u in zip(window, uses) if u) / 2), g1)
            else:
                only_v1(g1)
        states.append([v0.numpy(), v1.numpy()] + optimizer_state(inner))
    return states


@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
def test_nadam_with_the_first_variable_missing_from_a_window_matches_its_large_batch_eagerly():
    """Eagerly, every window's state (v0, v1, m, v, ``_u_product``,
    iterations) equals the plain Nadam's fed the window's mean gradient,
    bitwise, whichever windows the first variable misses."""
    reference, accumulated = _nadam_windows("eager", False), _nadam_windows("eager", True)
    for w, (ref, acc) in enumerate(zip(reference, accumulated)):
        assert len(ref) == len(acc)
        for i, (r, a) in enumerate(zip(ref, acc)):
            np.testing.assert_array_equal(a, r, err_msg=f"window {w}, state entry {i}")


@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
def test_traced_nadam_with_the_first_variable_missing_at_the_first_update_stays_finite():
    """Traced, Keras 2's Nadam advances ``_u_product`` in an ``update_step``
    chosen by a Python counter fixed when each ``update_step`` is traced
    (issue 17, bug 7; docs/families/keras2.md). The wrapper traces every
    variable's update, the gated ones under a ``cond``: when the first
    variable had no gradient in the first window, its skipped update held
    the ``_u_product`` step and v1 divided by ``1 - _u_product = 0`` (inf).
    Now the variables with a gradient come first: the first update equals
    the plain traced Nadam's fed the window's mean gradient (v0 ``None``),
    bitwise, and every later window stays finite. (Later windows may differ
    from the plain traced Nadam, whose result depends on how many
    ``update_step`` s were traced before; eagerly they do not, see above.)"""
    reference, accumulated = _nadam_windows("graph", False), _nadam_windows("graph", True)
    for i, (r, a) in enumerate(zip(reference[0], accumulated[0])):
        np.testing.assert_array_equal(a, r, err_msg=f"first update, state entry {i}")
    for w, acc in enumerate(accumulated):
        assert all(np.all(np.isfinite(a)) for a in acc), f"window {w}: not finite"
