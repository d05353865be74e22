"""float8 training accumulated: how far each variable ends from the large batch.

A 6-16-3 MLP quantized with ``model.quantize("float8")``, Adam(1e-2), MSE,
trained with ``fit`` for ``--updates`` updates three ways from the same
initial weights (seed 0) and data (``numpy.random.default_rng(1)``): batch
N·B (the large batch), ``AccumulatingOptimizer`` at micro-batch B, and
Keras' built-in ``gradient_accumulation_steps=N`` at B. Prints, per model
variable, the max absolute difference from the large batch (a Markdown
table: docs/mixed-precision.md#float8). Runs on any Keras 3 backend
(``KERAS_BACKEND``).

    PYTHONPATH=. .venv/bin/python docs/scripts/float8.py
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
from keras import ops

from accum_optimizer import AccumulatingOptimizer


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    m.quantize("float8")
    return m


def run(kind: str, n: int, b: int, updates: int) -> tuple[list, list]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n * b * updates, 6)).astype("float32")
    y = rng.normal(size=(n * b * updates, 3)).astype("float32")
    m = model()
    if kind == "large":
        optimizer, batch = keras.optimizers.Adam(1e-2), n * b
    elif kind == "builtin":
        optimizer, batch = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=n), b
    else:
        optimizer, batch = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), n), b
    m.compile(optimizer, "mse")
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    layers = {}
    for v in m.variables:
        layers.setdefault(v.path.split("/")[-2], len(layers) + 1)
    names = [f"{layers[v.path.split('/')[-2]]}: `{v.path.split('/')[-1]}`" for v in m.variables]
    return names, [np.array(ops.convert_to_numpy(v), dtype=np.float64) for v in m.variables]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--b", type=int, default=8)
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    names, large = run("large", args.n, args.b, args.updates)
    _, ours = run("ours", args.n, args.b, args.updates)
    _, builtin = run("builtin", args.n, args.b, args.updates)
    print(f"Keras {keras.__version__}, backend {keras.backend.backend()}, N={args.n}, B={args.b}, "
          f"{args.updates} updates\n")
    print("| layer: variable | accum_optimizer | Keras built-in | largest value |")
    print("|---|---|---|---|")
    for name, lg, o, bi in zip(names, large, ours, builtin):
        print(f"| {name} | {np.max(np.abs(o - lg)):.2e} | {np.max(np.abs(bi - lg)):.2e} "
              f"| {np.max(np.abs(lg)):.2e} |")


if __name__ == "__main__":
    main()
