"""Where "exactly like the large batch" needs a qualification: five cases,
each measured on a small model, next to the way to be exact.

Every case trains a small model (an MLP, or a two-MLP GAN, on fixed random
data; seeded; nothing downloaded) twice or more from the same initial weights
and sample order, and prints the max absolute weight difference from its
reference:

1. ``apply_gradients`` called twice per batch on one wrapper (encoder and head
   of one model, one shared optimizer, a custom ``train_step``). Reference:
   plain Adam at batch N*B, one update of all variables per batch.
2. Alternating updates in one ``train_step`` (a GAN in the Keras guide's
   order: D is updated, then G's gradient goes through the new D). Reference:
   the same GAN code with plain Adam at batch N*B. Exact: both gradients
   first, then both updates (against the large batch trained that way), or
   the guide's order in two passes over each window (a custom loop).
3. ``BackupAndRestore(save_freq=<int>)``: training is interrupted mid-epoch
   (a callback raises, as Keras' own tests do) and resumed in a new model and
   optimizer. Reference: the same configuration trained without interruption;
   plain Keras and the wrapper are each compared with themselves.
4. numpy ``fit(x, y, batch_size=B)`` where B (and N*B) does not divide
   ``len(x)``. Reference: ``fit(x, y, batch_size=N*B)`` on the same samples.
5. TensorBoard's ``epoch_steps_per_second``: what it counts, read back from
   the event files and set against micro-steps and updates per second by the
   wall clock. Needs the ``tensorboard`` package (TensorFlow 2.21 no longer
   installs it; the ``[test]`` and ``[bench]`` extras do); without it the
   case is reported as skipped.

For each, row (a) is the case as users naturally write it and (b) the exact
recipe; (b) should be at float32 rounding (~1e-7). Run::

    .venv/bin/python -m experiments.caveats [--out bench_output] [--cases 1,2,3,4,5]

Writes ``<out>/caveats.json`` (all figures), ``<out>/caveats.md`` (the table)
and ``<out>/caveats.png`` (the deviations on a log scale). The training code
of each case is ``tests/support/caveats.py``, shared with
``tests/keras3/test_caveats.py``, which asserts what this measures.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/caveats.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "experiments"

from benchmarks._env import static_env, tests_support, tf_env  # noqa: E402
from benchmarks._output import Progress, format_table, print_and_write, pyplot, save_figure  # noqa: E402
from benchmarks._profiles import benchmark_parser, parse_int_list  # noqa: E402

N, B = 4, 8          # accumulation steps, micro-batch size: the reference batch is N*B = 32
IN, HIDDEN, OUT = 6, 8, 3
LR = 1e-2
CASE_TITLES = {
    1: "two apply_gradients calls per batch on one wrapper",
    2: "alternating updates in one train_step (GAN, Keras guide order)",
    3: "BackupAndRestore(save_freq=<int>), interrupted mid-epoch and resumed",
    4: "numpy fit(x, y, batch_size=B), B and N*B not dividing len(x)",
    5: "TensorBoard epoch_steps_per_second",
}

# TensorFlow, Keras and the cases (tests/support/caveats.py) are imported by
# _import_tf(), after the arguments are parsed (so that --help is instant).
keras = AccumulatingOptimizer = cases = make_data = max_abs_diff = None
study = None  # the cases at this study's sizes: support.caveats.Caveats


def _import_tf() -> None:
    global keras, AccumulatingOptimizer, cases, make_data, max_abs_diff, study
    tests_support()
    import keras as _keras

    from accum_optimizer import AccumulatingOptimizer as _Acc
    from support import caveats as _cases
    from support.reference import make_data as _make_data, max_abs_diff as _max_abs_diff

    keras, AccumulatingOptimizer, cases = _keras, _Acc, _cases
    make_data, max_abs_diff = _make_data, _max_abs_diff
    study = _cases.Caveats(n=N, lr=LR, hidden=HIDDEN)


# ------------------------------------------------------------------- helpers
def _adam():
    return study.adam()


def _acc(n: int = N):
    return study.acc(n)


def _row(case: int, variant: str, label: str, value: float, note: str = "", kind: str = "max_abs_dw") -> dict:
    return {"case": case, "variant": variant, "label": label, "value": value, "kind": kind, "note": note}


# ------------------------------------------------ 1. two calls, one wrapper
def case_two_calls() -> list[dict]:
    windows, epochs = 6, 2
    x, y = make_data(N * B * windows)
    ref, ref_up = study.two_part("one_call", _adam, N * B, x, y, epochs)
    runs = {
        "naive": study.two_part("two_calls", _acc, B, x, y, epochs),
        "one_call": study.two_part("one_call", _acc, B, x, y, epochs),
        "two_optimizers": study.two_part("two_optimizers", _acc, B, x, y, epochs),
        "plain_two_calls": study.two_part("two_calls", _adam, N * B, x, y, epochs),
        "double_n": study.two_part("two_calls", lambda: _acc(2 * N), B, x, y, epochs),
    }
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    sgd_ref, _ = study.two_part("one_call", sgd, N * B, x, y, epochs)
    sgd_double_n, _ = study.two_part("two_calls", lambda: AccumulatingOptimizer(sgd(), 2 * N), B, x, y, epochs)
    up = f"{ref_up[0]} updates in the reference"
    return [
        _row(1, "a", "one wrapper, encoder and head applied in two calls", max_abs_diff(runs["naive"][0], ref),
             f"a window closes after {N} calls = {N // 2} batches: {runs['naive'][1][0]} updates, {up}"),
        _row(1, "b", "one wrapper, one call with all gradients", max_abs_diff(runs["one_call"][0], ref),
             f"{runs['one_call'][1][0]} updates"),
        _row(1, "b", f"one wrapper per part, each with N={N}", max_abs_diff(runs["two_optimizers"][0], ref),
             f"{runs['two_optimizers'][1]} updates"),
        _row(1, "info", "plain Adam at batch N*B, two calls (no accumulation)", max_abs_diff(runs["plain_two_calls"][0], ref),
             f"plain Keras too: iterations advances twice per batch ({runs['plain_two_calls'][1][0]}), "
             "Adam's bias correction sees it"),
        _row(1, "info", f"one wrapper with N={2 * N} (2N), two calls", max_abs_diff(runs["double_n"][0], ref),
             f"not a fix: the windows are right ({runs['double_n'][1][0]} updates) but each gradient is divided "
             f"by 2N; Adam is nearly scale-invariant (only epsilon sees it)"),
        _row(1, "info", f"same with SGD(0.1): one wrapper with N={2 * N}, two calls (vs SGD at batch N*B)",
             max_abs_diff(sgd_double_n, sgd_ref), "SGD takes half steps"),
    ]


# --------------------------------------------------- 2. alternating updates
def case_gan() -> list[dict]:
    windows, epochs = 6, 2
    data = cases.gan_data(N * B * windows)
    ref_alt, _ = study.gan("alternating", _adam, N * B, data, epochs)
    ref_sim, _ = study.gan("simultaneous", _adam, N * B, data, epochs)
    naive, _ = study.gan("alternating", _acc, B, data, epochs)
    exact, _ = study.gan("simultaneous", _acc, B, data, epochs)
    two_passes = study.gan_two_passes(B, data, epochs)
    return [
        _row(2, "a", "guide order, wrappers on D and G (vs the large batch in guide order)", max_abs_diff(naive, ref_alt),
             f"G's gradient goes through the new D on 1 micro-batch of {N}, on all of them in the large batch"),
        _row(2, "b", "both gradients first, then both updates (vs the large batch, same order)", max_abs_diff(exact, ref_sim),
             "D and G gradients at the same weights in every micro-batch"),
        _row(2, "b", "guide order in two passes per window: D's N micro-steps, then G's N (vs guide order)",
             max_abs_diff(two_passes, ref_alt), "custom loop; G's gradients all go through the updated D"),
        _row(2, "info", "large batch: guide order vs both gradients first (no accumulation)", max_abs_diff(ref_sim, ref_alt),
             "the recipe is a different GAN update; this is how far apart the two large-batch GANs are"),
    ]


# ---------------------------------------------------- 3. BackupAndRestore
def case_backup() -> list[dict]:
    # 160 samples: 5 batches of N*B for plain Keras, 20 micro-batches of B
    # (5 windows) for the wrapper. Both are interrupted after the same
    # samples (epoch 1, 128 samples in) with backups every 64 samples.
    epochs, windows = 3, 5
    x, y = make_data(N * B * windows)
    configs = {
        "plain": dict(make_opt=_adam, batch=N * B, save_freq=2, interrupt=(1, 4)),
        "accum": dict(make_opt=_acc, batch=B, save_freq=2 * N, interrupt=(1, 4 * N)),
    }
    rows = []
    for name, cfg in configs.items():
        label = "plain Adam at batch N*B" if name == "plain" else f"AccumulatingOptimizer(Adam, {N}) at batch B"
        ref, ref_up = study.uninterrupted(cfg["make_opt"], cfg["batch"], x, y, epochs)
        r = study.resumed(cfg["make_opt"], cfg["batch"], x, y, epochs, "backup", cfg["interrupt"], cfg["save_freq"])
        meta = r["backup_metadata"]
        rows.append(_row(3, "a", f"{label}: BackupAndRestore(save_freq={cfg['save_freq']})",
                         max_abs_diff(r["weights"], ref),
                         f"backup after {meta['batch'] + 1} batches of epoch {meta['epoch']}; the resumed fit "
                         f"restores it, then starts epoch {meta['epoch']} from its first batch: those batches "
                         f"train twice ({r['updates']} updates, {ref_up} uninterrupted)"))
        r = study.resumed(cfg["make_opt"], cfg["batch"], x, y, epochs, "backup", cfg["interrupt"], "epoch")
        rows.append(_row(3, "b", f"{label}: BackupAndRestore(save_freq=\"epoch\")", max_abs_diff(r["weights"], ref),
                         f"resumed from the end of epoch {r['backup_metadata']['epoch'] - 1}: {r['updates']} updates"))
        r = study.resumed(cfg["make_opt"], cfg["batch"], x, y, epochs, "checkpoint", cfg["interrupt"])
        rows.append(_row(3, "b", f"{label}: ModelCheckpoint + load_model + fit(initial_epoch)",
                         max_abs_diff(r["weights"], ref),
                         f"initial_epoch={r['checkpoint_epochs_done']}: {r['updates']} updates"))
    return rows


# ------------------------------------------------ 4. numpy fit, ragged end
def case_ragged() -> list[dict]:
    epochs = 3
    rows = []
    for variant, length, dataset, label in (
        ("a", 100, False, "len(x)=100: last micro-batch 4 samples (N*B=32: last batch 4)"),
        ("a", 104, False, "len(x)=104: B divides it, N*B does not (13 micro-batches per epoch)"),
        ("b", 96, False, "len(x)=96, a multiple of N*B"),
        ("b", 100, True, "len(x)=100 as tf.data .batch(B, drop_remainder=True): 12 micro-batches per epoch"),
    ):
        x, y = make_data(length, seed=3)
        ref, ref_up, _ = study.fit_numpy(_adam, N * B, x, y, epochs, dataset)
        w, up, micro = study.fit_numpy(_acc, B, x, y, epochs, dataset)
        rows.append(_row(4, variant, label, max_abs_diff(w, ref),
                         f"{micro} micro-steps, {up} updates ({micro - up * N} left in the accumulators); "
                         f"reference {ref_up} updates"
                         + (" (reference: .batch(N*B, drop_remainder=True))" if dataset else "")))
    return rows


# ------------------------------------------------------------- 5. TensorBoard
def _clock_class():
    class EpochClock(keras.callbacks.Callback):
        """Wall clock of each epoch, micro-steps and updates in it (placed
        just before TensorBoard, so both time nearly the same interval)."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def _counts(self):
            opt = self.model.optimizer
            micro = opt.micro_steps if hasattr(opt, "micro_steps") else opt.iterations
            return int(micro.numpy()), int(opt.iterations.numpy())

        def on_epoch_begin(self, epoch, logs=None):
            self._t0, self._c0 = time.time(), self._counts()

        def on_epoch_end(self, epoch, logs=None):
            t, c = time.time() - self._t0, self._counts()
            self.epochs.append({"seconds": t, "micro_steps": c[0] - self._c0[0], "updates": c[1] - self._c0[1]})

    return EpochClock


def _tensorboard_run(make_opt, batch: int, x, y, epochs: int) -> dict:
    clock = _clock_class()()
    with tempfile.TemporaryDirectory() as tmp:
        _, scalars = study.tensorboard_fit(make_opt, batch, x, y, epochs, tmp, callbacks=[clock])
    logged = dict(scalars["epoch_steps_per_second"])
    batch_rate = scalars["batch_steps_per_second"]
    epochs_out = []
    for e, ep in enumerate(clock.epochs):
        epochs_out.append({**ep, "logged_epoch_steps_per_second": logged[e],
                           "micro_steps_per_second": ep["micro_steps"] / ep["seconds"],
                           "updates_per_second": ep["updates"] / ep["seconds"]})
    return {"epochs": epochs_out, "batch_steps_per_second": [v for _, v in batch_rate],
            "batch_summary_steps": [s for s, _ in batch_rate], "tags": sorted(scalars)}


def case_tensorboard() -> tuple[list[dict], dict]:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:  # TF 2.21 no longer depends on it
        return [_row(5, "a", "skipped: the tensorboard package is not installed (pip install tensorboard)",
                     None, kind="skipped")], None
    epochs, micro_per_epoch = 4, 64
    x, y = make_data(micro_per_epoch * B)
    runs = {"accum": _tensorboard_run(_acc, B, x, y, epochs), "plain": _tensorboard_run(_adam, B, x, y, epochs)}
    # The first epoch includes tracing: medians over the others.
    steady = {k: r["epochs"][1:] for k, r in runs.items()}

    def med(name, key):
        return statistics.median(ep[key] for ep in steady[name])

    def ratio(name, num, den, factor=1.0):
        return statistics.median(factor * ep[num] / ep[den] for ep in steady[name])

    acc = runs["accum"]
    per_epoch = steady["accum"][0]
    rows = [
        _row(5, "a", "wrapper: logged epoch_steps_per_second / micro-steps per s (wall clock)",
             ratio("accum", "logged_epoch_steps_per_second", "micro_steps_per_second"),
             f"= 1/N: it counts updates ({per_epoch['updates']} of {per_epoch['micro_steps']} micro-steps per "
             f"epoch); logged {med('accum', 'logged_epoch_steps_per_second'):.0f}/s, "
             f"micro-steps {med('accum', 'micro_steps_per_second'):.0f}/s, "
             f"updates {med('accum', 'updates_per_second'):.0f}/s", kind="ratio"),
        _row(5, "b", "wrapper: N x logged epoch_steps_per_second / micro-steps per s",
             ratio("accum", "logged_epoch_steps_per_second", "micro_steps_per_second", N),
             "read it as updates/s; logged / updates per s (wall clock) = "
             f"{ratio('accum', 'logged_epoch_steps_per_second', 'updates_per_second'):.3f}", kind="ratio"),
        _row(5, "info", "plain Adam at batch B: logged epoch_steps_per_second / batches per s",
             ratio("plain", "logged_epoch_steps_per_second", "micro_steps_per_second"),
             "without accumulation updates = batches", kind="ratio"),
        _row(5, "info", "wrapper: batch-level summaries (update_freq=\"batch\") / micro-steps",
             len(acc["batch_summary_steps"]) / sum(ep["micro_steps"] for ep in acc["epochs"]),
             f"one per micro-step, at steps 1..{acc['batch_summary_steps'][-1]}; batch_steps_per_second = "
             f"1 / (on_train_batch_begin to _end), per micro-step: median "
             f"{statistics.median(acc['batch_steps_per_second'][micro_per_epoch:]):.0f}/s (excludes the time "
             "between batches)", kind="ratio"),
    ]
    detail = {k: {kk: vv for kk, vv in r.items() if kk != "batch_steps_per_second"} for k, r in runs.items()}
    for k, r in runs.items():
        detail[k]["batch_steps_per_second_median_after_epoch_0"] = statistics.median(
            r["batch_steps_per_second"][micro_per_epoch:])
    return rows, detail


# ------------------------------------------------------------------- output
def _fmt(row: dict) -> str:
    if row["value"] is None:
        return "n/a"
    if row["kind"] == "ratio":
        return f"{row['value']:.3f}"
    return f"{row['value']:.2e}"


def table(data: dict, markdown: bool = False) -> str:
    bar = "\\|" if markdown else "|"  # a bare | would split a Markdown cell
    headers = ["case", "row", "what is run", f"max{bar}w - w_ref{bar} or ratio", "what happened"]
    rows = [[str(r["case"]), r["variant"], r["label"], _fmt(r), r["note"]] for r in data["rows"]]
    s = data["settings"]
    legend = (f"N={s['N']}, B={s['B']} (reference batch {s['N'] * s['B']}), Adam({s['lr']}), float32; "
              "(a) as naturally written, (b) the exact recipe, (info) context. Cases 1-4: max absolute weight "
              "difference from the reference; case 5: the ratio named in the row.")
    out = format_table(headers, rows, markdown) + "\n\n" + legend
    if markdown:
        env = data["env"]
        command = " ".join([".venv/bin/python -m experiments.caveats", *env.get("argv", [])])
        out = (f"Produced by `{command}` in {data['wall_seconds']:.0f} s on {env['date_utc']}: TensorFlow "
               f"{env['tensorflow']}, Keras {env['keras']}, {env.get('device', 'CPU')}, {env['cpus_usable']} CPUs, "
               f"load average at start {', '.join(f'{x:.1f}' for x in env['load_average_at_start'] or [])}."
               "\n\n" + out)
    return out


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    rows = [r for r in data["rows"] if r["kind"] == "max_abs_dw"]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    colors = {"a": "tab:red", "b": "tab:green", "info": "tab:gray"}
    labels = [f"{r['case']}{r['variant']}: {r['label'] if len(r['label']) <= 75 else r['label'][:74] + '…'}"
              for r in rows]
    floor = 1e-10  # where a difference of exactly 0 is drawn
    values = [max(r["value"], floor) for r in rows]
    ax.barh(range(len(rows)), values, color=[colors[r["variant"]] for r in rows])
    for i, (r, v) in enumerate(zip(rows, values)):
        ax.text(v * 1.3, i, "0" if r["value"] == 0 else f"{r['value']:.1e}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1e-6, color="k", ls=":", lw=1)
    ax.set_xlim(floor / 2, 1.0)
    ax.set_xlabel(f"max |w - w_ref| (log scale; 0 drawn at {floor:.0e}; dotted line: 1e-6)")
    ax.set_title(f"Caveats of exactness: naive (red), exact recipe (green), context (gray); N={N}, B={B}, Adam")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return save_figure(fig, path)


CASES = {1: case_two_calls, 2: case_gan, 3: case_backup, 4: case_ragged, 5: case_tensorboard}


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, profiles=False)
    parser.add_argument("--out", default="bench_output", help="output folder (default: bench_output)")
    parser.add_argument("--cases", type=parse_int_list, default=list(CASES),
                        help="comma list of cases to run (default: 1,2,3,4,5)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    env = static_env()
    t_start = time.perf_counter()
    _import_tf()
    env.update(tf_env())
    # Expected along the way: fit on a tf.data.Dataset ignores `shuffle`.
    warnings.filterwarnings("ignore", message=".*shuffle.*")
    prog = Progress("caveats", len(args.cases))
    data = {"benchmark": "caveats", "env": env,
            "settings": {"N": N, "B": B, "lr": LR, "optimizer": "Adam", "dtype": "float32",
                         "model": f"MLP {IN}-{HIDDEN}-{OUT} (tanh); GAN: G {cases.LATENT}-{HIDDEN}-2, D 2-{HIDDEN}-1"},
            "rows": [], "cases": {}}
    for case in args.cases:
        t = time.perf_counter()
        out = CASES[case]()
        rows, detail = out if isinstance(out, tuple) else (out, None)
        data["rows"] += rows
        data["cases"][str(case)] = {"title": CASE_TITLES[case], "rows": rows, **({"detail": detail} if detail else {})}
        prog.step(f"{case}. {CASE_TITLES[case]}", "; ".join(f"{r['variant']} {_fmt(r)}" for r in rows),
                  time.perf_counter() - t)
    data["wall_seconds"] = time.perf_counter() - t_start
    return print_and_write(args.out, "caveats", data, table(data), table(data, markdown=True), plot, prog)


if __name__ == "__main__":
    sys.exit(main())
