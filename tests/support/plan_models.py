"""Models and batches for the planner's tests, named as ``"module:function"``
by the tests and imported by its probe processes (``tests/`` on their
``PYTHONPATH``).

``build``: a small Keras CNN compiled with Adam (about 5 thousand
parameters) on 32x32x3 images: its memory is mostly activations (about
0.2 MiB per sample with their gradients), so a few samples' difference
stands far above the CPU allocator's noise, which grows with the parameters'
temporaries; ``batch(B)``: B samples of it (fixed seed).
"""

from __future__ import annotations

import os

import numpy as np

SIDE, CHANNELS, FILTERS, OUT = 32, 3, 16, 10


def build():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((SIDE, SIDE, CHANNELS)),
        keras.layers.Conv2D(FILTERS, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(FILTERS, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(FILTERS, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(OUT),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def batch(micro_batch_size):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(micro_batch_size, SIDE, SIDE, CHANNELS)).astype(np.float32)
    y = rng.normal(size=(micro_batch_size, OUT)).astype(np.float32)
    return x, y


def build_raises():
    raise RuntimeError("the user's build function failed: no such dataset 'imagenet-42'")


OOM_FROM = 24  # batch_oom_above: B at and above this "runs out of memory"


def batch_oom_above(micro_batch_size):
    """``batch`` below ``OOM_FROM``; at and above it, TensorFlow's
    out-of-memory error, as a real allocation failure raises it: the probe
    reports it as such and its process exits (a known ``fits`` boundary
    without exhausting the machine's memory)."""
    if micro_batch_size >= OOM_FROM:
        import tensorflow as tf

        raise tf.errors.ResourceExhaustedError(None, None, f"OOM when allocating a batch of {micro_batch_size}")
    return batch(micro_batch_size)


# An MLP whose state is large beside its activations (about 0.3 M float32
# parameters: 1.2 MiB per copy, so the accumulators stand out in the
# planner's figures on JAX), with layers named for a LayoutMap; 64 inputs,
# 8 outputs, mean squared error.
MLP_IN, MLP_HIDDEN, MLP_OUT = 64, 512, 8
MLP_LAYOUTS = {".*d1/kernel": (None, "model"), ".*d2/kernel": ("model", None), ".*d3/kernel": (None, "model")}
"""Tensor-parallel ``LayoutMap`` entries (path regex -> axes) for ``build_mlp``."""


def build_mlp():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((MLP_IN,)),
        keras.layers.Dense(MLP_HIDDEN, activation="relu", name="d1"),
        keras.layers.Dense(MLP_HIDDEN, activation="relu", name="d2"),
        keras.layers.Dense(MLP_OUT, name="d3"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def batch_mlp(micro_batch_size):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(micro_batch_size, MLP_IN)).astype(np.float32)
    y = rng.normal(size=(micro_batch_size, MLP_OUT)).astype(np.float32)
    return x, y


def set_mlp_distribution(kind):
    """``keras.distribution.set_distribution`` for ``build_mlp`` over every
    JAX device as a 2-row mesh (``batch`` x ``model``): ``"model_parallel"``
    (the ``MLP_LAYOUTS`` kernels sharded over ``model``, the batch over
    ``batch``) or ``"data_parallel"`` (the batch over every device)."""
    import jax
    import keras

    devices = jax.devices()
    if kind == "data_parallel":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh((2, len(devices) // 2), ["batch", "model"], devices)
        layouts = keras.distribution.LayoutMap(mesh)
        for path, axes in MLP_LAYOUTS.items():
            layouts[path] = axes
        distribution = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    return distribution


def build_mlp_model_parallel():
    set_mlp_distribution("model_parallel")
    return build_mlp()


def build_mlp_data_parallel():
    set_mlp_distribution("data_parallel")
    return build_mlp()


# A small sequence model of residual MLP blocks (layer norm, a 4x wider gelu
# layer, back to the width) where remat changes the plan: each block is one
# layer of several operations, so keras.RematScope(mode="full") keeps only
# its input for the backward pass instead of its internals.
BLOCKS_LEN, BLOCKS_WIDTH, BLOCKS_DEPTH, BLOCKS_OUT = 32, 64, 3, 8


def build_blocks():
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, width, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.LayerNormalization()
            self.wide = keras.layers.Dense(4 * width, activation="gelu")
            self.back = keras.layers.Dense(width)

        def call(self, x):
            return x + self.back(self.wide(self.norm(x)))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((BLOCKS_LEN, BLOCKS_WIDTH))]
                             + [Block(BLOCKS_WIDTH) for _ in range(BLOCKS_DEPTH)]
                             + [keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(BLOCKS_OUT)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def batch_blocks(micro_batch_size):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(micro_batch_size, BLOCKS_LEN, BLOCKS_WIDTH)).astype(np.float32)
    y = rng.normal(size=(micro_batch_size, BLOCKS_OUT)).astype(np.float32)
    return x, y


def batch_killed_above(micro_batch_size):
    """``batch`` below ``OOM_FROM``; at and above it the probe's process is
    killed with ``SIGKILL``, as the kernel's out-of-memory killer ends a
    process that outgrew the machine's memory."""
    if micro_batch_size >= OOM_FROM:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return batch(micro_batch_size)
