"""Equivalence under mixed precision: accumulation against the large batch in
the same dtype policy, with Keras' built-in accumulation beside it.

For each dtype policy (``mixed_float16``, ``mixed_bfloat16``, and ``float32``
for scale) and inner optimizer, four ``model.fit`` runs start from the same
weights and see the same samples in the same order:

* reference: the plain inner optimizer, batch N*B, in the policy;
* ``accum_optimizer``: ``AccumulatingOptimizer(inner, N)``, micro-batch B;
* Keras built-in: ``inner(..., gradient_accumulation_steps=N)``, micro-batch B;
* the reference in float32, to show how far the policy's own rounding moves
  this training (the scale the mixed-precision differences live on).

Under ``mixed_float16`` ``compile`` wraps each optimizer in a
``LossScaleOptimizer``. The table gives the max absolute weight difference
from the reference, the tolerance ``tests/keras3/test_mixed_precision.py`` asserts
for that case (``tests/support/precision.py: mixed_precision_tolerance``, n/a where a
learning-rate schedule makes it inapplicable), and how far the weights moved.
Run::

    .venv/bin/python -m experiments.mixed_precision [--out bench_output] [--updates 20]
    .venvs/k3-jax/bin/python -m experiments.mixed_precision --backend jax --out docs/benchmarks/backends

``--backend jax|torch`` (default: ``KERAS_BACKEND``, else tensorflow) runs the
same fits on that Keras backend (no TensorFlow needed; a venv with it:
``.venvs/k3-jax``, ``.venvs/k3-torch``), each ``fit`` compiled the
backend's default way, as ``benchmarks.overhead --backend`` times it: XLA
on JAX (``jit_compile=True``; JAX eager takes about 15 minutes on 2 CPU
cores), eager on torch; on TensorFlow a ``tf.function`` without XLA
(``jit_compile=False``).

It writes ``mixed_precision.json`` (raw figures, versions) and
``mixed_precision.md`` (the table); ``mixed_precision_jax.*``,
``mixed_precision_torch.*`` for the other backends.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "experiments"

from benchmarks._devices import select_backend  # noqa: E402
from benchmarks._env import backend_env, static_env, tests_support, tf_env  # noqa: E402
from benchmarks._output import Progress, clean_floats, format_table, write_json  # noqa: E402
from benchmarks._profiles import add_backend_arg, benchmark_parser  # noqa: E402

N, B = 4, 8
POLICIES = ("mixed_float16", "mixed_bfloat16", "float32")


def _optimizers():
    import keras

    def cosine(**k):
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=16, warmup_target=2e-2, warmup_steps=4)  # counted in updates
        return keras.optimizers.Adam(schedule, **k)

    return {
        "Adam(1e-2)": lambda **k: keras.optimizers.Adam(1e-2, **k),
        "SGD(0.05, momentum=0.9)": lambda **k: keras.optimizers.SGD(0.05, momentum=0.9, **k),
        "Adam, warmup + cosine schedule": cosine,
    }


def _model(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def _fit(policy, optimizer, x, y, batch, record=False, jit_compile=False):
    import keras
    import numpy as np

    history = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            history.append(self._flat())

        def on_train_batch_end(self, batch, logs=None):
            history.append(self._flat())

        def _flat(self):
            return np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in self.model.trainable_variables])

    keras.mixed_precision.set_global_policy(policy)
    try:
        model = _model()
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[Record()] if record else [])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return [np.asarray(w.numpy(), np.float64) for w in model.weights], history


def _diff(a, b):
    import numpy as np

    return float(max(np.max(np.abs(p - q)) for p, q in zip(a, b)))


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, profiles=False)
    parser.add_argument("--out", default="bench_output", help="output folder (default: bench_output)")
    parser.add_argument("--updates", type=int, default=20, help="updates per run (default: 20)")
    add_backend_arg(parser)
    args = parser.parse_args(argv)
    if args.updates < 1:
        parser.error(f"--updates={args.updates}: expected an int >= 1")
    select_backend(parser, args.backend)
    env = static_env()
    env.update(tf_env() if args.backend == "tensorflow" else backend_env(args.backend))
    warnings.filterwarnings("ignore", message=".*shuffle=True.*")

    import numpy as np

    tests_support()
    from support.precision import epsilon_16, mixed_precision_tolerance  # the tests' tolerance (NumPy only)

    from accum_optimizer import AccumulatingOptimizer

    rng = np.random.default_rng(1)
    x = rng.normal(size=(N * B * args.updates, 6)).astype("float32")
    y = rng.normal(size=(N * B * args.updates, 3)).astype("float32")
    optimizers = _optimizers()
    jit = args.backend == "jax"  # each backend's default: XLA on JAX, eager on torch; TF: no XLA
    prog = Progress("mixed_precision", len(POLICIES) * len(optimizers))
    rows, results = [], []
    for policy in POLICIES:
        for name, make in optimizers.items():
            t0 = time.perf_counter()
            ref, history = _fit(policy, make(), x, y, N * B, record=True, jit_compile=jit)
            ours, _ = _fit(policy, AccumulatingOptimizer(make(), N), x, y, B, jit_compile=jit)
            builtin, _ = _fit(policy, make(gradient_accumulation_steps=N), x, y, B, jit_compile=jit)
            in_float32, _ = _fit("float32", make(), x, y, N * B, jit_compile=jit)
            initial = [np.asarray(w.numpy(), np.float64) for w in _model().weights]
            config = make().get_config()
            tolerance = None
            if policy != "float32" and not isinstance(config["learning_rate"], dict):
                tolerance = mixed_precision_tolerance(config, epsilon_16(policy), history)
            r = {
                "policy": policy,
                "optimizer": name,
                "accum_optimizer": _diff(ours, ref),
                "keras_builtin": _diff(builtin, ref),
                "test_tolerance": tolerance,
                "reference_vs_float32": _diff(ref, in_float32),
                "weights_moved": _diff(ref, initial),
            }
            results.append(r)
            rows.append([policy, name, f"{r['accum_optimizer']:.2e}", f"{r['keras_builtin']:.2e}",
                         "n/a" if tolerance is None else f"{tolerance:.2e}",
                         f"{r['reference_vs_float32']:.2e}", f"{r['weights_moved']:.3f}"])
            prog.step(f"{policy} {name}", f"accum {r['accum_optimizer']:.2e}, built-in {r['keras_builtin']:.2e}",
                      time.perf_counter() - t0)
    headers = ["policy", "inner optimizer", "accum_optimizer", "Keras built-in", "test tolerance",
               "batch N·B vs float32", "weights moved"]
    title = (f"max |weights - same policy at batch {N * B}| after {args.updates} updates "
             f"(N={N}, B={B}, model.fit{'' if args.backend == 'tensorflow' else ', Keras on ' + args.backend}"
             f"{', jit_compile' if jit else ''})")
    print(title)
    print(format_table(headers, rows))
    out = Path(args.out)
    python = ".venv/bin/python" if args.backend == "tensorflow" else f".venvs/k3-{args.backend}/bin/python"
    command = " ".join([python, "-m", "experiments.mixed_precision", *(argv if argv is not None else sys.argv[1:])])
    data = {"N": N, "B": B, "updates": args.updates, "results": results, "env": env, "command": command}
    if args.backend != "tensorflow":
        data.update(backend=args.backend, jit_compile=jit)
    name = "mixed_precision" if args.backend == "tensorflow" else f"mixed_precision_{args.backend}"
    write_json(out / f"{name}.json", clean_floats(data))
    (out / f"{name}.md").write_text(
        f"{title}\n\n{format_table(headers, rows, markdown=True)}\n\nProduced by `{command}`.\n")
    prog.note(f"wrote {out / f'{name}.json'}, {out / f'{name}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
