"""The benchmarks' models (a ResNet-style CNN, Transformer encoders, an
embedding model) and their synthetic batches, fixed-seed."""

from __future__ import annotations

import functools

from benchmarks._profiles import ALL_MODELS, TRANSFORMERS


def build_model(kind: str, size: dict, seed: int = 0):
    """A small activation-heavy model with fixed-seed weights.

    ``cnn``: ResNet-style CNN on 32x32x3 images (conv stem, basic residual
    blocks with BatchNorm, stride-2 downsampling between stages, global
    average pooling, 10 logits). ``transformer``: pre-norm Transformer
    encoder on ``seq_len`` token ids (token ``Embedding`` + learned positions,
    ``layers`` x (MultiHeadAttention + MLP), mean pooling, 2 logits);
    ``transformer_wide`` and ``transformer_big`` are the same architecture
    at their own sizes (see ``MODEL_SIZES``).
    """
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    if kind == "cnn":
        w, img = size["width"], size["image"]
        inp = keras.Input((img, img, 3), name="image")
        x = L.Conv2D(w, 3, padding="same", use_bias=False)(inp)
        x = L.ReLU()(L.BatchNormalization()(x))
        for stage, n_blocks in enumerate(size["blocks"]):
            filters = w * 2**stage
            for b in range(n_blocks):
                stride = 2 if stage > 0 and b == 0 else 1
                shortcut = x
                y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
                y = L.ReLU()(L.BatchNormalization()(y))
                y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
                y = L.BatchNormalization()(y)
                if stride != 1 or shortcut.shape[-1] != filters:
                    shortcut = L.BatchNormalization()(
                        L.Conv2D(filters, 1, strides=stride, use_bias=False)(x))
                x = L.ReLU()(L.Add()([y, shortcut]))
        x = L.GlobalAveragePooling2D()(x)
        out = L.Dense(10)(x)
        return keras.Model(inp, out, name="resnet_cnn")
    if kind in TRANSFORMERS:
        d, seq = size["dim"], size["seq_len"]
        inp = keras.Input((seq,), dtype="int32", name="tokens")
        x = L.Embedding(size["vocab"], d, name="tokens_embedding")(inp)
        x = _PositionEmbedding(seq, d, name="positions")(x)
        for _ in range(size["layers"]):
            h = L.LayerNormalization()(x)
            h = L.MultiHeadAttention(size["heads"], d // size["heads"])(h, h)
            x = L.Add()([x, h])
            h = L.LayerNormalization()(x)
            h = L.Dense(size["ff"], activation="gelu")(h)
            h = L.Dense(d)(h)
            x = L.Add()([x, h])
        x = L.LayerNormalization()(x)
        x = L.GlobalAveragePooling1D()(x)
        out = L.Dense(2)(x)
        return keras.Model(inp, out, name="transformer_encoder")
    if kind == "embedding":
        # Sparse benchmark: ids -> Embedding(V, dim) -> mean -> Dense(1).
        inp = keras.Input((size["ids_per_example"],), dtype="int32", name="ids")
        x = L.Embedding(size["vocab"], size["dim"], name="table")(inp)
        x = L.GlobalAveragePooling1D()(x)
        out = L.Dense(1)(x)
        return keras.Model(inp, out, name="embedding_model")
    raise ValueError(f"unknown model kind {kind!r}; expected one of {ALL_MODELS + ('embedding',)}")


@functools.lru_cache(maxsize=None)
def _position_embedding_class():
    import keras

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned (seq_len, dim) position table to its input."""

        def __init__(self, seq_len, dim, **kwargs):
            super().__init__(**kwargs)
            self.seq_len, self.dim = seq_len, dim

        def build(self, input_shape):
            self.table = self.add_weight(shape=(self.seq_len, self.dim),
                                         initializer=keras.initializers.RandomNormal(stddev=0.02),
                                         name="table")

        def call(self, x):
            return x + self.table

    return PositionEmbedding


def _PositionEmbedding(*args, **kwargs):  # noqa: N802 - a layer factory
    return _position_embedding_class()(*args, **kwargs)


def model_loss(kind: str):
    import keras

    if kind == "embedding":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_batch(kind: str, size: dict, batch: int, seed: int = 1):
    """One synthetic (x, y) batch of the right shape and dtype, fixed seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "cnn":
        img = size["image"]
        x = rng.normal(size=(batch, img, img, 3)).astype("float32")
        y = rng.integers(0, 10, size=(batch,)).astype("int32")
    elif kind in TRANSFORMERS:
        x = rng.integers(0, size["vocab"], size=(batch, size["seq_len"])).astype("int32")
        y = rng.integers(0, 2, size=(batch,)).astype("int32")
    elif kind == "embedding":
        x = rng.integers(0, size["vocab"], size=(batch, size["ids_per_example"])).astype("int32")
        y = rng.normal(size=(batch, 1)).astype("float32")
    else:
        raise ValueError(kind)
    return x, y
