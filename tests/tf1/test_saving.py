"""TF1 graph code: Saver checkpoints and MonitoredTrainingSession (issue 8, point 7).

References: the same graph trained without interruption (bitwise), the same
model trained without accumulation (checkpoint keys; batch N*B continuation),
and the plain optimizer trained on batch N*B (MonitoredTrainingSession).
"""

from support.families import require

require("tf1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer.families.tf1 import AccumulatingOptimizer  # noqa: E402
from support.reference_tf1 import (  # noqa: E402
    assert_bitwise,
    assert_close,
    build_mlp,
    mlp_data,
    mlp_init,
    model_and_inner_state,
    values,
)

tf1 = tf.compat.v1

N, B = 3, 4


def _graph(n=N, lr=0.02):
    """Model, global_step, Adam and its train op (accumulating unless n is None)."""
    mlp = build_mlp(mlp_init())
    global_step = tf1.train.get_or_create_global_step()
    inner = tf1.train.AdamOptimizer(lr)
    opt = inner if n is None else AccumulatingOptimizer(inner, n)
    train_op = opt.minimize(mlp.loss, global_step=global_step)
    return mlp, global_step, inner, opt, train_op


def _run(sess, mlp, train_op, x, y, runs, batch):
    for k in runs:
        sess.run(train_op, mlp.feed(x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]))


def _keys(path):
    return sorted(name for name, _ in tf.train.list_variables(path))


def test_default_saver_mid_window_restores_and_continues_bitwise(tmp_path):
    """A default Saver() checkpoint after 4 micro-steps (mid-window, N=3)
    holds the accumulators and counters; restored into a fresh graph, the
    remaining 5 micro-steps give every global variable bitwise equal to
    uninterrupted training."""
    x, y = mlp_data(9 * B)
    path = str(tmp_path / "mid")
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, opt, train_op = _graph()
        saver = tf1.train.Saver()
        sess.run(tf1.global_variables_initializer())
        _run(sess, mlp, train_op, x, y, range(4), B)
        saver.save(sess, path)
        _run(sess, mlp, train_op, x, y, range(4, 9), B)
        expected = values(sess, tf1.global_variables())
        acc_names = sorted(v.name.split(":")[0] for v in opt.accumulation_variables())
    assert set(acc_names) <= set(_keys(path))

    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, opt, train_op = _graph()
        tf1.train.Saver().restore(sess, path)
        assert sess.run(opt.micro_steps) == 4 and sess.run(global_step) == 1
        assert np.any(sess.run(opt.get_slot(mlp.variables["dense/kernel"], "acc_grad")) != 0)
        _run(sess, mlp, train_op, x, y, range(4, 9), B)
        actual = values(sess, tf1.global_variables())
    assert_bitwise(actual, expected)


def test_inference_checkpoint_has_the_keys_of_plain_training(tmp_path):
    """``Saver(var_list=opt.non_optimizer_variables())`` writes no
    accumulator, counter or slot: its keys equal those of the same model
    trained without accumulation (with the same recipe on the plain
    optimizer: model and global_step), and it restores into a graph that has
    only the model and global_step."""
    x, y = mlp_data(2 * N * B)
    path = str(tmp_path / "inference")
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, opt, train_op = _graph()
        sess.run(tf1.global_variables_initializer())
        _run(sess, mlp, train_op, x, y, range(2 * N), B)
        tf1.train.Saver(var_list=opt.non_optimizer_variables()).save(sess, path)
        trained = values(sess, list(mlp.variables.values()) + [global_step])
        optimizer_names = {v.name.split(":")[0] for v in opt.variables()}
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, _, train_op = _graph(n=None)
        sess.run(tf1.global_variables_initializer())
        _run(sess, mlp, train_op, x, y, range(2), N * B)
        plain_state = {v.ref() for v in inner.variables()}
        plain_saver = tf1.train.Saver(var_list=[v for v in tf1.global_variables() if v.ref() not in plain_state])
        plain_path = plain_saver.save(sess, str(tmp_path / "plain"))
    assert _keys(path) == _keys(plain_path) == sorted(trained)
    assert not optimizer_names & set(_keys(path))

    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp = build_mlp(mlp_init(seed=9))
        global_step = tf1.train.get_or_create_global_step()
        tf1.train.Saver().restore(sess, path)
        assert_bitwise(values(sess, list(mlp.variables.values()) + [global_step]), trained)


def test_plain_checkpoint_restores_with_accumulators_at_zero(tmp_path):
    """A default Saver() checkpoint of the same graph trained *without*
    accumulation (2 Adam steps, batch N*B) restores into the accumulating
    graph with ``Saver(opt.non_accumulation_variables())`` after the
    initializer: model, Adam slots, beta powers and global_step as saved,
    accumulators and counters at zero. Training on then matches the plain
    graph continuing from the same checkpoint with batch N*B (2 more
    updates)."""
    x, y = mlp_data(4 * N * B)
    path = str(tmp_path / "plain")
    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, _, train_op = _graph(n=None)
        saver = tf1.train.Saver()
        sess.run(tf1.global_variables_initializer())
        _run(sess, mlp, train_op, x, y, range(2), N * B)
        saver.save(sess, path)
        saved = model_and_inner_state(sess, mlp, inner, global_step)
        _run(sess, mlp, train_op, x, y, range(2, 4), N * B)
        expected = model_and_inner_state(sess, mlp, inner, global_step)

    with tf.Graph().as_default(), tf1.Session() as sess:
        mlp, global_step, inner, opt, train_op = _graph()
        sess.run(tf1.global_variables_initializer())
        tf1.train.Saver(opt.non_accumulation_variables()).restore(sess, path)
        assert_bitwise(model_and_inner_state(sess, mlp, inner, global_step), saved)
        for v in opt.accumulation_variables():
            np.testing.assert_array_equal(sess.run(v), 0, err_msg=v.name)
        _run(sess, mlp, train_op, x, y, range(2 * N, 4 * N), B)
        actual = model_and_inner_state(sess, mlp, inner, global_step)
    assert_close(actual, expected, tol=1e-5)


def test_monitored_training_session_counts_updates_in_global_step(tmp_path):
    """MonitoredTrainingSession with a checkpoint dir and
    StopAtStepHook(last_step=3): it stops after 3 updates = 6 runs (N=2),
    saves model.ckpt-3, and its weights equal 3 plain steps on batch N*B. A
    second session resumes from that checkpoint and, with last_step=5, runs 4
    more micro-steps; the weights then equal 5 plain steps."""
    n = 2
    x, y = mlp_data(5 * n * B)
    ckpt_dir = str(tmp_path / "mts")

    def session_run(last_step):
        with tf.Graph().as_default():
            mlp, global_step, inner, opt, train_op = _graph(n=n)
            runs = 0
            with tf1.train.MonitoredTrainingSession(
                checkpoint_dir=ckpt_dir,
                hooks=[tf1.train.StopAtStepHook(last_step=last_step)],
                save_summaries_steps=None, save_summaries_secs=None, log_step_count_steps=None,
            ) as sess:
                start = sess.run(opt.micro_steps)
                while not sess.should_stop():
                    k = start + runs
                    sess.run(train_op, mlp.feed(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]))
                    runs += 1
            names = [v.name.split(":")[0] for v in mlp.variables.values()]
        # What the CheckpointSaverHook wrote when the session ended.
        latest = tf.train.latest_checkpoint(ckpt_dir)
        return runs, [tf.train.load_variable(latest, name) for name in names]

    with tf.Graph().as_default(), tf1.Session() as sess:  # the reference after 3 and 5 steps
        mlp, _, _, _, train_op = _graph(n=None)
        sess.run(tf1.global_variables_initializer())
        _run(sess, mlp, train_op, x, y, range(3), n * B)
        after_3 = sess.run(list(mlp.variables.values()))
        _run(sess, mlp, train_op, x, y, range(3, 5), n * B)
        after_5 = sess.run(list(mlp.variables.values()))

    runs, state = session_run(3)
    assert runs == 3 * n
    assert tf.train.latest_checkpoint(ckpt_dir).endswith("model.ckpt-3")
    for got, want in zip(state, after_3):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    runs, state = session_run(5)
    assert runs == 2 * n
    assert tf.train.latest_checkpoint(ckpt_dir).endswith("model.ckpt-5")
    for got, want in zip(state, after_5):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

