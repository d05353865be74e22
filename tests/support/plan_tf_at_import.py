"""The planner's test model, from a module that runs TensorFlow when it is
imported (one op: TensorFlow's runtime and its threads start), as a user's
module may: the planner must not fork a process that holds a running
runtime, and probes in a process of their own instead."""

import tensorflow as tf

from support.plan_models import batch, build  # noqa: F401

STARTED = tf.constant(1.0) + 1.0
