"""Padded token sequences for the masked-loss tests of every Keras family
(``keras3/test_windows.py``, ``contract/test_fit_windows.py``). No Keras
import: the model is the test's, in its family's Keras."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def token_data(seed: int, n: int, max_len: int = 9, vocab: int = 12):
    """Sequences of very different lengths (1..max_len), ids in 1..vocab-1,
    padded with 0; targets are per-token classes."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, max_len + 1, size=n)
    lengths[0], lengths[1] = 1, max_len
    x = np.zeros((n, max_len), "int32")
    y = np.zeros((n, max_len), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, vocab, size=length)
        y[i, :length] = rng.randint(0, 5, size=length)
    return x, y


def padded(x, y, batch: int):
    """Each batch padded to its own longest sequence (what padded_batch does)."""
    lengths = (x > 0).sum(axis=1)

    def gen():
        for i in range(0, len(x), batch):
            t = int(lengths[i : i + batch].max())
            yield x[i : i + batch, :t], y[i : i + batch, :t]

    spec = (tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None, None), tf.int32))
    batches = -(-len(x) // batch)
    return tf.data.Dataset.from_generator(gen, output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(batches))
