"""TF1 graph code: what is the family's own about flushing a partial window
(weighted windows, flush, resuming mid-window and the bad weights are
contract properties: tests/contract/).

References: the graph's collections; the family's documented error.
"""

from support.families import require

require("tf1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer.families.tf1 import AccumulatingOptimizer  # noqa: E402

tf1 = tf.compat.v1


def test_flush_op_is_not_a_train_op():
    """The flush op is built beside the train op; TRAIN_OP holds the train
    op only (a MonitoredTrainingSession must not run the flush every step)."""
    with tf.Graph().as_default():
        v = tf1.Variable([1.0, -1.0], name="v")
        global_step = tf1.train.get_or_create_global_step()
        grad = tf1.placeholder(tf.float32, [2], name="grad")
        weight = tf1.placeholder_with_default(1.0, [], name="weight")
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), 4)
        train_op = opt.apply_gradients([(grad, v)], global_step=global_step, weight=weight)
        opt.flush()
        assert tf1.get_collection(tf1.GraphKeys.TRAIN_OP) == [train_op]


def test_flush_needs_a_built_accumulating_optimizer():
    with tf.Graph().as_default():
        opt = AccumulatingOptimizer(tf1.train.GradientDescentOptimizer(0.5), 2)
        with pytest.raises(ValueError, match="flush\\(\\) needs"):
            opt.flush()
