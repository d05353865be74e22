"""TF1 graph code: weighted windows and flush (issue 9).

References: the same graph (same initial values, sample order) trained by
the plain inner optimizer on the large batch each window stands for (the
window's micro-batches concatenated); values computed by hand with
``GradientDescentOptimizer``; the same graph trained without interruption
(bitwise). Tolerance of the large-batch comparisons: float32 rounding of a
few updates (1e-6; the weighted window forms ``c * (S / c)`` instead of
``S``). Accumulation schedules are not supported by this family
(``gradient_accumulation_steps`` is an int here).
"""

from support.families import require

require("tf1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer.families.tf1 import AccumulatingOptimizer  # noqa: E402
from support.reference_tf1 import (  # noqa: E402
    build_mlp,
    control_flow,
    max_abs_diff,
    mlp_data,
    mlp_init,
    model_and_inner_state,
)

tf1 = tf.compat.v1
TOL = 1e-6


def _train(sizes, n=None, windows=None, weighted=True, flush_at_end=False, mode="v2"):
    """Adam(0.05) with global_step on the MLP. ``n=None``: the reference,
    one run per batch of ``windows`` sizes. Otherwise the accumulating run
    on micro-batches of ``sizes``, ``minimize(..., weight=<placeholder>)``
    fed each micro-batch's sample count (if ``weighted``), then a flush (if
    ``flush_at_end``). Returns :func:`model_and_inner_state`."""
    batches = windows if n is None else sizes
    x, y = mlp_data(sum(batches))
    with control_flow(mode), tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(mlp_init())
        global_step = tf1.train.get_or_create_global_step()
        inner = tf1.train.AdamOptimizer(0.05)
        weight = tf1.placeholder(tf.float32, [], name="weight")
        if n is None:
            train_op = inner.minimize(mlp.loss, global_step=global_step)
        else:
            opt = AccumulatingOptimizer(inner, n)
            train_op = opt.minimize(mlp.loss, global_step=global_step, weight=weight if weighted else None)
            flush = opt.flush()
        sess.run(tf1.global_variables_initializer())
        start = 0
        for b in batches:
            feed = mlp.feed(x[start: start + b], y[start: start + b])
            feed[weight] = float(b)
            sess.run(train_op, feed)
            start += b
        if flush_at_end:
            sess.run(flush)
        return model_and_inner_state(sess, mlp, inner, global_step)


@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_unequal_micro_batches_with_sample_counts_equal_their_concatenation(mode):
    """N = 3, micro-batches of 4, 4, 2 | 3, 1, 5 with weight = sample count
    equal Adam on batches of 10 and 9 (model, slots, beta powers,
    global_step). Control flow v2 (resource variables) and v1
    (RefVariables). Without the weights the run differs."""
    sizes = [4, 4, 2, 3, 1, 5]
    expected = _train(sizes, windows=[10, 9], mode=mode)
    assert max_abs_diff(_train(sizes, n=3, mode=mode), expected) <= TOL
    if mode == "v2":
        assert max_abs_diff(_train(sizes, n=3, weighted=False), expected) > 100 * TOL


def test_flush_at_the_end_of_an_epoch_equals_the_smaller_last_batch():
    """Micro-batches 4, 4, 2 (a window of N = 3), then 3, 2 and a flush
    (a partial window of 2 micro-steps, normalised by its counts 3 + 2):
    Adam on batches of 10 and 5; global_step counts the flushed update."""
    expected = _train(None, windows=[10, 5])
    actual = _train([4, 4, 2, 3, 2], n=3, flush_at_end=True)
    assert int(actual["global_step"]) == 2
    assert max_abs_diff(actual, expected) <= TOL


def _sgd_graph(n=4):
    """v = [1, -1]; GradientDescent(0.5); gradient and weight fed."""
    v = tf1.Variable([1.0, -1.0], name="v")
    global_step = tf1.train.get_or_create_global_step()
    grad = tf1.placeholder(tf.float32, [2], name="grad")
    weight = tf1.placeholder_with_default(1.0, [], name="weight")
    opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), n)
    train_op = opt.apply_gradients([(grad, v)], global_step=global_step, weight=weight)
    return v, global_step, grad, weight, opt, train_op


def test_flush_normalises_by_what_the_window_holds_and_is_a_no_op_when_empty():
    """Hand-computed: after 2 micro-steps of a window of 4, the flush op
    applies (c1·g1 + c2·g2) / (c1 + c2) (unweighted: c = 1) and increments
    global_step once; run again on the empty window it changes nothing; the
    next window is a full window of 4. The flush op is not a TRAIN_OP."""
    g1, g2 = np.array([1.0, 2.0], "float32"), np.array([3.0, -6.0], "float32")
    for c1, c2 in ((1.0, 1.0), (1.0, 3.0)):
        with tf.Graph().as_default(), tf1.Session() as sess:
            v, global_step, grad, weight, opt, train_op = _sgd_graph()
            flush = opt.flush()
            assert tf1.get_collection(tf1.GraphKeys.TRAIN_OP) == [train_op]
            sess.run(tf1.global_variables_initializer())
            sess.run(flush)  # empty window before any micro-step
            assert sess.run(global_step) == 0
            sess.run(train_op, {grad: g1, weight: c1})
            sess.run(train_op, {grad: g2, weight: c2})
            sess.run(flush)
            expected = np.array([1.0, -1.0], "float32") - 0.5 * (c1 * g1 + c2 * g2) / (c1 + c2)
            np.testing.assert_allclose(sess.run(v), expected, rtol=0, atol=1e-7)
            assert sess.run([global_step, opt.micro_steps, opt.mini_step]) == [1, 2, 0]
            sess.run(flush)
            np.testing.assert_allclose(sess.run(v), expected, rtol=0, atol=1e-7)
            assert sess.run(global_step) == 1
            for _ in range(3):
                sess.run(train_op, {grad: g1})
            assert sess.run(global_step) == 1
            sess.run(train_op, {grad: g1})
            assert sess.run(global_step) == 2


def test_sum_reduction_multiplies_each_micro_gradient_by_its_weight():
    g1, g2 = np.array([0.25, 1.0], "float32"), np.array([-2.0, 0.5], "float32")
    with tf.Graph().as_default(), tf1.Session() as sess:
        v = tf1.Variable([1.0, -2.0])
        grad, weight = tf1.placeholder(tf.float32, [2]), tf1.placeholder(tf.float32, [])
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), 2, reduction="sum")
        train_op = opt.apply_gradients([(grad, v)], weight=weight)
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {grad: g1, weight: 3.0})
        sess.run(train_op, {grad: g2, weight: 0.5})
        np.testing.assert_allclose(sess.run(v), np.array([1.0, -2.0]) - 0.5 * (3 * g1 + 0.5 * g2), rtol=0, atol=1e-7)


def test_window_of_zero_counts_applies_nothing():
    """Counts all 0 (mean and sum), Adam: global_step does not move; the
    model and every inner variable are bitwise unchanged; the accumulators
    are zero; a flush of a zero-count partial window applies nothing."""
    x, y = mlp_data(12)
    for reduction in ("mean", "sum"):
        with tf.Graph().as_default(), tf1.Session() as sess:
            mlp = build_mlp(mlp_init())
            global_step = tf1.train.get_or_create_global_step()
            inner = tf1.train.AdamOptimizer(0.1)
            opt = AccumulatingOptimizer(inner, 2, reduction=reduction)
            train_op = opt.minimize(mlp.loss, global_step=global_step, weight=0.0)
            flush = opt.flush()
            sess.run(tf1.global_variables_initializer())
            before = model_and_inner_state(sess, mlp, inner, global_step)
            for k in range(3):
                sess.run(train_op, mlp.feed(x[4 * k: 4 * k + 4], y[4 * k: 4 * k + 4]))
            sess.run(flush)
            after = model_and_inner_state(sess, mlp, inner, global_step)
            assert sess.run([opt.micro_steps, opt.mini_step]) == [3, 0]
            for name in before:
                np.testing.assert_array_equal(after[name], before[name], err_msg=name)
            for v in mlp.variables.values():
                np.testing.assert_array_equal(sess.run(opt.get_slot(v, "acc_grad")), 0)


def _resumable(stop, saver_vars=None, weighted=True, flush=True, directory=None):
    """N = 3, Adam, micro-batches of 2 with weight k + 1 (``weighted``):
    2 micro-steps, flush (``flush``), 2 micro-steps (mid-window: mini_step
    2, micro_steps 4, micro_steps % N = 1), [``stop``: save with a Saver
    over ``saver_vars(opt)`` (default: all), restore into a new graph whose
    model starts from other values], 4 more micro-steps. Returns the final
    model and inner state, and (``"counters"``) micro_steps, mini_step."""
    x, y = mlp_data(16)

    def graph(seed):
        mlp = build_mlp(mlp_init(seed=seed))
        global_step = tf1.train.get_or_create_global_step()
        inner = tf1.train.AdamOptimizer(0.05)
        opt = AccumulatingOptimizer(inner, 3)
        weight = tf1.placeholder(tf.float32, [])
        train_op = opt.minimize(mlp.loss, global_step=global_step, weight=weight if weighted else None)
        return mlp, global_step, inner, opt, weight, train_op, opt.flush()

    def run(sess, parts, ks):
        mlp, _, _, _, weight, train_op, _ = parts
        for k in ks:
            feed = mlp.feed(x[2 * k: 2 * k + 2], y[2 * k: 2 * k + 2])
            feed[weight] = float(k + 1)
            sess.run(train_op, feed)

    def state(sess, parts):
        mlp, global_step, inner, opt = parts[:4]
        result = model_and_inner_state(sess, mlp, inner, global_step)
        result["counters"] = np.array(sess.run([opt.micro_steps, opt.mini_step]))
        return result

    with tf.Graph().as_default(), tf1.Session() as sess:
        parts = graph(0)
        sess.run(tf1.global_variables_initializer())
        run(sess, parts, range(2))
        if flush:
            sess.run(parts[-1])
        run(sess, parts, range(2, 4))
        if not stop:
            run(sess, parts, range(4, 8))
            return state(sess, parts)
        path = tf1.train.Saver(saver_vars(parts[3]) if saver_vars else None).save(sess, str(directory / "ckpt"))
    with tf.Graph().as_default(), tf1.Session() as sess:
        parts = graph(7)
        sess.run(tf1.global_variables_initializer())
        tf1.train.Saver(saver_vars(parts[3]) if saver_vars else None).restore(sess, path)
        run(sess, parts, range(4, 8))
        return state(sess, parts)


def test_default_saver_mid_window_after_a_flush_resumes_exactly(tmp_path):
    """A default Saver keeps mini_step and window_weight: resuming mid-window
    after a flush (where mini_step != micro_steps % N) is bitwise the
    uninterrupted run."""
    straight = _resumable(stop=False)
    resumed = _resumable(stop=True, directory=tmp_path)
    np.testing.assert_array_equal(resumed["counters"], [8, 0])
    assert straight.keys() == resumed.keys()
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


def test_checkpoint_without_the_window_variables_resumes_at_micro_steps_mod_n(tmp_path):
    """A checkpoint that lacks mini_step and window_weight (saved before they
    existed; restored with a Saver over the other variables): unweighted,
    no flush, it resumes bitwise (the position is micro_steps % N)."""

    def without_window(opt):
        return [v for v in tf1.global_variables() if v is not opt.mini_step and v is not opt.window_weight]

    straight = _resumable(stop=False, weighted=False, flush=False)
    resumed = _resumable(stop=True, saver_vars=without_window, weighted=False, flush=False, directory=tmp_path)
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


@pytest.mark.parametrize("bad, error, words", [
    (-1.0, ValueError, "weight=-1.0"),
    (float("inf"), ValueError, "weight=inf"),
    ([1.0, 2.0], ValueError, "shape (2,)"),
    ("3", TypeError, "weight='3'"),
])
def test_bad_weight_gets_a_clear_error_when_the_op_is_built(bad, error, words):
    with tf.Graph().as_default():
        v, *_ = _sgd_graph()
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), 2)
        with pytest.raises(error, match="weight") as info:
            opt.apply_gradients([(tf.constant([1.0, 1.0]), v)], weight=bad)
        assert words in str(info.value)


def test_negative_fed_weight_stops_the_run_before_any_write():
    with tf.Graph().as_default(), tf1.Session() as sess:
        v, global_step, grad, weight, opt, train_op = _sgd_graph(n=2)
        sess.run(tf1.global_variables_initializer())
        sess.run(train_op, {grad: [1.0, 1.0], weight: 2.0})
        with pytest.raises(tf.errors.InvalidArgumentError, match="weight"):
            sess.run(train_op, {grad: [1.0, 1.0], weight: -1.0})
        assert sess.run([opt.micro_steps, opt.mini_step, opt.window_weight]) == [1, 1, 2.0]
        np.testing.assert_array_equal(sess.run(opt.get_slot(v, "acc_grad")), [2.0, 2.0])
        np.testing.assert_array_equal(sess.run(v), [1.0, -1.0])


def test_flush_needs_a_built_accumulating_optimizer():
    with tf.Graph().as_default():
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), 2)
        with pytest.raises(ValueError, match="flush\\(\\) needs"):
            opt.flush()

