"""The model of the planner's worked example (README, "How large a
micro-batch?"): a CNN of 6.4 million parameters on 64x64 RGB images, with
Adam, and a batch function.

    python -m accum_optimizer.plan examples.plan_model:build examples.plan_model:batch \\
        --target-batch-size 1024 --memory-limit 512MiB --multiple-of 8 \\
        --json docs/plan/plan.json --plot docs/plan/plan.png

``build()`` returns the compiled model (what a training script would
compile); ``batch(B)`` one batch of B random images and labels (the memory a
step needs does not depend on the values).
"""

from __future__ import annotations

import numpy as np

SIDE, CLASSES = 64, 10


def build():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((SIDE, SIDE, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(128, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(192, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch(micro_batch_size):
    rng = np.random.default_rng(0)
    x = rng.random((micro_batch_size, SIDE, SIDE, 3), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(micro_batch_size,)).astype(np.int32)
    return x, y
