"""Whether the update micro-step overlaps the backward pass, as Keras'
built-in's does, without XLA.

``benchmarks.step_profile`` times each kind of micro-step; this script
times a variant beside them. Keras' built-in accumulation decides its
``cond`` from ``iterations`` alone and the ``cond`` has no control input
computed from the step's inputs, so once TensorFlow lowers it
(``Switch``/``Merge``, XLA off), each variable's ``(g + acc) / N`` starts as
soon as that variable's gradient exists, while the backward pass computes
the others'. ``AccumulatingOptimizer``'s window ``cond`` waits for one
gradient (the guard against a phantom micro-step) and each window gradient
for its own (``accum_optimizer.core.window``); before that change it waited
for every gradient. The variant ``built-in, waiting``: the same built-in
optimizer, its ``apply_gradients`` called under
``tf.control_dependencies(grads)``, so that its update waits for every
gradient: what the overlap is worth on this model (its ratio to the
built-in), and where the wrapper stands against both.

For ``transformer_wide`` (5.3M parameters, micro-batch 2, N = 4, Adam), a
custom loop's ``tf.function``, ``jit_compile`` off: ``--rounds`` interleaved
rounds of one window of each of the three (the order rotates by round), each
micro-step timed on its own (``.numpy()`` after each); per round the update
micro-step's ratios; median [95% CI: percentile bootstrap of the median,
10,000 resamples, seed 0].

    python -m benchmarks.update_overlap            # quick profile (about 2 minutes on 2 CPU cores)
    python -m benchmarks.update_overlap --tiny     # seconds: a smoke run

Writes ``<out>/update_overlap.json``, ``.md`` and ``.png``;
``docs/performance.md`` explains the table.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import step_profile  # noqa: E402
from benchmarks._devices import configure_gpu, on_device, select_backend  # noqa: E402
from benchmarks._env import static_env, tf_env  # noqa: E402
from benchmarks._models import build_model, make_batch, model_loss  # noqa: E402
from benchmarks._output import Progress, fmt_ratio, format_table, pyplot, save_figure, write_outputs  # noqa: E402
from benchmarks._profiles import MODEL_SIZES, benchmark_parser  # noqa: E402
from benchmarks._stats import summarize_with_ci  # noqa: E402
from benchmarks._training import make_optimizer  # noqa: E402

PROFILES = {
    "tiny": dict(model="transformer_wide", sizes="tiny", batch=1, n=2, rounds=3),
    "quick": dict(model="transformer_wide", sizes="quick", batch=2, n=4, rounds=60),
    "full": dict(model="transformer_wide", sizes="quick", batch=2, n=4, rounds=120),
}
VARIANTS = {"accum": "AccumulatingOptimizer", "builtin": "built-in", "waiting": "built-in, waiting for every gradient"}
RATIOS = (("accum", "builtin"), ("waiting", "builtin"), ("accum", "waiting"))
KINDS = ("accumulate", "update")
CONFIDENCE = 0.95


class Variant:
    """One variant's model, batch and traced custom-loop step, at a window's start."""

    def __init__(self, variant: str, p: dict) -> None:
        import keras
        import tensorflow as tf

        keras.backend.clear_session()
        gc.collect()
        kind, size = p["model"], MODEL_SIZES[p["sizes"]][p["model"]]
        model = build_model(kind, size, seed=0)
        self.x, self.y = on_device(*make_batch(kind, size, p["batch"], seed=1))
        opt = make_optimizer("accum" if variant == "accum" else "builtin", p["n"])
        loss_fn = model_loss(kind)
        wait = variant == "waiting"

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            with tf.control_dependencies(grads if wait else []):
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        self.step, self.n = step, p["n"]
        for _ in range(2 * self.n):  # traced, warm, and back to a window's first micro-step
            self.run()

    run = step_profile.Step.run  # one micro-step, timed on its own
    window = step_profile.Step.window  # one window, each micro-step timed


def measure(p: dict, prog) -> dict:
    variants = {}
    for v in VARIANTS:
        variants[v] = Variant(v, p)
        prog.step(f"{v}: built and traced")
    names = list(VARIANTS)
    for v in names:  # a window each, untimed: the next variant's `clear_session` makes the earlier ones retrace
        variants[v].window()
    times = {v: {k: [] for k in KINDS} for v in names}
    for r in range(p["rounds"]):
        for v in names[r % 3:] + names[: r % 3]:
            window = variants[v].window()
            times[v]["accumulate"].append(sum(window[:-1]) / (len(window) - 1))
            times[v]["update"].append(window[-1])
    prog.step(f"timed {p['rounds']} interleaved windows of each")
    ratios = {f"{a}/{b}": {k: summarize_with_ci([x / y for x, y in zip(times[a][k], times[b][k])], CONFIDENCE)
                           for k in KINDS} for a, b in RATIOS}
    return {"times_s": times, "ratios": ratios}


def _ms(values: list) -> str:
    return f"{1e3 * sorted(values)[len(values) // 2]:.2f}"


def table(data: dict) -> str:
    s = data["settings"]
    lines = [f"{s['model']}, micro-batch {s['batch']}, N = {s['n']}, Adam, custom loop (`tf.function`), "
             f"jit_compile off; {s['rounds']} interleaved rounds of one window of each variant. "
             "Waiting: Keras' built-in with its `apply_gradients` under `tf.control_dependencies(grads)`.", ""]
    rows = [[VARIANTS[v], _ms(data["times_s"][v]["accumulate"]), _ms(data["times_s"][v]["update"])] for v in VARIANTS]
    lines += ["**Time per micro-step** (median over rounds)", "",
              format_table(["variant", "accumulate ms (each of N-1)", "update ms"], rows, True), ""]
    rows = []
    for a, b in RATIOS:
        r = data["ratios"][f"{a}/{b}"]
        rows.append([f"{VARIANTS[a]} / {VARIANTS[b]}"] + [
            fmt_ratio(r[k]["median"], r[k]["ci_low"], r[k]["ci_high"]) for k in KINDS])
    lines += ["**Ratios** (within each round; median [95% CI])", "",
              format_table(["ratio", "accumulate", "update"], rows, True), ""]
    lines.append(f"Produced by `.venv/bin/python -m benchmarks.update_overlap"
                 f"{'' if data['profile'] == 'quick' else ' --' + data['profile']}`; explained in docs/performance.md.")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(VARIANTS)
    ax.boxplot([[1e3 * t for t in data["times_s"][v]["update"]] for v in names], showfliers=False)
    ax.set_xticks(range(1, len(names) + 1))
    ax.set_xticklabels([VARIANTS[v] for v in names], fontsize=8)
    ax.set_ylabel("update micro-step, ms")
    ax.set_title(f"{data['settings']['model']}: the update micro-step, jit off", fontsize=10)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (windows of each variant)")
    args = parser.parse_args(argv)
    select_backend(parser, "tensorflow")
    p = dict(PROFILES[args.profile])
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds={args.rounds}: expected an int >= 1")
        p["rounds"] = args.rounds
    t_start = time.perf_counter()
    env = static_env()
    configure_gpu()
    env.update(tf_env())
    prog = Progress("update_overlap", len(VARIANTS) + 1)
    data = {"benchmark": "update_overlap", "profile": args.profile, "env": env, "settings": p,
            **measure(p, prog), "wall_seconds": time.perf_counter() - t_start}
    md = table(data)
    print()
    print(md)
    write_outputs(args.out, "update_overlap", data, md, plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
