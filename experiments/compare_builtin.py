"""Point-by-point: AccumulatingOptimizer vs Keras' built-in accumulation.

For each case, three runs start from the same weights and see the same
samples in the same order:

* reference: the plain inner optimizer, batch N*B (no accumulation);
* ``accum_optimizer``: ``AccumulatingOptimizer(inner, N)``, micro-batch B;
* Keras built-in: ``inner(..., gradient_accumulation_steps=N)``, micro-batch B.

It prints the max absolute weight difference of each accumulating run from the
reference (0 up to float32 rounding means "trains like the large batch"), and
saves the figures as JSON. Run::

    .venv/bin/python -m experiments.compare_builtin [--out bench_output]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

# Two logical CPUs for the MirroredStrategy case (must precede any TF op).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402

N, B, WINDOWS = 4, 4, 6


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    a = keras.layers.Dense(8, activation="tanh", name="trunk")(inp)
    out_a = keras.layers.Dense(3, name="head_a")(a)
    out_b = keras.layers.Dense(3, name="head_b")(a)
    return keras.Model(inp, [out_a, out_b])


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N * B * WINDOWS, 6)).astype("float32")
    y = rng.normal(size=(N * B * WINDOWS, 3)).astype("float32")
    return x, y


def _loss(model, x, y, use_b):
    pa, pb = model(x)
    loss = tf.reduce_mean(tf.square(y - pa))
    if use_b:
        loss += tf.reduce_mean(tf.square(y - pb))
    return loss


def _train(opt, batch, uses_b):
    """Custom loop; ``uses_b(step)`` says whether head_b is in that step's loss
    (when not, its gradient is None, as `tape.gradient` gives it)."""
    model = _model()
    x, y = _data()

    @tf.function
    def step(xb, yb, use_b):
        with tf.GradientTape() as tape:
            loss = _loss(model, xb, yb, use_b)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(len(x) // batch):
        step(tf.constant(x[s * batch : (s + 1) * batch]), tf.constant(y[s * batch : (s + 1) * batch]), uses_b(s))
    # With use_ema, this overwrites the weights with their EMA (what
    # model.fit does at the end of training); otherwise it does nothing.
    opt.finalize_variable_values(model.trainable_variables)
    return [v.numpy() for v in model.trainable_variables]


def _reference_none_last(inner_fn):
    """Reference for the 'None on the last micro-step' case: one step per
    window on the window's mean loss, head_b in all micro-batches but the last."""
    model, opt = _model(), inner_fn()
    x, y = _data()
    for w in range(WINDOWS):
        with tf.GradientTape() as tape:
            loss = tf.add_n(
                [
                    _loss(model, x[(w * N + i) * B : (w * N + i + 1) * B], y[(w * N + i) * B : (w * N + i + 1) * B], i < N - 1)
                    for i in range(N)
                ]
            ) / N
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.trainable_variables]


def _diff(a, b):
    return float(max(np.max(np.abs(x - y)) for x, y in zip(a, b)))


def _case(inner_kwargs_fn, none_last=False):
    def inner(**extra):
        return inner_kwargs_fn(**extra)

    if none_last:
        ref = _reference_none_last(inner)
        uses_b = lambda s: (s % N) != N - 1  # noqa: E731
    else:
        ref = _train(inner(), N * B, lambda s: True)
        uses_b = lambda s: True  # noqa: E731
    ours = _train(AccumulatingOptimizer(inner(), N), B, uses_b)
    builtin = _train(inner(gradient_accumulation_steps=N), B, uses_b)
    return {"accum_optimizer": _diff(ours, ref), "keras_builtin": _diff(builtin, ref)}


def _mirrored_fit():
    """model.fit under a 2-replica MirroredStrategy, against single-device
    batch N*B. Returns the difference, or the error the run raised."""
    x, y = _data()

    def seq():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])

    ref = seq()
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ref.fit(x, y, batch_size=N * B, shuffle=False, verbose=0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {}
    for name, make in [
        ("accum_optimizer", lambda: AccumulatingOptimizer(keras.optimizers.Adam(1e-2), N)),
        ("keras_builtin", lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=N)),
    ]:
        with strategy.scope():
            model = seq()
            model.compile(optimizer=make(), loss="mse")
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), verbose=0)
            out[name] = _diff([v.numpy() for v in model.weights], [v.numpy() for v in ref.weights])
        except Exception as e:  # the built-in's merge_call crash
            out[name] = f"{type(e).__name__}"
    return out


def _sparse_densifications():
    """Dense conversions of an Embedding(100000, 16) gradient per micro-step:
    UnsortedSegmentSum ops on the path every micro-step runs."""
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

    out = {}
    for name, make in [
        ("accum_optimizer", lambda: AccumulatingOptimizer(keras.optimizers.Adam(1e-3), N)),
        ("keras_builtin", lambda: keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N)),
    ]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(100_000, 16),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        opt = make()

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(yb - model(xb)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        graph = step.get_concrete_function(tf.zeros((8, 5), tf.int32), tf.zeros((8, 1))).graph
        ops = list(graph.get_operations())
        # Keras runs its accumulate step in a cond's false branch.
        for f in graph.as_graph_def().library.function:
            if "cond_false" in f.signature.name:
                ops += list(function_def_to_graph(f).get_operations())
        out[name] = sum(op.type == "UnsortedSegmentSum" for op in ops)
    return out


CASES = {
    "constant lr (Adam)": lambda: _case(lambda **k: keras.optimizers.Adam(1e-2, **k)),
    "lr schedule (Adam, PiecewiseConstantDecay in updates)": lambda: _case(
        lambda **k: keras.optimizers.Adam(
            keras.optimizers.schedules.PiecewiseConstantDecay([2, 4], [3e-2, 1e-2, 3e-3]), **k
        )
    ),
    "EMA (Adam, use_ema=True)": lambda: _case(
        lambda **k: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9, **k)
    ),
    "None gradient on last micro-step (Adam)": lambda: _case(
        lambda **k: keras.optimizers.Adam(1e-2, **k), none_last=True
    ),
    "weight decay (AdamW)": lambda: _case(lambda **k: keras.optimizers.AdamW(1e-2, weight_decay=0.1, **k)),
    "global_clipnorm (SGD momentum)": lambda: _case(
        lambda **k: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.1, **k)
    ),
    "model.fit under MirroredStrategy, 2 replicas (Adam)": _mirrored_fit,
    "sparse Embedding: dense conversions per micro-step (count)": _sparse_densifications,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_output", help="folder for compare_builtin.json")
    args = parser.parse_args(argv)
    # Expected along the way: head_b has no gradient on some micro-steps, and
    # fit on a tf.data.Dataset ignores `shuffle`.
    warnings.filterwarnings("ignore", message="Gradients do not exist")
    warnings.filterwarnings("ignore", message=".*shuffle=True.*")
    results = {}
    print(f"max |weights - batch {N * B} reference| after {WINDOWS} updates (N={N}, B={B}, float32)")
    print(f"{'case':58s} {'accum_optimizer':>16s} {'keras built-in':>15s}")
    for name, fn in CASES.items():
        r = fn()
        results[name] = r
        cells = [f"{v:.2e}" if isinstance(v, float) else str(v) for v in (r["accum_optimizer"], r["keras_builtin"])]
        print(f"{name:58s} {cells[0]:>16s} {cells[1]:>15s}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compare_builtin.json"
    env = {"tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version(),
           "machine": platform.machine(), "cpus": os.cpu_count()}
    path.write_text(json.dumps({"N": N, "B": B, "windows": WINDOWS, "results": results, "env": env}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
