"""A model for the planner's remat choice: a deep MLP of wide GELU layers
whose activations, not its weights, fill the memory, so that rebuilding it
under ``keras.RematScope(mode="activations")`` (the GELU outputs recomputed
in the backward pass) lets a larger micro-batch fit in the same budget."""

import numpy as np

WIDTH, DEPTH, INPUTS, OUTPUTS = 1024, 8, 64, 8


def build():
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((INPUTS,))
    x = inputs
    for i in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="gelu", name=f"gelu{i}")(x)
    model = keras.Model(inputs, keras.layers.Dense(OUTPUTS, name="out")(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def batch(micro_batch_size):
    rng = np.random.default_rng(3)
    return (rng.normal(size=(micro_batch_size, INPUTS)).astype(np.float32),
            rng.normal(size=(micro_batch_size, OUTPUTS)).astype(np.float32))
