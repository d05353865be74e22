"""Gradient all-reduces per window under ``keras.distribution.DataParallel`` (JAX), read from the optimized HLO, and timed.

    KERAS_BACKEND=jax python -m benchmarks.jax_reduction           # tables, docs/benchmarks/jax_reduction.{json,png,md}
    KERAS_BACKEND=jax python -m benchmarks.jax_reduction --quick   # fewer timing rounds

Four CPU devices (``--xla_force_host_platform_device_count=4``, set here before
JAX starts: run it as a fresh process), ``DataParallel`` over them, an MLP
64-1024-1024-8 and ``N`` micro-batches of ``B`` samples per window, trained
four ways: ``plain`` (``Adam``, no accumulation: one all-reduce per step),
``builtin`` (Keras' ``Adam(gradient_accumulation_steps=N)``), ``today``
(``AccumulatingOptimizer(Adam, N)`` with Keras' own train step) and ``new``
(the same optimizer in a model with
:class:`accum_optimizer.OneReductionPerWindow`).

The all-reduces of each compiled train step and the exactness of ``new``
against one device's large batch are read by ``tests/support/jax_reduction.py``
(what ``tests/backends/test_jax_reduction.py`` asserts, at a narrower width);
this adds the time per micro-step of ``new``, ``today``, ``builtin`` and
``plain`` in interleaved rounds (each round times 5 windows of each, in
turn), reported as the per-round ratios new/today, new/builtin and
today/builtin, median with a 95% percentile-bootstrap interval
(``benchmarks._stats``); written to ``<out>/jax_reduction.{json,png,md}``.
Needs Keras 3 on JAX (the k3-jax environment; matplotlib for the figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/jax_reduction.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks._env import static_env, tests_support  # noqa: E402
from benchmarks._output import Progress, fmt_ratio, format_table, pyplot, save_figure, write_outputs  # noqa: E402
from benchmarks._stats import summarize, summarize_with_ci  # noqa: E402

tests_support()
from support import jax_reduction as R  # noqa: E402  (the HLO reading and the exactness, shared with the test)
from support.jax_reduction import B, FEATURES, N, OUTPUTS  # noqa: E402

if __name__ == "__main__":
    R.simulated_devices()  # before JAX starts

WIDTH = 1024  # hidden width of the timed MLP
CONFIDENCE = 0.95


TIMED = ("new", "today", "builtin", "plain")
RATIOS = (("new", "today"), ("new", "builtin"), ("today", "builtin"))


def measure_time(width: int, rounds: int, windows: int) -> dict:
    """Seconds per micro-step of each kind of :data:`TIMED`, in interleaved
    rounds (each round times ``windows`` windows of each kind in turn); the
    per-round ratios of :data:`RATIOS`, median with a 95% percentile-bootstrap
    interval."""
    import jax

    x, y = R.data(N * B)
    batches = [R.distributed_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(N)]
    runs = {}
    for kind in TIMED:
        model = R.built(kind, width, x, y)
        step = R.train_step(model)
        state = R.state(model)
        for batch in batches:  # (compile, warm up)
            state = step(state, batch)[1]
        jax.block_until_ready(state)
        runs[kind] = [step, state]
    times = {k: [] for k in TIMED}
    for _ in range(rounds):
        for kind in TIMED:
            step, state = runs[kind]
            start = time.perf_counter()
            for _ in range(windows):
                for batch in batches:
                    state = step(state, batch)[1]
            jax.block_until_ready(state)
            times[kind].append((time.perf_counter() - start) / (windows * N))
            runs[kind][1] = state
    return {
        "rounds": rounds, "micro_steps_per_round": windows * N,
        "seconds_per_micro_step": {k: summarize(v) for k, v in times.items()},
        "ratios": {f"{a}/{b}": summarize_with_ci([p / q for p, q in zip(times[a], times[b])], CONFIDENCE)
                   for a, b in RATIOS},
    }


def per_kind(s: dict) -> dict:
    """All-reduces (count, elements) of an accumulate-only micro-step (the
    every-call ones) and of an update (every-call plus the branch's)."""
    return {"accumulate": (s["every_call_count"], s["every_call_elements"]),
            "update": (s["every_call_count"] + s["branch_count"], s["every_call_elements"] + s["branch_elements"])}


LABELS = {"plain": "plain Adam (no accumulation)", "builtin": "Keras' built-in (gradient_accumulation_steps)",
          "today": "AccumulatingOptimizer, Keras' train step", "new": "AccumulatingOptimizer + OneReductionPerWindow"}


def markdown(result: dict) -> str:
    params = result["hlo"]["new"]["parameters"]
    lines = [
        "# Gradient all-reduces per window: DataParallel on JAX",
        "",
        f"{result['devices']} simulated CPU devices (`--xla_force_host_platform_device_count=4`), "
        f"`DataParallel`, MLP {FEATURES}-{result['width']}-{result['width']}-{OUTPUTS} ({params} "
        f"parameters), Adam, N = {N} micro-batches of B = {B} ({B // result['devices']} per device), Keras "
        f"{result['env']['keras']}, JAX {result['env']['jax']}. Command: `{result['command']}`.",
        "",
        "All-reduces in the optimized HLO of the compiled train step (`jax.jit(model.train_step)`, as `fit` "
        "compiles it; `lower(...).compile().as_text()`): an accumulate-only micro-step runs those reachable "
        "without entering a `conditional`'s branch, an update also those inside the branch (the window's "
        "update). Elements: summed over the tensors of a tuple all-reduce.",
        "",
    ]
    rows = []
    for kind, s in result["hlo"].items():
        k = per_kind(s)
        rows.append([LABELS[kind], *k["accumulate"], f"{100 * s['every_call_fraction_of_parameters']:.3g}%",
                     *k["update"], ", ".join(s["other_collectives"]) or "none"])
    lines.append(format_table(["train step", "accumulate-only: all-reduces", "elements", "of parameters",
                                 "update: all-reduces", "elements", "other collectives"], rows, markdown=True))
    e = result["exactness"]
    lines += ["", f"Against one device's `fit(batch_size={N * B})` with plain Adam ({e['updates']} updates, "
              f"width {result['check_width']}): max |Δw| {e['fit_max_abs_diff']:.2e} (`fit` with the mixin), "
              f"{e['custom_loop_max_abs_diff']:.2e} (custom loop, `device_value_and_grad`), "
              f"{e['counted_loss_max_abs_diff']:.2e} (`CountedLoss`, sample weights), "
              f"{e['loss_scale_optimizer_max_abs_diff']:.2e} (a `LossScaleOptimizer` outside); accumulator of the first "
              f"kernel: shape {tuple(e['accumulator_shape_of_first_kernel'])}, sharding "
              f"{e['accumulator_spec_of_first_kernel']}."]
    t = result.get("time")
    if t:
        per = t["seconds_per_micro_step"]
        lines += ["", f"Time per micro-step, {t['rounds']} interleaved rounds of {t['micro_steps_per_round']} "
                  "micro-steps each (windows of N; median [IQR] ms): "
                  + ", ".join(f"{k} {1e3 * v['median']:.3f} [{1e3 * v['q1']:.3f}, {1e3 * v['q3']:.3f}]"
                              for k, v in per.items()),
                  "", format_table(["ratio of times per micro-step", "median [95% interval]"], [
                      [name, fmt_ratio(r["median"], r["ci_low"], r["ci_high"])] for name, r in t["ratios"].items()
                  ], markdown=True)]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    plt = pyplot()
    fig, (ax_h, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = list(result["hlo"])
    for offset, (which, color) in enumerate((("accumulate", "tab:blue"), ("update", "tab:orange"))):
        values = [max(per_kind(result["hlo"][k])[which][1], 1) for k in kinds]
        ax_h.bar([i + 0.4 * offset for i in range(len(kinds))], values, width=0.4, color=color,
                 label=f"{which}{'-only' if which == 'accumulate' else ''} micro-step")
    ax_h.axhline(result["hlo"]["new"]["parameters"], color="gray", linestyle="--", linewidth=1, label="parameters")
    ax_h.set_xticks([i + 0.2 for i in range(len(kinds))])
    ax_h.set_xticklabels(kinds)
    ax_h.set_yscale("log")
    ax_h.set_ylabel("elements all-reduced (HLO)")
    ax_h.set_title("all-reduce per micro-step kind")
    ax_h.legend(fontsize=8, loc="lower left")
    t = result.get("time")
    if t:
        names = list(t["ratios"])
        med = [t["ratios"][n]["median"] for n in names]
        err = [[m - t["ratios"][n]["ci_low"] for m, n in zip(med, names)],
               [t["ratios"][n]["ci_high"] - m for m, n in zip(med, names)]]
        ax_t.errorbar(range(len(names)), med, yerr=err, fmt="o", capsize=4)
        ax_t.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax_t.set_xticks(range(len(names)))
        ax_t.set_xticklabels(names)
        ax_t.set_ylabel("ratio of times per micro-step (median, 95% interval)")
        ax_t.set_title("step time")
    fig.suptitle(f"DataParallel over {result['devices']} simulated CPU devices, N = {N}, B = {B}")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default="docs/benchmarks", help="where the JSON, PNG and Markdown go")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import jax
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    result = {
        "benchmark": "jax_reduction",
        "command": " ".join(["KERAS_BACKEND=jax python -m benchmarks.jax_reduction",
                             *(argv if argv is not None else sys.argv[1:])]),
        "devices": len(jax.devices()),
        "width": WIDTH,
        "check_width": R.CHECK_WIDTH,
        "hlo": R.measure_hlo(WIDTH),
        "exactness": R.exactness(R.CHECK_WIDTH),
        "env": {**static_env(), "jax": jax.__version__},
    }
    prog = Progress("jax_reduction", 1)
    rounds = args.rounds or (10 if args.quick else 30)
    result["time"] = measure_time(WIDTH, rounds, windows=5)
    prog.step("timed", f"{rounds} rounds")
    text = markdown(result)
    print(text)
    write_outputs(Path(args.out), "jax_reduction", result, text, plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
