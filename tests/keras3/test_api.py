"""Public API of `AccumulatingOptimizer`: counters, input validation, forwarding
(`learning_rate`, `iterations`, `variables`, `scale_loss`), the N=1
pass-through, the `apply` entry points and serialization.

Every behaviour test compares against an independent reference: the plain
inner optimizer trained with batch ``N*B`` (or applied to the hand-computed
window mean of the micro-batch gradients), or a value derived by hand.
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import copy
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from support.reference import make_data, make_mlp, make_train_step, max_abs_diff, mse, train, weights

from accum_optimizer import AccumulatingOptimizer

# --------------------------------------------------------------------- helpers


def _all_of(*fragments: str) -> str:
    """A `pytest.raises(match=...)` pattern that requires every fragment
    (literally, in any order) somewhere in the message."""
    return "(?s)^" + "".join(f"(?=.*{re.escape(f)})" for f in fragments)


def _snapshot(opt, model_vars) -> list[np.ndarray]:
    """Every piece of state a micro-step may touch, as numpy copies."""
    state = [opt.micro_steps, opt.iterations, *opt.variables, *model_vars]
    return [np.array(keras.ops.convert_to_numpy(v)) for v in state]


def _assert_same_state(before, after):
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        np.testing.assert_array_equal(a, b, err_msg=f"state entry {i} changed")


def _grad_sequence(variables, steps: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=tuple(v.shape)).astype("float32") for v in variables]
        for _ in range(steps)
    ]


def _fresh_vars(seed: int = 0) -> list:
    return make_mlp(seed).trainable_variables


def _window_mean_reference(inner_fn, init_values, grad_seq, n):
    """Hand-derived reference: the plain optimizer applied once per complete
    window of ``n`` micro-steps, to the mean of that window's gradients."""
    ref_vars = [keras.Variable(np.array(v)) for v in init_values]
    ref_opt = inner_fn()
    for w in range(len(grad_seq) // n):
        window = grad_seq[w * n : (w + 1) * n]
        mean = [np.sum([g[i] for g in window], axis=0) / np.float32(n) for i in range(len(ref_vars))]
        ref_opt.apply([tf.constant(m) for m in mean], ref_vars)
    return ref_vars, ref_opt


def _fit(model, optimizer, x, y, batch_size, epochs=1, callbacks=None, loss="mse"):
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


# ------------------------------------------------------------------ counters


def test_counters_follow_micro_steps_in_custom_loop():
    """After m micro-steps: micro_steps == m, iterations == m // N, and the
    weights equal the large-batch reference after m // N steps (bitwise
    unchanged on the micro-steps in between)."""
    n, b = 3, 4
    x, y = make_data(n * b * 3)
    acc_model, ref_model = make_mlp(0), make_mlp(0)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01), gradient_accumulation_steps=n)
    acc_step = make_train_step(acc_model, opt)
    ref_step = make_train_step(ref_model, keras.optimizers.Adam(0.01))
    for m in range(1, 3 * n + 1):
        before = weights(acc_model)
        acc_step(tf.constant(x[(m - 1) * b : m * b]), tf.constant(y[(m - 1) * b : m * b]))
        assert int(opt.micro_steps) == m
        assert int(opt.iterations) == m // n
        if m % n:
            for a, bw in zip(before, weights(acc_model)):
                np.testing.assert_array_equal(a, bw)
        else:
            w = m // n - 1
            sl = slice(w * n * b, (w + 1) * n * b)
            ref_step(tf.constant(x[sl]), tf.constant(y[sl]))
        assert max_abs_diff(weights(acc_model), weights(ref_model)) < 1e-6
    assert opt.micro_steps.dtype == "int64" and opt.iterations.dtype == "int64"
    assert isinstance(opt.micro_steps, keras.Variable)
    assert isinstance(opt.iterations, keras.Variable)


def test_counters_follow_micro_steps_in_model_fit():
    """model.fit over cumulative chunks: m = 1, 2, 4, 7, 9 micro-batches."""
    n, b = 3, 4
    x, y = make_data(9 * b)
    acc_model, ref_model = make_mlp(0), make_mlp(0)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=n)
    acc_model.compile(optimizer=opt, loss="mse")
    ref_step = make_train_step(ref_model, keras.optimizers.SGD(0.1, momentum=0.9))
    m = ref_updates = 0
    for chunk in (1, 1, 2, 3, 2):
        sl = slice(m * b, (m + chunk) * b)
        acc_model.fit(x[sl], y[sl], batch_size=b, epochs=1, shuffle=False, verbose=0)
        m += chunk
        assert int(opt.micro_steps) == m
        assert int(opt.iterations) == m // n
        while ref_updates < m // n:
            big = slice(ref_updates * n * b, (ref_updates + 1) * n * b)
            ref_step(tf.constant(x[big]), tf.constant(y[big]))
            ref_updates += 1
        assert max_abs_diff(weights(acc_model), weights(ref_model)) < 1e-5
    assert opt.micro_steps.dtype == "int64" and opt.iterations.dtype == "int64"


@given(
    n=st.integers(1, 5),
    grads=st.lists(st.floats(-4, 4, width=32), min_size=0, max_size=13),
)
def test_counters_and_values_hand_derived(n, grads):
    """Eager, one scalar variable, SGD(lr=1): after m micro-steps the weight is
    w0 - sum over complete windows of the window mean."""
    v = keras.Variable(np.float32(0.5))
    opt = AccumulatingOptimizer(keras.optimizers.SGD(1.0), gradient_accumulation_steps=n)
    for g in grads:
        opt.apply([tf.constant(np.float32(g))], [v])
    m = len(grads)
    if m:
        assert int(opt.micro_steps) == m
    assert int(opt.iterations) == m // n
    expected = np.float32(0.5)
    for w in range(m // n):
        window = np.float32(0.0)
        for g in grads[w * n : (w + 1) * n]:
            window = np.float32(window + np.float32(g))
        expected = np.float32(expected - (window if n == 1 else np.float32(window / np.float32(n))))
    np.testing.assert_allclose(float(v.numpy()), float(expected), rtol=1e-6, atol=1e-6)


def test_assigning_mini_step_moves_the_update_step():
    """mini_step (the window's position) = N-1 makes the next micro-step an
    update; afterwards a full window of N micro-steps is needed again.
    ``micro_steps`` only counts. Hand-derived with plain SGD: the window
    holds two micro-batches (its count is 2), so the update is
    w0 - lr * (g1 + g2) / 2."""
    n, b, lr = 4, 5, 0.1
    x, y = make_data(6 * b)
    model = make_mlp(0)
    w0 = weights(model)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(lr), gradient_accumulation_steps=n)
    step = make_train_step(model, opt)

    # Independent gradients at w0 of the first two micro-batches.
    probe = make_mlp(0)
    grads_at_w0 = []
    for k in range(2):
        with tf.GradientTape() as tape:
            loss = mse(y[k * b : (k + 1) * b], probe(x[k * b : (k + 1) * b]))
        grads_at_w0.append([g.numpy() for g in tape.gradient(loss, probe.trainable_variables)])

    step(tf.constant(x[:b]), tf.constant(y[:b]))
    assert (int(opt.micro_steps), int(opt.iterations)) == (1, 0)
    opt.mini_step.assign(n - 1)
    step(tf.constant(x[b : 2 * b]), tf.constant(y[b : 2 * b]))
    assert (int(opt.micro_steps), int(opt.iterations), int(opt.mini_step)) == (2, 1, 0)
    expected = [w - lr * (g1 + g2) / 2 for w, g1, g2 in zip(w0, *grads_at_w0)]
    assert max_abs_diff(weights(model), expected) < 1e-6
    # The accumulators were reset by that update.
    for a in opt.acc_grads:
        np.testing.assert_array_equal(a.numpy(), 0)

    after_update = weights(model)
    for k in range(2, 2 + n - 1):
        step(tf.constant(x[k * b : (k + 1) * b]), tf.constant(y[k * b : (k + 1) * b]))
        assert int(opt.iterations) == 1
        for a, bw in zip(after_update, weights(model)):
            np.testing.assert_array_equal(a, bw)
    step(tf.constant(x[5 * b : 6 * b]), tf.constant(y[5 * b : 6 * b]))
    assert (int(opt.micro_steps), int(opt.iterations)) == (n + 2, 2)
    assert opt.micro_steps.dtype == "int64"


def test_assigning_iterations_reaches_the_inner_optimizer():
    """iterations is the inner's counter: assigning it changes Adam's bias
    correction exactly as on a plain Adam whose iterations was assigned."""
    n = 2
    init = [v.numpy() for v in _fresh_vars()]
    vs = [keras.Variable(np.array(v)) for v in init]
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01), gradient_accumulation_steps=n)
    opt.build(vs)
    opt.iterations.assign(5)
    assert int(opt.inner_optimizer.iterations) == 5
    seq = _grad_sequence(vs, n, seed=3)
    for g in seq:
        opt.apply([tf.constant(a) for a in g], vs)
    assert int(opt.iterations) == 6 and int(opt.micro_steps) == n
    assert opt.iterations.dtype == "int64"

    ref_vars = [keras.Variable(np.array(v)) for v in init]
    ref = keras.optimizers.Adam(0.01)
    ref.build(ref_vars)
    ref.iterations.assign(5)
    mean = [(a + b) / np.float32(2) for a, b in zip(*seq)]
    ref.apply([tf.constant(m) for m in mean], ref_vars)
    assert max_abs_diff(vs, ref_vars) < 1e-7
    # And it differs from an update with iterations starting at 0.
    fresh = [keras.Variable(np.array(v)) for v in init]
    keras.optimizers.Adam(0.01).apply([tf.constant(m) for m in mean], fresh)
    assert max_abs_diff(vs, fresh) > 1e-5


@pytest.mark.parametrize(
    "restore",
    [
        "build-then-load",
        "load-then-build",
        # build() runs lazily inside the first traced step: the deferred
        # restore must not end up in a trace that tf.function discards.
        "load-then-lazy-build-in-tf.function",
    ],
)
def test_counters_and_state_restore(restore):
    """save_own_variables -> load_own_variables into a fresh wrapper (Nadam
    inner): the counters come back as int64, the update timing continues
    mid-window and training continues exactly like the uninterrupted run."""
    n, b = 3, 4
    x, y = make_data(9 * b)
    model_a = make_mlp(0)
    opt_a = AccumulatingOptimizer(keras.optimizers.Nadam(0.01), gradient_accumulation_steps=n)
    step_a = make_train_step(model_a, opt_a)
    for k in range(4):  # one update + one pending micro-step
        step_a(tf.constant(x[k * b : (k + 1) * b]), tf.constant(y[k * b : (k + 1) * b]))
    store: dict = {}
    opt_a.save_own_variables(store)

    model_b = make_mlp(5)
    model_b.set_weights(model_a.get_weights())
    opt_b = AccumulatingOptimizer(keras.optimizers.Nadam(0.01), gradient_accumulation_steps=n)
    if restore == "build-then-load":
        opt_b.build(model_b.trainable_variables)
        opt_b.load_own_variables(store)
    else:
        opt_b.load_own_variables(store)  # deferred until build
        if restore == "load-then-build":
            opt_b.build(model_b.trainable_variables)
    step_b = make_train_step(model_b, opt_b)
    for k in range(4, 9):
        xs, ys = tf.constant(x[k * b : (k + 1) * b]), tf.constant(y[k * b : (k + 1) * b])
        step_a(xs, ys)
        step_b(xs, ys)
        assert (int(opt_b.micro_steps), int(opt_b.iterations)) == (k + 1, (k + 1) // n)
    assert opt_b.micro_steps.dtype == "int64" and opt_b.iterations.dtype == "int64"
    assert max_abs_diff(weights(model_a), weights(model_b)) < 1e-7
    assert max_abs_diff(opt_a.inner_optimizer.variables, opt_b.inner_optimizer.variables) < 1e-7
    np.testing.assert_array_equal(opt_b.inner_optimizer._u_product.numpy(), opt_a.inner_optimizer._u_product.numpy())


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "value, exc",
    [
        (0, ValueError),
        (-3, ValueError),
        (2.5, TypeError),
        (4.0, TypeError),
        (True, TypeError),
        ("4", TypeError),
        (None, TypeError),
    ],
    ids=["zero", "negative", "float", "integral-float", "bool", "str", "none"],
)
def test_gradient_accumulation_steps_validation(value, exc):
    with pytest.raises(exc, match=_all_of("gradient_accumulation_steps", f"gradient_accumulation_steps={value!r}", "int")):
        AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=value)


def test_gradient_accumulation_steps_accepts_numpy_int():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=np.int64(3))
    assert opt.gradient_accumulation_steps == 3 and type(opt.gradient_accumulation_steps) is int


@pytest.mark.parametrize("value", ["avg", "MEAN", None, 1])
def test_reduction_validation(value):
    with pytest.raises(ValueError, match=_all_of("reduction", f"reduction={value!r}", "'mean'", "'sum'")):
        AccumulatingOptimizer(keras.optimizers.SGD(), gradient_accumulation_steps=2, reduction=value)


@pytest.mark.parametrize(
    "make_inner, exc",
    [
        (lambda: "nonsense", ValueError),
        (lambda: object(), TypeError),
        (lambda: keras.layers.Dense(2), TypeError),
        (lambda: {"class_name": "NoSuchOptimizer", "config": {}}, ValueError),
        (lambda: keras.optimizers.Adam, TypeError),  # the class, not an instance
        (lambda: None, TypeError),
    ],
    ids=["unknown-string", "object", "layer", "unknown-dict", "class", "none"],
)
def test_inner_optimizer_validation(make_inner, exc):
    inner = make_inner()
    received = "'NoSuchOptimizer'" if isinstance(inner, dict) else repr(inner)
    with pytest.raises(exc, match=_all_of("inner_optimizer", "inner_optimizer=", received, "keras.optimizers")):
        AccumulatingOptimizer(inner, gradient_accumulation_steps=2)


def test_inner_optimizer_validation_dict_without_class_name():
    with pytest.raises(ValueError, match=_all_of("inner_optimizer", "inner_optimizer=", "'foo'")):
        AccumulatingOptimizer({"foo": 1}, gradient_accumulation_steps=2)


def test_double_accumulation_is_rejected():
    inner = keras.optimizers.Adam(gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=_all_of("inner_optimizer", "gradient_accumulation_steps=4", "twice")):
        AccumulatingOptimizer(inner, gradient_accumulation_steps=2)
    nested = AccumulatingOptimizer(keras.optimizers.Adam(), gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match=_all_of("inner_optimizer", "AccumulatingOptimizer", "gradient_accumulation_steps=3")):
        AccumulatingOptimizer(nested, gradient_accumulation_steps=2)


def test_unknown_kwargs_are_rejected_naming_the_argument():
    with pytest.raises(TypeError, match=_all_of("gradient_accumulation_step", "gradient_accumulation_steps", "reduction")):
        AccumulatingOptimizer(keras.optimizers.SGD(), 2, gradient_accumulation_step=4)


def test_unknown_kwargs_message_names_the_value():
    with pytest.raises(TypeError, match=_all_of("bogus_option", "12345")):
        AccumulatingOptimizer(keras.optimizers.SGD(), 2, bogus_option=12345)


def _one_good_micro_step():
    model = make_mlp(0)
    vs = model.trainable_variables
    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01), gradient_accumulation_steps=3)
    seq = _grad_sequence(vs, 3, seed=7)
    opt.apply([tf.constant(g) for g in seq[0]], vs)
    return model, vs, opt, seq


def _finish_window_and_compare(vs, opt, seq, init):
    """After rejected calls, the window still completes like the reference."""
    for g in seq[1:]:
        opt.apply([tf.constant(a) for a in g], vs)
    assert (int(opt.micro_steps), int(opt.iterations)) == (3, 1)
    ref_vars, _ = _window_mean_reference(lambda: keras.optimizers.Adam(0.01), init, seq, 3)
    assert max_abs_diff(vs, ref_vars) < 1e-6


def test_apply_rejects_length_mismatch_and_leaves_state_untouched():
    init = weights(make_mlp(0))
    model, vs, opt, seq = _one_good_micro_step()
    good = [tf.constant(g) for g in seq[1]]
    before = _snapshot(opt, vs)
    with pytest.raises(ValueError, match=_all_of("`grads`", "`trainable_variables`", "3 gradients", "4 variables")):
        opt.apply(good[:3], vs)
    with pytest.raises(ValueError, match=_all_of("`grads`", "`trainable_variables`", "4 gradients", "3 variables")):
        opt.apply(good, vs[:3])
    _assert_same_state(before, _snapshot(opt, vs))
    _finish_window_and_compare(vs, opt, seq, init)


def test_apply_rejects_shape_mismatch_eager_and_in_tf_function():
    init = weights(make_mlp(0))
    model, vs, opt, seq = _one_good_micro_step()
    before = _snapshot(opt, vs)
    # Wrong dims on a later variable (the first ones must not be touched).
    bad = [tf.constant(g) for g in seq[1]]
    bad[2] = tf.ones((3, 3))
    match = _all_of("(3, 3)", "(5, 3)", vs[2].path, "shape")
    with pytest.raises(ValueError, match=match):
        opt.apply(bad, vs)
    with pytest.raises(ValueError, match=match):
        tf.function(lambda gs: opt.apply(gs, vs))(bad)
    # Wrong rank.
    bad_rank = [tf.constant(g) for g in seq[1]]
    bad_rank[3] = tf.ones((3, 1))
    with pytest.raises(ValueError, match=_all_of("(3, 1)", "(3,)", vs[3].path)):
        opt.apply(bad_rank, vs)
    with pytest.raises(ValueError, match=_all_of("(3, 1)", "(3,)", vs[3].path)):
        tf.function(lambda gs: opt.apply_gradients(zip(gs, vs)))(bad_rank)
    _assert_same_state(before, _snapshot(opt, vs))
    _finish_window_and_compare(vs, opt, seq, init)


def test_apply_rejects_all_none_gradients():
    init = weights(make_mlp(0))
    model, vs, opt, seq = _one_good_micro_step()
    before = _snapshot(opt, vs)
    with pytest.raises(ValueError, match=_all_of("No gradients", vs[0].path, vs[3].path)):
        opt.apply([None] * len(vs), vs)
    with pytest.raises(ValueError, match=_all_of("No gradients", vs[0].path)):
        tf.function(lambda: opt.apply_gradients(zip([None] * len(vs), vs)))()
    _assert_same_state(before, _snapshot(opt, vs))
    _finish_window_and_compare(vs, opt, seq, init)


def test_apply_without_variables_before_build_is_rejected():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match=_all_of("trainable_variables", "build")):
        opt.apply([tf.ones(3)])
    assert not opt.built


def test_apply_accepts_unknown_rank_gradient_in_tf_function():
    """A correct gradient whose static shape is unknown (e.g. from
    tf.function with a relaxed signature) must still be accepted."""
    init = weights(make_mlp(0))
    model, vs, opt, seq = _one_good_micro_step()
    relaxed = tf.function(
        lambda gs: opt.apply(gs, vs), input_signature=[[tf.TensorSpec(None, tf.float32)] * len(vs)]
    )
    relaxed([tf.constant(a) for a in seq[1]])
    opt.apply([tf.constant(a) for a in seq[2]], vs)
    ref_vars, _ = _window_mean_reference(lambda: keras.optimizers.Adam(0.01), init, seq, 3)
    assert max_abs_diff(vs, ref_vars) < 1e-6


def test_apply_dynamic_shape_mismatch_is_clear_and_atomic():
    model, vs, opt, seq = _one_good_micro_step()
    before = _snapshot(opt, vs)
    dynamic = tf.function(
        lambda gs: opt.apply(gs, vs),
        input_signature=[[tf.TensorSpec([None] * len(v.shape), tf.float32) for v in vs]],
    )
    bad = [tf.constant(g) for g in seq[1]]
    bad[1] = tf.ones((7,))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=_all_of(vs[1].path, "7")):
        dynamic(bad)
    _assert_same_state(before, _snapshot(opt, vs))


# ---------------------------------------------------------- identifiers, LR


@pytest.mark.parametrize(
    "identifier, make_instance",
    [
        ("adam", lambda: keras.optimizers.Adam()),
        ("sgd", lambda: keras.optimizers.SGD()),
        (
            {"class_name": "SGD", "config": {"learning_rate": 0.05, "momentum": 0.9}},
            lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        ),
    ],
    ids=["adam", "sgd", "config-dict"],
)
def test_inner_optimizer_identifier(identifier, make_instance):
    n, b, windows = 2, 4, 3
    x, y = make_data(n * b * windows)
    by_id = AccumulatingOptimizer(copy.deepcopy(identifier), gradient_accumulation_steps=n)
    by_instance = AccumulatingOptimizer(make_instance(), gradient_accumulation_steps=n)
    assert type(by_id.inner_optimizer) is type(by_instance.inner_optimizer)
    assert by_id.inner_optimizer.get_config() | {"name": None} == by_instance.inner_optimizer.get_config() | {"name": None}
    m_id = train(make_mlp(0), by_id, x, y, b, n * windows)
    m_inst = train(make_mlp(0), by_instance, x, y, b, n * windows)
    m_ref = train(make_mlp(0), make_instance(), x, y, n * b, windows)
    for a, c in zip(weights(m_id), weights(m_inst)):
        np.testing.assert_array_equal(a, c)
    assert max_abs_diff(weights(m_id), weights(m_ref)) < 1e-6
    assert max_abs_diff(weights(m_id), weights(make_mlp(0))) > 1e-4  # it trained


def test_learning_rate_getter_and_setter_forward_to_inner():
    inner = keras.optimizers.SGD(0.5)
    opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=2)
    assert opt.learning_rate is inner.learning_rate
    assert float(opt.learning_rate) == pytest.approx(0.5)
    opt.learning_rate = 0.05
    assert float(inner.learning_rate) == pytest.approx(0.05)
    assert float(opt.learning_rate) == pytest.approx(0.05)
    # The wrapper's own (unused) learning-rate variable is not state.
    assert all(v is not opt._learning_rate for v in opt.variables)
    # Training uses the value set on the wrapper.
    n, b, windows = 2, 4, 3
    x, y = make_data(n * b * windows)
    m_acc = train(make_mlp(0), opt, x, y, b, n * windows)
    m_ref = train(make_mlp(0), keras.optimizers.SGD(0.05), x, y, n * b, windows)
    assert max_abs_diff(weights(m_acc), weights(m_ref)) < 1e-6


def test_settings_of_the_inner_optimizer_are_read_and_assigned_through_the_wrapper():
    """The inner optimizer's hyperparameters (``beta_1``, ``epsilon``,
    ``amsgrad``) and clip settings read through the wrapper, and assignments
    reaching it, as in the Keras 2 families (issue 22, item 5). Reference:
    the inner's values; then N = 2 with ``beta_1`` and ``clipnorm`` set
    through the wrapper against the plain optimizer given them, at batch 2·B
    (the clipping is active: without it the weights differ)."""
    inner = keras.optimizers.Adam(1e-2, beta_1=0.8, epsilon=1e-3, amsgrad=True, clipnorm=0.5)
    opt = AccumulatingOptimizer(inner, 2)
    assert (opt.beta_1, opt.epsilon, opt.amsgrad, opt.clipnorm, opt.clipvalue) == (0.8, 1e-3, True, 0.5, None)
    with pytest.raises(AttributeError, match="no_such_setting"):
        opt.no_such_setting
    opt.beta_1, opt.clipnorm = 0.7, 0.01
    assert (inner.beta_1, inner.clipnorm) == (0.7, 0.01) and not {"beta_1", "clipnorm"} & set(vars(opt))

    x, y = make_data(2 * 4 * 3)
    ref = train(make_mlp(0), keras.optimizers.Adam(1e-2, beta_1=0.7, clipnorm=0.01), x, y, 8, 3)
    acc_opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), 2)
    acc_opt.beta_1, acc_opt.clipnorm = 0.7, 0.01
    acc = train(make_mlp(0), acc_opt, x, y, 4, 6)
    free = train(make_mlp(0), keras.optimizers.Adam(1e-2, beta_1=0.7), x, y, 8, 3)
    assert max_abs_diff(weights(ref), weights(acc)) <= 1e-5 < max_abs_diff(weights(ref), weights(free))


def test_learning_rate_schedule_sees_updates_not_micro_steps():
    sched = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(sched), gradient_accumulation_steps=2)
    v = keras.Variable(np.zeros(3, "float32"))
    for _ in range(3):
        opt.apply([tf.ones(3)], [v])
    assert int(opt.iterations) == 1
    assert float(opt.learning_rate) == pytest.approx(0.5)
    np.testing.assert_allclose(v.numpy(), -1.0)  # one update of lr 1.0, mean gradient 1


def _callback_run(make_callback, inner_fn, epochs=3):
    n, b, windows = 2, 4, 3
    x, y = make_data(n * b * windows)
    acc_opt = AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=n)
    ref_opt = inner_fn()
    m_acc = _fit(make_mlp(0), acc_opt, x, y, b, epochs, [make_callback()])
    m_ref = _fit(make_mlp(0), ref_opt, x, y, n * b, epochs, [make_callback()])
    assert int(acc_opt.micro_steps) == n * windows * epochs
    assert int(acc_opt.iterations) == int(ref_opt.iterations) == windows * epochs
    return acc_opt, ref_opt, m_acc, m_ref


def test_learning_rate_scheduler_callback():
    acc_opt, ref_opt, m_acc, m_ref = _callback_run(
        lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5**epoch),
        lambda: keras.optimizers.SGD(1.0, momentum=0.5),
    )
    assert float(acc_opt.inner_optimizer.learning_rate) == pytest.approx(0.05)
    assert float(ref_opt.learning_rate) == pytest.approx(0.05)
    assert max_abs_diff(weights(m_acc), weights(m_ref)) < 1e-5


def test_reduce_lr_on_plateau_callback():
    # min_delta so large that no epoch after the first counts as an
    # improvement: LR halves after epochs 2 and 3, independent of loss noise.
    acc_opt, ref_opt, m_acc, m_ref = _callback_run(
        lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9),
        lambda: keras.optimizers.SGD(0.2, momentum=0.5),
    )
    assert float(acc_opt.inner_optimizer.learning_rate) == pytest.approx(0.05)
    assert float(ref_opt.learning_rate) == pytest.approx(0.05)
    assert max_abs_diff(weights(m_acc), weights(m_ref)) < 1e-5


# ------------------------------------------------- iterations, variables


def test_iterations_forwards_to_inner():
    inner = keras.optimizers.Adam()
    opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=3)
    assert opt.iterations is inner.iterations
    train(make_mlp(0), opt, *make_data(7 * 2), batch=2, steps=7)
    assert opt.iterations is inner.iterations
    assert int(opt.iterations) == int(inner.iterations) == 7 // 3
    # The base class's own counter is not the one reported or saved.
    assert all(v is not opt._iterations for v in opt.variables)
    assert int(opt._iterations) == 0


def test_variables_include_every_inner_variable_and_nadam_u_product():
    n, b, windows = 2, 4, 3
    x, y = make_data(n * b * windows)
    opt = AccumulatingOptimizer(keras.optimizers.Nadam(0.01), gradient_accumulation_steps=n)
    m_acc = _fit(make_mlp(0), opt, x, y, b)
    ref = keras.optimizers.Nadam(0.01)
    m_ref = _fit(make_mlp(0), ref, x, y, n * b)

    ids = [id(v) for v in opt.variables]
    assert len(ids) == len(set(ids)), "a variable is listed twice"
    inner = opt.inner_optimizer
    for v in inner.variables:
        assert id(v) in ids, f"inner variable {v.path} missing from opt.variables"
    assert id(inner._u_product) in ids
    for v in [opt.micro_steps, opt.grad_received, *opt.acc_grads]:
        assert id(v) in ids
    assert len(opt.acc_grads) == len(m_acc.trainable_variables)
    # The momentum product moved once per update, like the reference's.
    assert len(inner.variables) == len(ref.variables)
    np.testing.assert_allclose(inner._u_product.numpy(), ref._u_product.numpy(), rtol=1e-6)
    assert float(inner._u_product.numpy()) != 1.0
    assert max_abs_diff(weights(m_acc), weights(m_ref)) < 1e-5


def test_variables_are_only_optimizer_state():
    """The model's weights are not optimizer state (BaseOptimizer.build avoids
    tracking them; a wrapper build that sets `_trainable_variables` with
    tracking on would list and save them)."""
    model = make_mlp(0)
    opt = AccumulatingOptimizer(keras.optimizers.Nadam(), gradient_accumulation_steps=2)
    opt.build(model.trainable_variables)
    ids = {id(v) for v in opt.variables}
    leaked = [v.path for v in model.weights if id(v) in ids]
    assert not leaked, f"model weights listed as optimizer variables: {leaked}"
    own = [opt.micro_steps, opt.grad_received, *opt.acc_grads, opt.mini_step, opt.window_weight, *opt.touched_rows]
    assert len(opt.touched_rows) == len(model.trainable_variables)  # every MLP variable has rank >= 1
    assert len(opt.variables) == len(own) + len(opt.inner_optimizer.variables)


# ----------------------------------------------------- N=1 pass-through


# ------------------------------------------------------- apply entry points


def _entry_point(opt, vs, mode):
    def call(gs):
        if mode == "apply":
            opt.apply(gs, vs)
        elif mode == "apply_gradients":
            opt.apply_gradients(zip(gs, vs))
        else:
            opt.apply(gs)

    return call


def test_apply_entry_points_agree():
    """apply(grads, vars), apply_gradients(zip(grads, vars)) and apply(grads)
    after build, each eager and under tf.function: identical results, equal to
    the hand-computed window-mean reference (two updates, then one pending
    micro-step)."""
    n, steps = 3, 7
    init = weights(make_mlp(0))
    seq = _grad_sequence(init, steps, seed=11)
    ref_vars, ref_opt = _window_mean_reference(lambda: keras.optimizers.Adam(0.01), init, seq, n)
    k = len(init)
    results = {}
    for compiled in (False, True):
        for mode in ("apply", "apply_gradients", "apply_built"):
            vs = [keras.Variable(np.array(v)) for v in init]
            opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01), gradient_accumulation_steps=n)
            if mode == "apply_built":
                opt.build(vs)
            call = _entry_point(opt, vs, mode)
            if compiled:
                call = tf.function(call)
            for g in seq:
                call([tf.constant(a) for a in g])
            assert (int(opt.micro_steps), int(opt.iterations)) == (steps, steps // n)
            state = weights(vs) + weights(opt.inner_optimizer.variables) + weights(opt.acc_grads)
            results[compiled, mode] = state
            assert max_abs_diff(state[:k], ref_vars) < 1e-6
            assert max_abs_diff(state[k:-k], ref_opt.variables) < 1e-6
            # The pending micro-step sits in the accumulators.
            assert max_abs_diff(state[-k:], seq[-1]) == 0.0
    for key, state in results.items():
        if key[1] != "apply":  # same code path as apply(): bitwise equal
            for a, c in zip(results[key[0], "apply"], state):
                np.testing.assert_array_equal(a, c, err_msg=str(key))
    assert max_abs_diff(results[False, "apply"], results[True, "apply"]) < 1e-7


# ---------------------------------------------------------------- scale_loss


def test_scale_loss_forwards_to_inner():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=8.0), gradient_accumulation_steps=2)
    assert float(opt.scale_loss(tf.constant(1.5))) == pytest.approx(12.0)
    plain = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=2)
    assert float(plain.scale_loss(tf.constant(1.5))) == pytest.approx(1.5)


def test_scale_loss_in_model_fit_matches_reference():
    """model.fit scales the loss through optimizer.scale_loss and the inner
    unscales the window gradient: same weights as the plain optimizer with the
    same loss_scale_factor and batch N*B (SGD, so a missing or double scaling
    would show)."""
    n, b, windows = 2, 4, 3
    x, y = make_data(n * b * windows)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=8.0), gradient_accumulation_steps=n)
    m_acc = _fit(make_mlp(0), opt, x, y, b)
    m_ref = _fit(make_mlp(0), keras.optimizers.SGD(0.1, loss_scale_factor=8.0), x, y, n * b)
    assert max_abs_diff(weights(m_acc), weights(m_ref)) < 1e-5
    assert max_abs_diff(weights(m_acc), weights(make_mlp(0))) > 1e-3


# ------------------------------------------------------------- serialization


@pytest.mark.parametrize(
    "inner_fn, n, reduction",
    [
        (lambda: keras.optimizers.Adam(0.003, beta_1=0.8, clipnorm=1.0), 4, "mean"),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1, "sum"),
    ],
    ids=["adam-4-mean", "sgd-1-sum"],
)
def test_get_config_from_config_and_serialize_roundtrip(inner_fn, n, reduction):
    opt = AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=n, reduction=reduction, name="acc_opt")
    config = opt.get_config()
    assert config["gradient_accumulation_steps"] == n
    assert config["reduction"] == reduction
    assert config["name"] == "acc_opt"
    inner_cfg = config["inner_optimizer"]
    assert inner_cfg["class_name"] == type(opt.inner_optimizer).__name__
    assert inner_cfg["config"] == opt.inner_optimizer.get_config()

    rebuilt = AccumulatingOptimizer.from_config(copy.deepcopy(config))
    assert rebuilt.get_config() == config
    assert type(rebuilt.inner_optimizer) is type(opt.inner_optimizer)
    assert rebuilt.inner_optimizer is not opt.inner_optimizer

    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, AccumulatingOptimizer)
    assert restored.get_config() == config
    assert restored.gradient_accumulation_steps == n and restored.reduction == reduction

    # The rebuilt optimizer trains like the original.
    x, y = make_data(4 * 2 * 2)
    m1 = train(make_mlp(0), opt, x, y, 2, 8)
    m2 = train(make_mlp(0), restored, x, y, 2, 8)
    for a, c in zip(weights(m1), weights(m2)):
        np.testing.assert_array_equal(a, c)
