"""Batch-N·B reference helpers for the Keras 2 (``tf.keras`` is Keras 2) tests.

The accumulating run and its reference share the model architecture, the
initial weights (one seed), the data and the sample order: the reference
trains the plain inner optimizer on batches of ``N·B`` samples, the
accumulating run trains ``AccumulatingOptimizer(inner, N)`` on the same
samples split into ``N`` consecutive micro-batches of ``B``. Both run the
same way (eagerly, or in a ``tf.function``), because some Keras 2 optimizers
round differently in the two.

Import only from test modules that called ``require("keras2")`` (or
``"legacy"``/``"tfa"``) first.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

keras = tf.keras  # Keras 2 here: keras 2.15 on TF 2.15, tf_keras under TF_USE_LEGACY_KERAS=1

IN, HIDDEN, OUT = 5, 4, 3
VOCAB, DIM, SEQ = 12, 3, 2


def dense_model(seed: int = 0, dtype: str = "float32", constraint=None) -> keras.Model:
    """Dense(HIDDEN, tanh) -> Dense(OUT): a dense-gradient model."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.Dense(HIDDEN, activation="tanh", dtype=dtype, kernel_constraint=constraint,
                               input_shape=(IN,)),
            keras.layers.Dense(OUT, dtype=dtype, bias_initializer="glorot_uniform"),
        ]
    )


def embedding_model(seed: int = 0) -> keras.Model:
    """Embedding(VOCAB, DIM) -> Flatten -> Dense(OUT): the embedding table's
    gradient is a ``tf.IndexedSlices`` over the ids looked up."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.Embedding(VOCAB, DIM, input_length=SEQ, input_shape=(SEQ,)),
            keras.layers.Flatten(),
            keras.layers.Dense(OUT),
        ]
    )


def dense_data(n: int, seed: int = 1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, IN)).astype(dtype), rng.normal(size=(n, OUT)).astype(dtype)


def embedding_data(n: int, seed: int = 1, vocab_used: int = VOCAB):
    """Ids drawn from the first ``vocab_used`` rows only, so that the other
    rows are never looked up (what lazy sparse optimizers must leave alone)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab_used, size=(n, SEQ)).astype(np.int32)
    return x, rng.normal(size=(n, OUT)).astype(np.float32)


def mse(y, p):
    return tf.reduce_mean(tf.square(tf.cast(y, p.dtype) - p))


def make_step(model, opt, loss_fn=mse, eager=False, jit=False):
    """One optimizer step on a batch: gradients of ``loss_fn`` (a mean over
    the batch), then ``opt.apply_gradients``."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if eager:
        return step
    return tf.function(step, jit_compile=jit)


def run_pair(make_inner, n, b, updates, model_fn=dense_model, data_fn=dense_data,
             eager=False, reduction="mean", jit=False, loss_fn=mse):
    """Train the reference (batch ``n*b``) and the accumulating run (``n``
    micro-batches of ``b``); record the weights after every update.

    ``make_inner(model)`` builds the plain inner optimizer (the model is
    there for tfa's ``MultiOptimizer``, which needs its layers).

    Returns ``(ref, acc)``: dicts with ``model``, ``opt`` (the optimizer the
    step called), ``inner`` (the plain optimizer whose state is compared),
    ``initial`` (the model's initial weights) and ``trajectory``: after every
    update, the model's weights followed by every variable of the inner
    optimizer (``iterations``, slots, tfa's slow/average weights).
    """
    from accum_optimizer import AccumulatingOptimizer

    x, y = data_fn(n * b * updates)
    out = []
    for accumulate in (False, True):
        model = model_fn()
        inner = make_inner(model)
        opt = AccumulatingOptimizer(inner, n, reduction=reduction) if accumulate else inner
        ref_loss = loss_fn
        if reduction == "sum" and not accumulate:
            ref_loss = lambda y_, p_: loss_fn(y_, p_) * n  # noqa: E731 - the "sum" reference
        step = make_step(model, opt, ref_loss, eager=eager, jit=jit)
        trajectory = []
        for u in range(updates):
            xs, ys = x[u * n * b:(u + 1) * n * b], y[u * n * b:(u + 1) * n * b]
            if accumulate:
                for k in range(n):
                    step(tf.constant(xs[k * b:(k + 1) * b]), tf.constant(ys[k * b:(k + 1) * b]))
            else:
                step(tf.constant(xs), tf.constant(ys))
            trajectory.append([w.numpy().copy() for w in model.weights] + [w.numpy().copy() for w in inner.weights])
        out.append({"model": model, "opt": opt, "inner": inner, "trajectory": trajectory,
                    "initial": [w.numpy() for w in model_fn().weights]})
    return out[0], out[1]


def max_diff(a, b) -> float:
    """Max absolute difference between two lists of arrays of equal shapes."""
    assert len(a) == len(b), (len(a), len(b))
    worst = 0.0
    for u, v in zip(a, b):
        u, v = np.asarray(u), np.asarray(v)
        assert u.shape == v.shape, (u.shape, v.shape)
        if u.size:
            d = float(np.max(np.abs(u.astype(np.float64) - v.astype(np.float64))))
            worst = max(worst, d if np.isfinite(d) else np.inf)  # NaN/inf never passes
    return worst


def moved(run) -> float:
    """How far training moved the model (so a comparison means something)."""
    return max_diff(run["trajectory"][-1][: len(run["initial"])], run["initial"])


def trajectory_diff(ref, acc) -> float:
    return max(max_diff(r, a) for r, a in zip(ref["trajectory"], acc["trajectory"]))


def state_diff(ref, acc) -> float:
    """Max difference over every variable of the inner optimizers (legacy
    ``weights``: ``iterations``, slots, tfa wrappers' slow/average weights),
    compared in order."""
    return max_diff([w.numpy() for w in ref["inner"].weights], [w.numpy() for w in acc["inner"].weights])
