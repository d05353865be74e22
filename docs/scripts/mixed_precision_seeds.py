"""The mixed-precision equivalence table of ``experiments.mixed_precision`` over
several seeds.

``experiments.mixed_precision`` (and ``tests/keras3/test_mixed_precision.py``) train
one seed: initial weights from seed 0, data from ``default_rng(1)``. This
script repeats the benchmark's runs, with the benchmark's own functions, for
seed ``s`` = initial weights from ``s`` and data from ``default_rng(s + 1)``
(seed 0 is the benchmark's table), and prints per row: the wrapper's max
absolute weight difference from the same policy at batch N*B, Keras'
built-in beside it, whether the two are bitwise equal, and the test's
tolerance for that reference run. Used by docs/mixed-precision.md. Run from
the repository root::

    PYTHONPATH=. .venv/bin/python docs/scripts/mixed_precision_seeds.py [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--policies", default="mixed_float16,mixed_bfloat16",
                   help="comma-separated dtype policies (default: mixed_float16,mixed_bfloat16)")
    p.add_argument("--updates", type=int, default=20, help="updates per run (default: 20)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

    import numpy as np

    from accum_optimizer import AccumulatingOptimizer
    from experiments import mixed_precision as M
    from support.reference import epsilon_16, mixed_precision_tolerance  # the tests' tolerance, as the benchmark

    model = M._model
    print(f"max |weights - same policy at batch {M.N * M.B}| after {args.updates} updates "
          f"(N={M.N}, B={M.B}, model.fit)")
    print(f"{'seed':>4} {'policy':<15} {'inner optimizer':<31} {'accum':>9} {'built-in':>9} "
          f"{'bitwise':>7} {'tolerance':>9} {'within':>6}")
    for seed in [int(s) for s in args.seeds.split(",")]:
        M._model = lambda seed_=0, s=seed: model(s)
        rng = np.random.default_rng(seed + 1)
        x = rng.normal(size=(M.N * M.B * args.updates, 6)).astype("float32")
        y = rng.normal(size=(M.N * M.B * args.updates, 3)).astype("float32")
        for policy in args.policies.split(","):
            for name, make in M._optimizers().items():
                ref, history = M._fit(policy, make(), x, y, M.N * M.B, record=True)
                ours, _ = M._fit(policy, AccumulatingOptimizer(make(), M.N), x, y, M.B)
                builtin, _ = M._fit(policy, make(gradient_accumulation_steps=M.N), x, y, M.B)
                config = make().get_config()
                tol = None
                if policy != "float32" and not isinstance(config["learning_rate"], dict):
                    tol = mixed_precision_tolerance(config, epsilon_16(policy), history)
                diff = M._diff(ours, ref)
                bitwise = all(np.array_equal(a, b) for a, b in zip(ours, builtin))
                print(f"{seed:>4} {policy:<15} {name:<31} {diff:>9.2e} {M._diff(builtin, ref):>9.2e} "
                      f"{'yes' if bitwise else 'no':>7} {'n/a' if tol is None else f'{tol:.2e}':>9} "
                      f"{'n/a' if tol is None else ('yes' if diff <= tol else 'NO'):>6}", flush=True)
    M._model = model


if __name__ == "__main__":
    main()
