"""Write the checkpoint fixtures of one leg: checkpoints saved mid-window by
*this* version of accum_optimizer, and the training each one must continue
into.

    PYTHONPATH=. python tests/data/checkpoints/generate.py --leg k3 --out tests/data/checkpoints/k3

(with the leg's Python and environment, see .ci/legs.py; the package
imported must be the one whose checkpoints are wanted: check the manifest's
``generated_by.accum_optimizer_file``). For each case of ``CASES`` whose
families are usable here (``tests/support/families.py``), the script

1. trains the case's seeded model, uninterrupted, for the whole plan (the
   reference);
2. trains it again and, after ``save_after`` micro-steps (mid-window),
   records the state and saves it in each of the case's formats, then
   *continues the same in-memory training* to the end of the plan, crossing
   at least one window boundary;
3. requires that the saving run ends bitwise equal to the reference (saving
   must not perturb training), and writes ``<case>/expected.npz``: the state
   at the save (``save.*``) and at the end (``end.*``), as
   ``recipes.keras_state``/``recipes.tf1_state`` read them (model weights,
   every optimizer variable in its saved order, and the named counters and
   accumulators).

``manifest.json`` lists every case (family, formats, N, inner optimizer,
data seed, micro-steps before and after the save, the recipe of the model
and data, file names, the counters at the save and at the end, the
variables' names) and the versions and machine that computed them.
``tests/contract/test_saved_checkpoints.py`` resumes each checkpoint with the
package under test and requires the recorded continuation bitwise.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
sys.path.insert(0, str(TESTS))  # the support package: tests/support/families.py

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import families  # noqa: E402

LEGS = ("k3", "k3-oldest", "tfkeras", "tf215")
K3, K2, ALL = ["k3", "k3-oldest"], ["tfkeras", "tf215"], list(LEGS)

# ------------------------------------------------------------------ recipes
MLP_K3 = {"kind": "mlp", "in": 6, "hidden": 5, "out": 3, "seed": 0, "resume_seed": 123}
MLP_K2 = {"kind": "mlp", "in": 5, "hidden": 4, "out": 3, "seed": 0, "resume_seed": 123}
EMBEDDING = {"kind": "embedding", "vocab": 40, "dim": 4, "ids": 5, "out": 2, "seed": 21, "resume_seed": 123}
SOFTMAX = {"kind": "softmax_regression", "in": 4, "out": 3, "seed": 0, "resume_seed": 9}


def dense(n, model, seed=1, **extra):
    return {"kind": "dense", "n": n, "in": model["in"], "out": model["out"], "seed": seed, **extra}


def ids(n, seed=4):
    return {"kind": "ids", "n": n, "ids": EMBEDDING["ids"], "used": 12, "out": EMBEDDING["out"], "seed": seed}


def whole(stop, flush=False):
    return [{"start": 0, "stop": stop, "flush": flush}]


def keras_opt(cls, steps, module="keras", kwargs=None, **inner_kwargs):
    return {"inner": {"module": module, "class": cls, "kwargs": inner_kwargs},
            "gradient_accumulation_steps": steps, "kwargs": kwargs or {}}


ADAMW_EMA = {"learning_rate": 0.01, "weight_decay": 0.01, "use_ema": True, "ema_momentum": 0.9}
SCHEDULE = {"schedule": [[0, 2], [2, 3]]}  # {0: 2, 2: 3}

CASES = [
    # ------------------------------------------------------------- Keras 3
    dict(
        case="keras3-fit-adamw", family="keras3", requires=["keras3"], legs=K3, driver="fit",
        formats=["keras", "weights_h5", "tf_checkpoint"],
        pins="AdamW (weight decay, EMA), N=3, saved by fit after 1 update + 2 micro-steps: accumulators, "
             "grad_received, row trackers, micro_steps/mini_step/window_weight, the inner moments, EMA shadows "
             "and iterations; the fit-end EMA overwrite",
        model=MLP_K3, data=dense(48, MLP_K3), micro_batch=4, plan=whole(12), save_after=5,
        optimizer=keras_opt("AdamW", 3, **ADAMW_EMA),
    ),
    dict(
        case="keras3-loop-adamw", family="keras3", requires=["keras3"], legs=K3, driver="loop",
        formats=["tf_checkpoint", "weights_h5", "keras"],
        pins="custom tf.function loop, AdamW (amsgrad, weight decay, EMA), N=4, saved after 1 update + 2 "
             "micro-steps; restored into an optimizer that builds inside the first traced step",
        model=MLP_K3, data=dense(48, MLP_K3), micro_batch=4, plan=whole(12), save_after=6,
        optimizer=keras_opt("AdamW", 4, amsgrad=True, **ADAMW_EMA),
    ),
    dict(
        case="keras3-schedule-flush", family="keras3", requires=["keras3"], legs=K3, driver="fit",
        formats=["keras", "weights_h5"],
        pins="dict schedule {0: 2, 2: 3} and FlushPartialWindow: a flushed partial window in epoch 1, saved "
             "mid-window in epoch 2 (mini_step 2 of 3, not micro_steps % N), then an update and a flush",
        model=MLP_K3, data=dense(48, MLP_K3), micro_batch=4,
        plan=[{"start": 0, "stop": 5, "flush": True}, {"start": 5, "stop": 12, "flush": True}], save_after=10,
        optimizer=keras_opt("Adam", SCHEDULE, learning_rate=0.05),
    ),
    dict(
        case="keras3-skip-window", family="keras3", requires=["keras3"], legs=K3, driver="fit",
        formats=["keras", "weights_h5"],
        pins='nonfinite="skip_window": NaN in micro-batches 2 and 8, saved inside the poisoned third window '
             "(window_poisoned, skipped_micro_steps, skipped_windows saved), which must still be discarded",
        model=MLP_K3, data=dense(48, MLP_K3, nan_micro_batches=[1, 7]), micro_batch=4, plan=whole(12), save_after=8,
        optimizer=keras_opt("Adam", 3, kwargs={"nonfinite": "skip_window"}, learning_rate=0.01),
    ),
    dict(
        case="keras3-sparse-sgd", family="keras3", requires=["keras3"], legs=K3, driver="loop",
        formats=["keras", "tf_checkpoint"],
        pins="Embedding(40, 4) with plain SGD (the sparse window: IndexedSlices over the touched rows), N=4, "
             "saved mid-window: the float16 row trackers decide which rows the update touches",
        model=EMBEDDING, data=ids(36), micro_batch=3, plan=whole(12), save_after=6,
        optimizer=keras_opt("SGD", 4, learning_rate=0.5),
    ),
    dict(
        case="keras3-mixed-float16", family="keras3", requires=["keras3"], legs=K3, driver="fit",
        formats=["keras", "weights_h5", "tf_checkpoint"],
        pins='"mixed_float16": compile puts a LossScaleOptimizer outside the wrapper; micro-batch 3 overflows '
             "in float16, so the LossScaleOptimizer skips it (the wrapper never sees it) and halves its scale; "
             "its step counter and scale are saved with the wrapper's state (restored when they build)",
        model={**MLP_K3, "dtype_policy": "mixed_float16"}, data=dense(48, MLP_K3, huge_target_micro_batches=[2]),
        micro_batch=4, plan=whole(12),
        save_after=6, optimizer=keras_opt("Adam", 4, learning_rate=0.01),
    ),
    dict(
        case="keras3-counted-loss", family="keras3", requires=["keras3"], legs=K3, driver="fit",
        formats=["keras", "weights_h5"],
        pins='CountedLoss(MeanSquaredError("mean_with_sample_weight")) with sample weights (micro-batch 5 all '
             "zero): window_weight, the sum of the window's counts, saved mid-window",
        model=MLP_K3, data=dense(48, MLP_K3, sample_weight={"seed": 7, "values": [0.0, 0.5, 1.0, 2.0],
                                                            "zero_micro_batches": [4]}),
        micro_batch=4, plan=whole(12), save_after=5, loss={"kind": "counted_mse", "reduction": "mean_with_sample_weight"},
        optimizer=keras_opt("Adam", 3, learning_rate=0.05),
    ),
    # ------------------------------------------------------------- Keras 2
    dict(
        case="keras2-fit-adamw", family="keras2", requires=["keras2"], legs=K2, driver="fit",
        formats=["keras", "h5", "weights_h5", "weights_tf", "tf_checkpoint"],
        pins="Keras 2 new API: AdamW (weight decay, EMA), N=3, saved by fit after 1 update + 2 micro-steps, "
             "in every format that keeps optimizer state",
        model=MLP_K2, data=dense(48, MLP_K2), micro_batch=4, plan=whole(12), save_after=5,
        optimizer=keras_opt("AdamW", 3, **ADAMW_EMA),
    ),
    dict(
        case="keras2-loop-schedule", family="keras2", requires=["keras2"], legs=K2, driver="loop",
        formats=["h5", "weights_tf", "tf_checkpoint"],
        pins="Keras 2 new API, custom loop: Adam with the dict schedule {0: 2, 2: 3}, opt.flush() after 5 "
             "micro-steps, saved mid-window (mini_step 1 of 3)",
        model=MLP_K2, data=dense(48, MLP_K2), micro_batch=4,
        plan=[{"start": 0, "stop": 5, "flush": True}, {"start": 5, "stop": 12, "flush": False}], save_after=7,
        optimizer=keras_opt("Adam", SCHEDULE, learning_rate=0.05),
    ),
    dict(
        case="legacy-fit-adam", family="legacy", requires=["legacy"], legs=K2, driver="fit",
        formats=["h5", "weights_tf", "tf_checkpoint"],
        pins="Keras 2 legacy OptimizerV2 Adam, N=3, saved by fit after 1 update + 2 micro-steps",
        model=MLP_K2, data=dense(18, MLP_K2), micro_batch=2, plan=whole(9), save_after=5,
        optimizer=keras_opt("Adam", 3, module="legacy", learning_rate=0.05),
    ),
    dict(
        case="legacy-sparse-momentum", family="legacy", requires=["legacy"], legs=K2, driver="fit",
        formats=["h5", "weights_tf", "tf_checkpoint"],
        pins="legacy SGD(momentum) on an Embedding (lazy sparse update over the window's touched rows), N=4, "
             "saved mid-window: the float16 row trackers",
        model=EMBEDDING, data=ids(36), micro_batch=3, plan=whole(12), save_after=6,
        optimizer=keras_opt("SGD", 4, module="legacy", learning_rate=0.5, momentum=0.9),
    ),
    dict(
        case="tfa-lazyadam-embedding", family="legacy", requires=["tfa"], legs=["tf215"], driver="fit",
        formats=["h5", "weights_tf", "tf_checkpoint"],
        pins="tensorflow-addons LazyAdam on an Embedding, N=3, saved mid-window: row trackers and lazy slots",
        model=EMBEDDING, data=ids(36), micro_batch=3, plan=whole(12), save_after=5,
        optimizer=keras_opt("LazyAdam", 3, module="tfa", learning_rate=0.05),
    ),
    dict(
        case="tfa-lookahead-adam", family="legacy", requires=["tfa"], legs=["tf215"], driver="fit",
        formats=["h5", "weights_tf", "tf_checkpoint"],
        pins="tensorflow-addons Lookahead(legacy Adam, sync_period=2), N=3, saved mid-window: slow weights "
             "and the inner Adam's slots inside the inner optimizer",
        model=MLP_K2, data=dense(24, MLP_K2), micro_batch=2, plan=whole(12), save_after=5,
        optimizer={"inner": {"module": "tfa", "class": "Lookahead", "kwargs": {"sync_period": 2},
                             "inner": {"module": "legacy", "class": "Adam", "kwargs": {"learning_rate": 0.05}}},
                   "gradient_accumulation_steps": 3, "kwargs": {}},
    ),
    # ----------------------------------------------------------------- TF1
    dict(
        case="tf1-graph-adam", family="tf1", requires=["tf1"], legs=ALL, driver="tf1_graph",
        formats=["saver"],
        pins="TF1 graph, sess.run(train_op), AdamOptimizer, N=3: a default Saver() checkpoint after 4 runs "
             "(accumulators, micro_steps, mini_step, window_weight, Adam slots and beta powers, global_step)",
        model=SOFTMAX, data={"kind": "classes", "n": 36, "in": 4, "out": 3, "seed": 1}, micro_batch=4,
        plan=whole(9), save_after=4, optimizer=keras_opt("AdamOptimizer", 3, module="tf1", learning_rate=0.02),
    ),
    dict(
        case="tf1-eager-adam", family="tf1", requires=["tf1"], legs=ALL, driver="tf1_eager",
        formats=["tf_checkpoint"],
        pins="TF1 optimizer eagerly (minimize(loss_fn, var_list, global_step)), AdamOptimizer, N=3: "
             "tf.train.Checkpoint after 4 micro-steps, restored before the first step creates the state",
        model=SOFTMAX, data={"kind": "classes", "n": 36, "in": 4, "out": 3, "seed": 1}, micro_batch=4,
        plan=whole(9), save_after=4, optimizer=keras_opt("AdamOptimizer", 3, module="tf1", learning_rate=0.02),
    ),
]


def load_recipes():
    spec = importlib.util.spec_from_file_location("checkpoint_fixture_recipes", HERE / "recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


R = load_recipes()


# -------------------------------------------------------------- generation
def bitwise_equal(a: dict, b: dict) -> list:
    """Keys whose arrays differ (shape, dtype or any bit)."""
    if sorted(a) != sorted(b):
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f")]


def generate_keras(case: dict, case_dir: Path) -> tuple[dict, dict, dict]:
    data = R.make_data(case)
    seed = case["model"]["seed"]
    with R.on_cpu_with_policy(case):
        reference = R.compiled_model(case, seed)
        R.train(case, reference, data)
        reference_state, _ = R.keras_state(case, reference)

        at_save = {}

        def hook(model):
            at_save["state"], _ = R.keras_state(case, model)
            for fmt in case["formats"]:
                path = case_dir / R.FORMAT_FILES[fmt]
                path.parent.mkdir(parents=True, exist_ok=True)
                R.save(case, fmt, model, str(path))

        model = R.compiled_model(case, seed)
        R.train(case, model, data, hook=hook)
        end, names = R.keras_state(case, model)
        failures = load_failures(case, case_dir, at_save["state"])
    info = {"names": names, "perturbed_by_saving": bitwise_equal(end, reference_state)}
    if failures:
        info["load_failures"] = failures
    return at_save["state"], end, info


def load_failures(case: dict, case_dir: Path, at_save: dict) -> dict:
    """The model formats this version writes but cannot ``load_model`` by
    itself (after ``import accum_optimizer``): ``{format: {"error", "workaround"}}``,
    where the workaround (``custom_objects``) restores the saved state exactly."""
    failures = {}
    for fmt in case["formats"]:
        if fmt not in ("keras", "h5"):
            continue
        path = str(case_dir / R.FORMAT_FILES[fmt])
        try:
            R.load(case, fmt, path)
            continue
        except Exception as e:  # recorded, and the workaround checked
            error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        objects = R.custom_objects(case)
        model, _ = R.load(case, fmt, path, objects)
        restored, _ = R.keras_state(case, model)
        if bitwise_equal(restored, at_save):
            raise SystemExit(f"{case['case']} {fmt}: the workaround does not restore the saved state")
        listed = ", ".join(f"{k!r}: {v.__module__}.{v.__name__}" for k, v in objects.items())
        failures[fmt] = {"error": error, "workaround": f"load_model(path, custom_objects={{{listed}}})"}
        print(f"  {fmt}: load_model fails in this version ({error}); the workaround restores it", flush=True)
    return failures


def generate_tf1(case: dict, case_dir: Path) -> tuple[dict, dict, dict]:
    data = R.make_data(case)
    seed, total = case["model"]["seed"], R.total_micro_steps(case)
    (fmt,) = case["formats"]
    path = case_dir / R.FORMAT_FILES[fmt]
    path.parent.mkdir(parents=True, exist_ok=True)
    at_save = {}
    if case["driver"] == "tf1_graph":
        def run(save):
            with tf.Graph().as_default() as graph, graph.device("/CPU:0"), tf.compat.v1.Session() as sess:
                g = R.Tf1Graph(case, seed)
                saver = tf.compat.v1.train.Saver()
                sess.run(tf.compat.v1.global_variables_initializer())

                def hook():
                    at_save["state"], _ = g.state(sess)
                    saver.save(sess, str(path), write_meta_graph=False, write_state=False)

                g.run(sess, data, 0, total, hook if save else None)
                return g.state(sess)
    else:
        def run(save):
            with tf.device("/CPU:0"):
                e = R.Tf1Eager(case, seed)

                def hook():
                    at_save["state"], _ = e.state()
                    e.checkpoint.write(str(path))

                e.run(data, 0, total, hook if save else None)
                return e.state()
    reference, _ = run(save=False)
    end, names = run(save=True)
    return at_save["state"], end, {"names": names, "perturbed_by_saving": bitwise_equal(end, reference)}


def counters(state: dict) -> dict:
    keys = ("micro_steps", "iterations", "mini_step", "global_step", "window_weight")
    return {k: state[f"named.{k}"].item() for k in keys if f"named.{k}" in state}


def files_of(case_dir: Path, root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in case_dir.rglob("*") if p.is_file())


def versions() -> dict:
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import accum_optimizer

    package_dir = Path(accum_optimizer.__file__).resolve().parent
    git = ["git", "-C", str(package_dir)]

    def run(*args):
        out = subprocess.run(git + list(args), capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    model_name, flags = R.cpu()
    return {
        "accum_optimizer_version": accum_optimizer.__version__,
        "accum_optimizer_file": str(Path(accum_optimizer.__file__).resolve()),
        "accum_optimizer_commit": run("rev-parse", "HEAD"),
        "accum_optimizer_package_clean": run("status", "--porcelain", "--", str(package_dir)) == "",
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": version("keras"),
        "tf_keras": version("tf_keras"),
        "tf.keras": families.tf_keras_version(),
        "tensorflow-addons": version("tensorflow-addons"),
        "numpy": np.__version__,
        "TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS"),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "machine": platform.machine(),
        "cpu": model_name,
        "cpu_flags": flags,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leg", required=True, choices=LEGS)
    parser.add_argument("--out", required=True, type=Path, help="the leg's directory (replaced)")
    parser.add_argument("--case", action="append", help="only these cases (default: every case of the leg)")
    args = parser.parse_args(argv)

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {
        "leg": args.leg,
        "about": "Checkpoints saved mid-window and their expected continuation; see generate.py and "
                 "tests/contract/test_saved_checkpoints.py. The continuation is bitwise for the versions below "
                 "on a CPU computing float32 like this one.",
        "generated_by": versions(),
        "format_files": R.FORMAT_FILES,
        "cases": [],
    }
    skipped = []
    for spec in CASES:
        if args.leg not in spec["legs"] or (args.case and spec["case"] not in args.case):
            continue
        reasons = [r for r in map(families.skip_reason, spec["requires"]) if r]
        if reasons:
            skipped.append((spec["case"], reasons))
            continue
        case = copy.deepcopy(spec)
        del case["legs"]
        case_dir = out / case["case"]
        case_dir.mkdir()
        print(f"{args.leg}: {case['case']} ({', '.join(case['formats'])})", flush=True)
        generate = generate_tf1 if case["family"] == "tf1" else generate_keras
        at_save, end, info = generate(case, case_dir)
        if info["perturbed_by_saving"]:
            raise SystemExit(f"{case['case']}: saving perturbed the run that saved: {info['perturbed_by_saving']}")
        np.savez_compressed(case_dir / R.EXPECTED_FILE, **{f"save.{k}": v for k, v in at_save.items()},
                            **{f"end.{k}": v for k, v in end.items()})
        total = R.total_micro_steps(case)
        case.update(
            N=case["optimizer"]["gradient_accumulation_steps"],
            inner_optimizer=case["optimizer"]["inner"],
            data_seed=case["data"]["seed"],
            micro_steps_before_save=case["save_after"],
            micro_steps_after_save=total - case["save_after"],
            rebuild="recipes.py: make_model(case, seed) / make_data(case) / make_optimizer(case) / "
                    "train(case, model, data, start) (TF1: Tf1Graph / Tf1Eager); "
                    "seed = model.seed for the saving run, model.resume_seed for a fresh model to load into",
            files={fmt: f"{case['case']}/{R.FORMAT_FILES[fmt]}" for fmt in case["formats"]},
            expected=f"{case['case']}/{R.EXPECTED_FILE}",
            all_files=files_of(case_dir, out),
            counters_at_save=counters(at_save),
            counters_at_end=counters(end),
            variable_names=info["names"],
        )
        if "load_failures" in info:
            case["load_failures"] = info["load_failures"]
        manifest["cases"].append(case)
    manifest["not_generated_here"] = [{"case": c, "reasons": r} for c, r in skipped]
    with open(out / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{args.leg}: {len(manifest['cases'])} cases, {size / 1024:.0f} KiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
