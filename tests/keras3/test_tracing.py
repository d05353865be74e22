"""What tracing a custom loop's ``tf.function`` costs with the wrapper
(issue 19, ``docs/performance.md``).

* AutoGraph does not convert the wrapper, nor, below it, the inner
  optimizer: TensorFlow, Keras and tf_keras keep their own code out of
  AutoGraph, and the wrapper does the same. Reference: Keras' own ``fit``,
  whose train step calls ``optimizer.apply`` from Keras code, which AutoGraph
  leaves unconverted: a user's inner optimizer runs the same way under both.
* The traced step grows with the model no faster than Keras' built-in
  accumulation's (ops per trainable variable, at the top level and inside
  the ``cond`` branches).

Timings are the benchmark's (``benchmarks.step_profile``), not asserted here.
"""

from __future__ import annotations

from support.families import require

require("keras3")

import inspect  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402

N = 4


class RecordingSGD(keras.optimizers.SGD):
    """SGD that records whether its update step runs in AutoGraph-generated
    code (a user's optimizer, defined outside Keras: AutoGraph would convert
    it if its caller were converted)."""

    converted_frames: list

    def update_step(self, gradient, variable, learning_rate):
        # The frames from here out to the caller of Keras' optimizer code
        # (the wrapper, or Keras' train step): the user's own converted
        # train step lies beyond.
        frames = inspect.stack(0)
        callers = [i for i, f in enumerate(frames) if "accum_optimizer" in f.filename or f.filename.endswith("trainer.py")]
        assert callers, [f.filename for f in frames]
        self.converted_frames.extend(f.filename for f in frames[: callers[-1]] if "__autograph_generated" in f.filename)
        return super().update_step(gradient, variable, learning_rate)


def _model():
    return _model_of(1)


def _step(model, optimizer):
    @tf.function  # AutoGraph on: the default of a user's train step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _data():
    rng = np.random.default_rng(0)
    return tf.constant(rng.normal(size=(3, 6)).astype("float32")), tf.constant(rng.normal(size=(3, 1)).astype("float32"))


def _graph_ops(step, x, y) -> int:
    graph = step.get_concrete_function(x, y).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def test_autograph_converts_neither_the_wrapper_nor_the_inner_optimizer():
    inner = RecordingSGD(0.1)
    inner.converted_frames = []
    model = _model()
    step = _step(model, AccumulatingOptimizer(inner, gradient_accumulation_steps=N))
    x, y = _data()
    for _ in range(N):  # the update branch is traced at the first call, and runs at the N-th
        step(x, y)
    assert inner.iterations.numpy() == 1
    assert inner.converted_frames == [], sorted(set(inner.converted_frames))

    # The same inner optimizer in Keras' fit (the reference): unconverted too.
    inner_fit = RecordingSGD(0.1)
    inner_fit.converted_frames = []
    model_fit = _model()
    model_fit.compile(optimizer=inner_fit, loss="mse")
    model_fit.fit(x.numpy(), y.numpy(), batch_size=3, epochs=1, verbose=0)
    assert inner_fit.converted_frames == []


def _model_of(layers: int):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,))] + [keras.layers.Dense(6, activation="relu") for _ in range(layers)]
                            + [keras.layers.Dense(1)])


def test_traced_step_grows_no_faster_with_the_model_than_keras_built_in_accumulation():
    """Ops per trainable variable in the traced step (top level and inside
    the cond branches): the wrapper's no more than Keras' built-in's; what
    it adds is a fixed set (counters, the window's cond)."""
    x, y = _data()

    def ops(make_optimizer, layers):
        model = _model_of(layers)
        return _graph_ops(_step(model, make_optimizer()), x, y), len(model.trainable_variables)

    def growth(make_optimizer):
        (small, v_small), (large, v_large) = ops(make_optimizer, 1), ops(make_optimizer, 6)
        return (large - small) / (v_large - v_small)

    ours = growth(lambda: AccumulatingOptimizer(keras.optimizers.Adam(1e-3), gradient_accumulation_steps=N))
    builtin = growth(lambda: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N))
    assert ours <= builtin, (ours, builtin)
