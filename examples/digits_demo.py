"""Gradient accumulation that trains like the large batch: a side-by-side demo.

A small CNN is trained on scikit-learn's bundled 8x8 handwritten digits (no
download) three times, from the same initial weights and in the same sample
order:

1. ``reference``: batch ``micro_batch * steps`` (128) with plain AdamW;
2. ``accum``: micro-batch 16 with ``AccumulatingOptimizer(AdamW, 8)``;
3. ``keras``: micro-batch 16 with Keras' built-in
   ``AdamW(..., gradient_accumulation_steps=8)``.

AdamW uses a warmup + cosine learning-rate schedule whose ``decay_steps`` count
*updates*, decoupled weight decay, and an EMA of the weights (``use_ema=True``;
at the end of ``fit`` Keras overwrites the weights with their EMA). Run 2
matches the reference to float32 rounding, both the live weights and the EMA.
Keras' built-in accumulation advances the schedule and the EMA once per
*micro-step*, so run 3 drifts away from the reference.

``--all-samples`` keeps every training sample (1,347; B = 16 does not
divide it, nor does 128): each epoch ends on a micro-batch of 3 samples and
a partial window of 5 micro-batches, and the reference's last batch has 67
samples. A fourth run, ``exact``, then trains with
``CountedLoss`` (each micro-step weighted by its sample count) and
``FlushPartialWindow`` (each epoch ends on an update) and matches the
reference; ``accum`` (plain mean, partial window carried over) does not.

Each run trains in a fresh subprocess of this script (hidden ``--run`` mode) so
that its peak memory can be measured on its own; it writes its weights (after
every epoch and at the end) and its figures to the output folder, where the
parent compares them, prints a table, and writes ``loss_curves.png`` and
``results.json``. The exit status is 1 if run 2 differs from the reference by
more than ``--tolerance``.

    python examples/digits_demo.py [--epochs 5] [--micro-batch 16] [--steps 8] [--all-samples]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

RUNS = {
    "reference": "batch {batch}, plain AdamW",
    "accum": "micro-batch {micro} x {steps}, AccumulatingOptimizer",
    "keras": "micro-batch {micro} x {steps}, Keras built-in accumulation",
    "exact": "micro-batch {micro} x {steps}, AccumulatingOptimizer + CountedLoss + FlushPartialWindow",
}
DEFAULT_RUNS = ("reference", "accum", "keras")
SEED = 1234
PEAK_LR, WEIGHT_DECAY, EMA_MOMENTUM = 3e-3, 1e-2, 0.9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Trains a CNN on sklearn's digits with a large batch, with "
        "AccumulatingOptimizer, and with Keras' built-in accumulation, and "
        "compares the weights.",
        epilog="Writes loss_curves.png, results.json and the runs' weights (.npz) "
        "to --out. Exit status 0 if the AccumulatingOptimizer run matches the "
        "reference within --tolerance, 1 if it does not or a run fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=5, help="epochs per run")
    p.add_argument("--micro-batch", type=int, default=16,
                   help="micro-batch size of the two accumulating runs")
    p.add_argument("--steps", type=int, default=8,
                   help="gradient_accumulation_steps (>= 2); the reference batch "
                   "is micro-batch * steps")
    p.add_argument("--out", type=Path, default=Path("demo_output"),
                   help="folder for the plot, results.json and per-run weights")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest max-abs weight difference (float32) allowed "
                   "between the AccumulatingOptimizer run and the reference; "
                   "beyond it the demo exits with status 1")
    p.add_argument("--all-samples", action="store_true",
                   help="keep all training samples (the batch sizes do not divide them) "
                        "and add the run 'exact': CountedLoss + FlushPartialWindow")
    p.add_argument("--run", choices=sorted(RUNS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, value, low, why in [
        ("--epochs", args.epochs, 1, ""),
        ("--micro-batch", args.micro_batch, 1, ""),
        ("--steps", args.steps, 2, " (Keras' built-in accumulation, run 3, needs at least 2)"),
    ]:
        if value < low:
            p.error(f"{flag} must be an integer >= {low}{why}; received {flag} {value}")
    if not args.tolerance > 0:
        p.error(f"--tolerance must be a positive number; received --tolerance {args.tolerance}")
    return args


def import_tf():
    """Import TensorFlow and Keras. TF 2.21 logs a few C++ INFO lines at import
    that ignore TF_CPP_MIN_LOG_LEVEL; unless that is set to 0, send the
    process's stderr to /dev/null while importing (Python errors still show)."""
    quiet = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") != "0"
    saved = os.dup(2) if quiet else None
    if quiet:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    try:
        import keras
        import tensorflow as tf
    finally:
        if quiet:
            os.dup2(saved, 2)
            os.close(saved)
    return tf, keras


def load_data(batch: int, all_samples: bool = False):
    """Digits scaled to [0, 1] as (8, 8, 1) float32; a fixed stratified split,
    training set cut to a multiple of ``batch`` so each large batch is exactly
    ``steps`` micro-batches (unless ``all_samples``)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y)
    n = len(x_tr) if all_samples else len(x_tr) // batch * batch
    if n == 0:
        raise SystemExit(f"Reference batch {batch} exceeds the {len(x_tr)} training samples.")
    return x_tr[:n], y_tr[:n], x_te, y_te


def build_model():
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, activation="relu"),
        layers.Flatten(),
        layers.Dense(10),  # logits
    ], name="digits_cnn")


def make_optimizer(run: str, total_updates: int, steps: int):
    """AdamW with warmup + cosine decay (in updates), weight decay and EMA."""
    import keras
    from accum_optimizer import AccumulatingOptimizer

    warmup = max(1, total_updates // 10)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=PEAK_LR / 10, decay_steps=total_updates - warmup,
        alpha=0.05, warmup_target=PEAK_LR, warmup_steps=warmup)
    kw = dict(learning_rate=schedule, weight_decay=WEIGHT_DECAY,
              use_ema=True, ema_momentum=EMA_MOMENTUM)
    if run == "reference":
        return keras.optimizers.AdamW(**kw)
    if run in ("accum", "exact"):
        return AccumulatingOptimizer(keras.optimizers.AdamW(**kw), gradient_accumulation_steps=steps)
    return keras.optimizers.AdamW(**kw, gradient_accumulation_steps=steps)


def vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    """Train one run; write ``weights_<run>.npz`` and ``run_<run>.json``."""
    import numpy as np

    tf, keras = import_tf()
    keras.utils.set_random_seed(SEED)
    tf.config.experimental.enable_op_determinism()
    batch = args.micro_batch * args.steps
    x_tr, y_tr, x_te, y_te = load_data(batch, args.all_samples)
    fit_batch = batch if args.run == "reference" else args.micro_batch
    total_updates = args.epochs * -(-len(x_tr) // batch)  # the reference's updates

    model = build_model()
    with np.load(args.out / "initial_weights.npz") as init:
        model.set_weights([init[f"w{i}"] for i in range(len(init.files))])
    opt = make_optimizer(args.run, total_updates, args.steps)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.run == "exact":
        from accum_optimizer import CountedLoss

        loss = CountedLoss(loss)  # each micro-step weighted by its sample count
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"], loss=loss)

    epoch_weights, epoch_lr = [], []  # live (non-EMA) weights, LR after every epoch

    def on_epoch_end(epoch, logs):
        epoch_weights.append(model.get_weights())
        epoch_lr.append(float(keras.ops.convert_to_numpy(opt.learning_rate)))

    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)]
    if args.run == "exact":
        from accum_optimizer import FlushPartialWindow

        callbacks.insert(0, FlushPartialWindow())  # before the weights are recorded
    gpu = bool(tf.config.list_physical_devices("GPU"))
    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
    rss_before = vm_rss_bytes()
    print(f"\n=== {args.run}: " + RUNS[args.run].format(
        batch=batch, micro=args.micro_batch, steps=args.steps), flush=True)
    t0 = time.perf_counter()
    history = model.fit(x_tr, y_tr, batch_size=fit_batch, epochs=args.epochs,
                        shuffle=False, callbacks=callbacks)  # ends with the EMA weights
    seconds = time.perf_counter() - t0
    if gpu:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    else:  # ru_maxrss is in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    _, test_acc = model.evaluate(x_te, y_te, batch_size=256, verbose=0)

    arrays = {f"final_{i}": w for i, w in enumerate(model.get_weights())}
    for e, ws in enumerate(epoch_weights):
        arrays.update({f"epoch{e}_{i}": w for i, w in enumerate(ws)})
    np.savez(args.out / f"weights_{args.run}.npz", **arrays)
    inner = getattr(opt, "inner_optimizer", opt)
    result = {
        "loss": [float(v) for v in history.history["loss"]],
        "learning_rate": epoch_lr,
        "test_accuracy": float(test_acc),
        "updates": int(opt.iterations.numpy()),  # what `optimizer.iterations` reports
        "batches": int(getattr(opt, "micro_steps", inner._iterations).numpy()),
        # The step the LR schedule sees (= EMA updates); Keras' built-in counts micro-steps.
        "schedule_step": int(inner._iterations.numpy()),
        "peak_memory_mib": max(peak, 0) / 2**20,
        "memory_kind": "peak GPU mem" if gpu else "peak RSS - RSS after build",
        "fit_seconds": seconds,
    }
    (args.out / f"run_{args.run}.json").write_text(json.dumps(result, indent=2))


def max_diff(a, b, prefix: str) -> float:
    keys = [k for k in a.files if k.startswith(prefix)]
    return max(float(abs(a[k].astype("float64") - b[k]).max()) for k in keys)


def plot(results: dict, epochs: int, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"reference": ("k", "-", "o"), "accum": ("tab:blue", "--", "x"),
             "keras": ("tab:red", ":", "s"), "exact": ("tab:green", "-.", "+")}
    xs = list(range(1, epochs + 1))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    for run, r in results.items():
        c, ls, m = style[run]
        kw = dict(color=c, ls=ls, marker=m, label=f"{run}: {r['label']}")
        ax1.plot(xs, r["loss"], **kw)
        ax2.plot(xs, r["learning_rate"], **kw)
        if run != "reference":  # floor at 1e-12 so exact zeros show on a log axis
            ax3.plot(xs, [max(d, 1e-12) for d in r["epoch_max_abs_diff"]], **kw)
    ax1.set(title="Training loss per epoch", xlabel="epoch",
            ylabel="sparse categorical cross-entropy (mean)")
    ax2.set(title="AdamW learning rate at the end of each epoch", xlabel="epoch",
            ylabel="learning rate (warmup + cosine schedule)")
    ax3.set(title="Max |weight difference| from the reference", xlabel="epoch",
            ylabel="max abs difference, live weights (log)", yscale="log")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.set_xticks(xs)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        return child(args)

    t_start = time.perf_counter()
    import numpy as np

    tf, keras = import_tf()

    batch = args.micro_batch * args.steps
    n_train = len(load_data(batch, args.all_samples)[0])
    print(f"TF {tf.__version__}, Keras {keras.__version__}; {n_train} training "
          f"samples, {-(-n_train // batch)} reference updates per epoch, {args.epochs} epochs.")
    keras.utils.set_random_seed(SEED)  # one initialisation shared by all runs
    np.savez(args.out / "initial_weights.npz",
             **{f"w{i}": w for i, w in enumerate(build_model().get_weights())})

    results = {}
    runs = list(DEFAULT_RUNS) + (["exact"] if args.all_samples else [])
    checked = "exact" if args.all_samples else "accum"
    for run in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--run", run,
               "--epochs", str(args.epochs), "--micro-batch", str(args.micro_batch),
               "--steps", str(args.steps), "--out", str(args.out)]
        if args.all_samples:
            cmd.append("--all-samples")
        sys.stdout.flush()
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"Run {run!r} failed (command: {' '.join(cmd)}).")
        results[run] = json.loads((args.out / f"run_{run}.json").read_text())
        results[run]["label"] = RUNS[run].format(batch=batch, micro=args.micro_batch,
                                                 steps=args.steps)

    with np.load(args.out / "weights_reference.npz") as ref:
        for run, r in results.items():
            with np.load(args.out / f"weights_{run}.npz") as w:
                r["max_abs_diff_final_ema"] = max_diff(w, ref, "final_")
                r["epoch_max_abs_diff"] = [max_diff(w, ref, f"epoch{e}_")
                                           for e in range(args.epochs)]
                r["max_abs_diff_live"] = r["epoch_max_abs_diff"][-1]

    mem_kind = results["reference"]["memory_kind"]
    header = (f"{'run':<10} {'batches':>7} {'updates':>7} {'LR step':>7} "
              f"{'max|dw| EMA':>11} {'max|dw| live':>12} {'test acc':>8} "
              f"{'mem MiB':>8} {'fit s':>6}")
    print(f"\nResults after {args.epochs} epochs. batches: fit steps; updates: "
          "optimizer.iterations; LR step: the step AdamW's LR schedule saw (= EMA "
          "updates);\nmax|dw|: max abs weight difference from the reference, of the final "
          "(EMA) weights and of the live weights before fit's EMA overwrite;\n"
          f"mem: {mem_kind}; fit s: wall time of model.fit.")
    print(header + "\n" + "-" * len(header))
    for run, r in results.items():
        print(f"{run:<10} {r['batches']:>7} {r['updates']:>7} {r['schedule_step']:>7} "
              f"{r['max_abs_diff_final_ema']:>11.2e} "
              f"{r['max_abs_diff_live']:>12.2e} {r['test_accuracy']:>8.4f} "
              f"{r['peak_memory_mib']:>8.1f} {r['fit_seconds']:>6.1f}")

    png = args.out / "loss_curves.png"
    plot(results, args.epochs, f"Digits CNN, AdamW + warmup/cosine LR + weight decay + EMA: "
         f"batch {batch} vs {args.steps} x {args.micro_batch} accumulated", png)
    drift = max(results[checked]["max_abs_diff_final_ema"], results[checked]["max_abs_diff_live"])
    summary = {
        "tensorflow": tf.__version__, "keras": keras.__version__,
        "epochs": args.epochs, "micro_batch": args.micro_batch, "steps": args.steps,
        "reference_batch": batch, "train_samples": n_train, "tolerance": args.tolerance,
        "all_samples": args.all_samples, "checked_run": checked,
        "accum_max_abs_diff": drift, "passed": drift <= args.tolerance,
        "total_seconds": time.perf_counter() - t_start, "runs": results,
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\nPlot: {png}\nResults: {args.out / 'results.json'}")
    print(f"Total time: {summary['total_seconds']:.1f} s")
    if drift > args.tolerance:
        raise SystemExit(
            f"FAIL: run {checked!r} drifted from the reference by {drift:.3e} "
            f"(max abs weight difference) > --tolerance {args.tolerance:g}.")
    extra = ""
    if args.all_samples:
        extra = (f"; without CountedLoss + FlushPartialWindow ('accum') it differs by "
                 f"{results['accum']['max_abs_diff_final_ema']:.2e}")
    print(f"OK: run {checked!r} matches the reference within {args.tolerance:g} "
          f"(max abs weight difference {drift:.2e}){extra}; Keras' built-in accumulation "
          f"differs by {results['keras']['max_abs_diff_final_ema']:.2e}.")


if __name__ == "__main__":
    main()
