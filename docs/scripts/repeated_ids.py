"""Adam with repeated embedding ids: the window against plain ``fit`` on the large batch.

An ``Embedding(200_000, 8)`` table, each sample a sequence of 20 ids drawn
uniformly at random, mean-pooled into ``Dense(1)``, MSE. Four runs of
``model.fit`` from the same weights on the same samples in the same order:

* ``plain fit, batch N*B``: the inner optimizer alone; Keras hands it the
  table's gradient as ``tf.IndexedSlices`` with the batch's repeated ids;
* ``accum, micro-batch B``: ``AccumulatingOptimizer(inner, N)``;
* ``dense large batch``: batch N*B, the table's gradient densified before the
  inner optimizer (each row once), which is what the window hands it.

Printed: how many ids repeat within a window, and the max absolute weight
difference of the accumulating run from the two large batches, for Adam at
two learning rates and (as the control, linear in the gradient) plain SGD,
beside how far plain ``fit`` moved the weights. Used by
docs/semantics.md. Run from the repository root::

    PYTHONPATH=. .venv/bin/python docs/scripts/repeated_ids.py [--updates 5]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

VOCAB, DIM, IDS = 200_000, 8, 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=5, help="updates (windows) per run")
    p.add_argument("--steps", type=int, default=8, help="N, micro-batches per window")
    p.add_argument("--micro-batch", type=int, default=32, help="B, samples per micro-batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the ids, targets and initial weights")
    args = p.parse_args()
    n, b = args.steps, args.micro_batch

    import keras
    import numpy as np
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    rng = np.random.default_rng(args.seed)
    x = rng.integers(0, VOCAB, size=(args.updates * n * b, IDS)).astype("int32")
    y = rng.normal(size=(len(x), 1)).astype("float32")

    def model():
        keras.utils.set_random_seed(args.seed)
        inp = keras.Input((IDS,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, DIM)(inp))
        return keras.Model(inp, keras.layers.Dense(1)(h))

    def fit(opt, batch):
        m = model()
        m.compile(optimizer=opt, loss="mse")
        m.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return m

    def dense_large_batch(opt):
        m = model()
        for w in range(args.updates):
            xb, yb = x[w * n * b:(w + 1) * n * b], y[w * n * b:(w + 1) * n * b]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(yb, m(xb)))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, m.trainable_variables)]
            opt.apply_gradients(zip(grads, m.trainable_variables))
        return m

    def diff(a, c):
        return max(float(np.max(np.abs(p - q))) for p, q in zip(a.get_weights(), c.get_weights()))

    windows = x.reshape(args.updates, n * b * IDS)
    repeats = [len(w) - len(np.unique(w)) for w in windows]
    print(f"Embedding({VOCAB:,}, {DIM}), {IDS} uniform random ids per sample; N={n}, B={b}, "
          f"{args.updates} updates\nids per window {n * b * IDS}, repeated within a window: "
          f"{min(repeats)}-{max(repeats)}")
    print(f"{'inner optimizer':<12} {'accum vs plain fit N*B':>24} {'accum vs dense large batch':>28} "
          f"{'weights moved':>14}")
    initial = model()
    for name, make in [("Adam(1e-3)", lambda: keras.optimizers.Adam(1e-3)),
                       ("Adam(1e-2)", lambda: keras.optimizers.Adam(1e-2)),
                       ("SGD(0.5)", lambda: keras.optimizers.SGD(0.5))]:
        plain = fit(make(), n * b)
        accum = fit(AccumulatingOptimizer(make(), n), b)
        dense = dense_large_batch(make())
        print(f"{name:<12} {diff(accum, plain):>24.2e} {diff(accum, dense):>28.2e} {diff(plain, initial):>14.2e}")


if __name__ == "__main__":
    main()
