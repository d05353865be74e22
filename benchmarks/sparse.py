"""Sparse gradients: micro-step cost and peak memory against embedding table size.

Model: ``Embedding(V, 64)`` -> mean over the ids -> ``Dense(1)``, MSE loss;
each micro-batch looks up ``batch x ids_per_example`` ids (256 in the quick
profile), drawn uniformly from the V rows (fixed seeds, a new draw every
micro-step). The embedding gradient is a ``tf.IndexedSlices``. For each V
(10^4, 10^5, 10^6) and N=8, one fresh subprocess runs, side by side:

  * plain: the inner optimizer, every micro-step is an update;
  * accum: ``AccumulatingOptimizer(inner, N)``, which scatter-adds the ids'
    rows into its accumulator, marks them in its row tracker and updates once
    per window with the sparse window (SGD: ``tf.IndexedSlices`` over the
    touched rows; other inner optimizers: the dense window gradient), then
    zeroes the touched rows only;
  * accum_dense: the same with the sparse window switched off (every window
    dense: the whole accumulator handed over and zeroed), the update step the
    library had before the row trackers, kept for the side-by-side;
  * builtin: Keras' ``inner(gradient_accumulation_steps=N)``, which densifies
    the gradient every micro-step.

The inner optimizer is SGD by default: its own update of an IndexedSlices
gradient is a scatter (Keras 3's Adam densifies the gradient itself; try
``--inner adam``).

Memory: each method in turn runs one window plus one accumulate-only
micro-step from a reset of the allocator statistics; its peak tensor memory
and what is still allocated at the end are read relative to that point
(``get_memory_info`` of GPU:0, or of CPU:0 with TensorFlow's BFC CPU
allocator). Time: then, after one untimed round, ``windows - 1`` interleaved
rounds, each running one
window of N micro-steps of every method, each micro-step timed on its own
(synchronised). It reports the median time of the accumulate-only
micro-steps (N-1 of every N), of the update steps, and the mean time per
micro-step over a window (what a micro-step costs on average; median over
the windows). The cost of an accumulate-only
micro-step should follow the ids, not V.

    python -m benchmarks.sparse            # quick profile (default)
    python -m benchmarks.sparse --full     # more steps, larger V
    python -m benchmarks.sparse --tiny     # seconds; what the smoke test runs

Writes ``<out>/sparse.json`` and ``<out>/sparse.png`` (time against V).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/sparse.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _training  # noqa: E402
from benchmarks._devices import configure_gpu, on_device  # noqa: E402
from benchmarks._env import static_env, tf_env  # noqa: E402
from benchmarks._memory import PeakMemory  # noqa: E402
from benchmarks._models import build_model, make_batch, model_loss  # noqa: E402
from benchmarks._output import MIB, Progress, fmt_mib, format_table, print_and_write, pyplot, save_figure  # noqa: E402
from benchmarks._profiles import benchmark_parser, parse_int_list  # noqa: E402
from benchmarks._stats import summarize  # noqa: E402
from benchmarks._training import accumulator_bytes, make_train_step, param_bytes, warm_up_runtime  # noqa: E402
from benchmarks._workers import emit_result, run_workers  # noqa: E402

PROFILES = {
    "tiny": dict(vocab=(1_000, 10_000), dim=64, batch=8, ids_per_example=4, n=8, windows=2, jobs=2,
                 timeout=300),
    "quick": dict(vocab=(10_000, 100_000, 1_000_000), dim=64, batch=32, ids_per_example=8, n=8,
                  windows=8, jobs=1, timeout=600),
    "full": dict(vocab=(10_000, 100_000, 1_000_000, 4_000_000), dim=64, batch=32, ids_per_example=8,
                 n=8, windows=20, jobs=1, timeout=1800),
}
METHOD_ORDER = ("plain", "accum", "accum_dense", "builtin")
LABELS = {"plain": "plain", "accum": "accum", "accum_dense": "accum, dense window", "builtin": "built-in"}


def make_optimizer(method: str, n: int, inner: str, lr: float):
    """:func:`benchmarks._training.make_optimizer`, plus ``accum_dense``: the
    AccumulatingOptimizer with its sparse window switched off (every window
    dense, as before the row trackers), for the side-by-side."""
    if method != "accum_dense":
        return _training.make_optimizer(method, n, inner, lr=lr)
    opt = _training.make_optimizer("accum", n, inner, lr=lr)
    object.__setattr__(opt, "_sparse_windows", False)
    return opt


def worker(cfg: dict) -> dict:
    """All methods for one V, in this (fresh) process.

    Phase 1, one method at a time: build its optimizer and step function, run
    one window plus one accumulate-only micro-step, and read the allocator's
    peak and what is still allocated, relative to just before (so each
    method's figures are its own, whatever the other methods hold). Phase 2:
    ``windows - 1`` rounds; in each, every method runs one window of N
    micro-steps, each timed on its own (interleaved, the order rotating).
    """
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    gpu = configure_gpu()
    out = {"env": tf_env(), "methods": {}}
    size = dict(vocab=cfg["vocab"], dim=cfg["dim"], ids_per_example=cfg["ids_per_example"])
    n, rounds = cfg["n"], max(cfg["windows"] - 1, 1)
    warm_up_runtime("embedding", size)
    # Distinct micro-batches (a new draw of ids every micro-step), reused cyclically.
    batches = [on_device(*make_batch("embedding", size, cfg["batch"], seed=1 + i)) for i in range(2 * n + 1)]
    runs = {}
    for method in cfg["methods"]:
        model = build_model("embedding", size, seed=0)
        r = {"table_bytes": param_bytes([model.get_layer("table").embeddings]),
             "param_bytes": param_bytes(model.trainable_variables)}
        gc.collect()
        mem = PeakMemory(gpu)
        mem.start()
        try:
            opt = make_optimizer(method, n, cfg["inner"], lr=1e-2)
            step = make_train_step(model, opt, model_loss("embedding"))
            for i in range(n + 1):  # a window (trace, first update), then one accumulate-only step
                step(*batches[i % len(batches)]).numpy()
        except Exception as e:  # Keras' built-in may fail in some setups: report, go on
            out["methods"][method] = {**r, "status": "error", "reason": f"{type(e).__name__}: {e}"[:300]}
            continue
        gc.collect()
        r.update(mem.stop())
        r["optimizer_state_bytes"] = param_bytes(opt.variables)
        r["accumulator_bytes"] = accumulator_bytes(opt)
        trackers = list(getattr(opt, "touched_rows", None) or [])
        r["row_tracker_bytes"] = param_bytes(trackers)
        r["table_tracker_bytes"] = param_bytes([t for t in trackers if tuple(t.shape) == (cfg["vocab"],)])
        runs[method] = {"model": model, "opt": opt, "step": step, "taken": n + 1, "times": []}
        out["methods"][method] = r
    order = list(runs)
    # Round -1 is an untimed warm-up: a function's first call after other
    # functions were traced is slow once.
    for rnd in range(-1, rounds):
        k = rnd % len(order)
        for method in order[k:] + order[:k]:
            run = runs[method]
            for _ in range(n):
                x, y = batches[run["taken"] % len(batches)]
                t0 = time.perf_counter()
                run["step"](x, y).numpy()
                if rnd >= 0:
                    run["times"].append((run["taken"] + 1, time.perf_counter() - t0))
                run["taken"] += 1
    for method, run in runs.items():
        r = out["methods"][method]
        timed = run["times"]
        # Micro-step i (1-based) is an update when i % n == 0; plain updates every step.
        if method == "plain":
            accumulate, update = [], [t for _, t in timed]
        else:
            accumulate = [t for i, t in timed if i % n]
            update = [t for i, t in timed if i % n == 0]
        r["times_s"] = [t for _, t in timed]
        r["accumulate_step_s"] = summarize(accumulate) if accumulate else None
        r["update_step_s"] = summarize(update) if update else None
        # Per window of N consecutive micro-steps (one update each), the mean
        # time per micro-step; the median over windows is robust to a rare
        # one-off stall (allocator growth, a re-optimised function).
        window_means = [statistics.fmean(t for _, t in timed[w:w + n]) for w in range(0, len(timed), n)]
        r["window_mean_step_s"] = summarize(window_means)
        r["mean_step_s"] = r["window_mean_step_s"]["median"]
        r["mean_step_s_all"] = statistics.fmean(t for _, t in timed)
        r["micro_steps_taken"] = run["taken"]
        r["status"] = "ok"
    return out


def _ms(s) -> str:
    if s is None:
        return "-"
    if isinstance(s, dict):
        s = s["median"]
    return f"{1e3 * s:.2f}"


def _mem(r, which: str, key: str = "delta") -> str:
    if not r or r.get("status") != "ok":
        return (r or {}).get("status", "n/a")
    fig = r["rss"] if which == "rss" else r.get("tf_allocator")
    return "n/a" if not fig else fmt_mib(fig[key], 0)


def table(data: dict, markdown: bool = False) -> str:
    p = data["settings"]
    rows, mem_rows = [], []
    for v in p["vocab"]:
        r = {m: data["results"].get(f"{m}/{v}") for m in METHOD_ORDER}
        ok = {m: x for m, x in r.items() if x and x.get("status") == "ok"}
        cells = [f"{v:,}", f"{v * p['dim'] * 4 / MIB:.0f}"]
        cells.append(_ms(ok["plain"]["update_step_s"]) if "plain" in ok else (r["plain"] or {}).get("status", "n/a"))
        for m in ("accum", "accum_dense", "builtin"):
            if m in ok:
                cells += [_ms(ok[m]["accumulate_step_s"]), _ms(ok[m]["update_step_s"]), _ms(ok[m]["mean_step_s"])]
            else:
                cells += [(r[m] or {}).get("status", "n/a"), "", ""]
        rows.append(cells)
        tracker = (ok.get("accum") or {}).get("table_tracker_bytes")
        mcells = [f"{v:,}", f"{v * p['dim'] * 4 / MIB:.0f}",
                  "n/a" if tracker is None else f"{tracker / MIB:.2f}"]
        for m in METHOD_ORDER:
            mcells += [_mem(r[m], "tensors"), _mem(r[m], "tensors", "resident")]
        mem_rows.append(mcells)
    headers = ["V", "table MiB", "plain ms", "accum: acc ms", "update ms", "mean ms",
               "accum, dense window: acc ms", "update ms", "mean ms",
               "built-in: acc ms", "update ms", "mean ms"]
    mem_headers = ["V", "table MiB", "row tracker MiB", "plain: peak", "resident", "accum: peak", "resident",
                   "accum, dense window: peak", "resident", "built-in: peak", "resident"]
    s = data["scaling"]
    lines = [format_table(headers, rows, markdown), "",
             f"Time per micro-step, ms. N={p['n']}, {p['batch'] * p['ids_per_example']} ids per micro-batch, "
             f"inner {p['inner']}; 'acc' = median accumulate-only micro-step, 'update' = median update step, "
             "'mean' = median over windows of the window's mean time per micro-step (the amortised cost; plain: "
             "every step is an update).", ""]
    for m, label in (("accum", "AccumulatingOptimizer accumulate-only micro-step"),
                     ("accum/update", "AccumulatingOptimizer update step (sparse window)"),
                     ("accum_dense/update", "AccumulatingOptimizer update step, dense window"),
                     ("builtin", "Keras built-in accumulate-only micro-step"),
                     ("plain", "plain step")):
        if s.get(m):
            lines.append(f"{label}: x{s[m]['ratio']:.2f} from V={s[m]['v_min']:,} to V={s[m]['v_max']:,} "
                         f"(V x{s[m]['v_max'] / s[m]['v_min']:.0f}); log-log slope {s[m]['slope']:.2f} "
                         "(0 = independent of V, 1 = proportional to V)")
    for line in targets(data):
        lines.append(line)
    lines += ["", format_table(mem_headers, mem_rows, markdown), "",
              f"Memory, MiB of {data['memory_label']} tensor memory above the built model, over the first window "
              "and one more accumulate-only micro-step: 'peak', and 'resident' (still allocated at the end: "
              "optimizer state, accumulators and any constants the step keeps). 'row tracker': the "
              "AccumulatingOptimizer's float16 row marks of the table (2 bytes per row), part of its resident."]
    return "\n".join(lines)


def targets(data: dict) -> list[str]:
    """The issue's figures to reach, each with the measured value (at the
    largest V of the run that is <= 10^6, and across V for the slope)."""
    res, p, s = data["results"], data["settings"], data["scaling"]
    ok = lambda m, v: (res.get(f"{m}/{v}") or {}).get("status") == "ok"  # noqa: E731
    vs = [v for v in p["vocab"] if v <= 1_000_000]
    if not vs:
        return []
    big = vs[-1]
    out = ["", f"Targets (at V={big:,} where a single V):"]
    if s.get("accum/update"):
        out.append(f"  update step log-log slope <= 0.2: {s['accum/update']['slope']:.2f}")
    if ok("accum", big) and ok("accum_dense", big):
        ratio = res[f"accum_dense/{big}"]["update_step_s"]["median"] / res[f"accum/{big}"]["update_step_s"]["median"]
        out.append(f"  update step >= 5x faster than the dense window: {ratio:.1f}x")
    if ok("accum", big) and ok("builtin", big):
        ratio = res[f"accum/{big}"]["mean_step_s"] / res[f"builtin/{big}"]["mean_step_s"]
        out.append(f"  mean time per micro-step <= 0.5x built-in: {ratio:.2f}x")
    worse = [v for v in p["vocab"] if ok("accum", v) and ok("builtin", v)
             and _peak_tensors(res[f"accum/{v}"]) > _peak_tensors(res[f"builtin/{v}"])]
    out.append("  peak memory <= built-in at every V: " + ("yes" if not worse else f"no, at V={worse}"))
    if ok("accum", big):
        r = res[f"accum/{big}"]
        bound = 1.1 * (r["table_bytes"] + r["accumulator_bytes"]["slots"])
        out.append(f"  peak <= (table + accumulator) x 1.1 = {bound / MIB:.0f} MiB: "
                   f"{_peak_tensors(r) / MIB:.0f} MiB")
    return out


def _slope(vs, ts):
    import math

    xs, ys = [math.log(v) for v in vs], [math.log(t) for t in ts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def scaling(results: dict, vocab) -> dict:
    """Log-log slope against V (from 10^4 to 10^6: the larger V of
    ``--full`` are left out, so that quick and full figures compare) of the
    accumulate-only micro-step per method (key ``method``; plain: its step)
    and of the update step (key ``method/update``)."""
    out = {}
    vocab = [v for v in vocab if v <= 1_000_000]
    series = [(m, "update_step_s" if m == "plain" else "accumulate_step_s", m) for m in METHOD_ORDER]
    series += [(m, "update_step_s", f"{m}/update") for m in ("accum", "accum_dense", "builtin")]
    for m, key, name in series:
        pts = [(v, results[f"{m}/{v}"][key]["median"]) for v in vocab
               if results.get(f"{m}/{v}", {}).get("status") == "ok" and results[f"{m}/{v}"].get(key)]
        if len(pts) >= 2:
            out[name] = {"v_min": pts[0][0], "v_max": pts[-1][0], "ratio": pts[-1][1] / pts[0][1],
                         "slope": _slope([p[0] for p in pts], [p[1] for p in pts]), "metric": key}
    return out


def _peak_tensors(r: dict) -> int:
    """Allocator peak when available (it sees transients), else the headline."""
    return (r.get("tf_allocator") or {}).get("delta", r["delta_bytes"])


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    p = data["settings"]
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [("plain", "update_step_s", "plain optimizer, every step", "tab:gray", "-", "o"),
              ("accum", "accumulate_step_s", "AccumulatingOptimizer, accumulate micro-step", "tab:blue", "-", "s"),
              ("accum", "update_step_s", "AccumulatingOptimizer, update step (1 in N)", "tab:blue", ":", "s"),
              ("accum", "mean_step_s", "AccumulatingOptimizer, mean per micro-step", "tab:blue", "--", "s"),
              ("accum_dense", "update_step_s", "AccumulatingOptimizer, dense-window update step", "tab:purple",
               ":", "D"),
              ("builtin", "accumulate_step_s", "Keras built-in, accumulate micro-step", "tab:orange", "-", "^"),
              ("builtin", "mean_step_s", "Keras built-in, mean per micro-step", "tab:orange", "--", "^")]
    for m, key, label, color, ls, marker in series:
        xy = []
        for v in p["vocab"]:
            r = data["results"].get(f"{m}/{v}")
            if r and r.get("status") == "ok" and r.get(key) is not None:
                val = r[key]["median"] if isinstance(r[key], dict) else r[key]
                xy.append((v, 1e3 * val))
        if xy:
            ax.plot([a for a, _ in xy], [b for _, b in xy], ls=ls, marker=marker, color=color, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("embedding rows V (x 64 float32)")
    ax.set_ylabel("time per micro-step, ms")
    ax.set_title(f"time, N={p['n']}, {p['batch'] * p['ids_per_example']} ids per micro-batch, inner {p['inner']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for m, label, color, marker in (("plain", "plain", "tab:gray", "o"),
                                    ("accum", "AccumulatingOptimizer", "tab:blue", "s"),
                                    ("accum_dense", "AccumulatingOptimizer, dense window", "tab:purple", "D"),
                                    ("builtin", "Keras built-in", "tab:orange", "^")):
        xy = [(v, _peak_tensors(data["results"][f"{m}/{v}"]) / MIB) for v in p["vocab"]
              if data["results"].get(f"{m}/{v}", {}).get("status") == "ok"]
        if xy:
            axm.plot([a for a, _ in xy], [b for _, b in xy], marker=marker, color=color, label=f"{label}, peak")
        xr = [(v, data["results"][f"{m}/{v}"]["tf_allocator"]["resident"] / MIB) for v in p["vocab"]
              if data["results"].get(f"{m}/{v}", {}).get("status") == "ok"
              and data["results"][f"{m}/{v}"].get("tf_allocator")
              and data["results"][f"{m}/{v}"]["tf_allocator"]["resident"] > 0]
        if xr and m != "plain":
            axm.plot([a for a, _ in xr], [b for _, b in xr], marker=marker, color=color, ls="--",
                     label=f"{label}, still allocated after training")
    axm.plot(p["vocab"], [v * p["dim"] * 4 / MIB for v in p["vocab"]], color="tab:green", ls=":",
             label="one float32 copy of the table")
    axm.set_xscale("log")
    axm.set_yscale("log")
    axm.set_xlabel("embedding rows V (x 64 float32)")
    axm.set_ylabel("peak memory above the built model, MiB (TF allocator)"
                   if any(r.get("tf_allocator") for r in data["results"].values() if r.get("status") == "ok")
                   else f"peak memory, MiB ({data['memory_label']})")
    axm.set_title("peak memory")
    axm.grid(True, which="both", alpha=0.3)
    axm.legend(fontsize=7)
    fig.suptitle("Sparse (Embedding) gradients: cost against table size")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--vocab", type=parse_int_list, help="comma list of table sizes V")
    parser.add_argument("--n", type=int, help="accumulation steps N (default 8)")
    parser.add_argument("--windows", type=int, help="windows of N micro-steps per run (the first is warm-up)")
    parser.add_argument("--inner", choices=("sgd", "adam"), default="sgd", help="inner optimizer (default sgd)")
    parser.add_argument("--jobs", type=int, help="workers at once (timings are only comparable with 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0

    p = dict(PROFILES[args.profile], inner=args.inner)
    for key in ("vocab", "n", "windows", "jobs"):
        if getattr(args, key):
            p[key] = tuple(getattr(args, key)) if key == "vocab" else getattr(args, key)
    p["windows"] = max(p["windows"], 2)
    t_start = time.perf_counter()
    env = static_env()
    configs = [dict(vocab=v, dim=p["dim"], batch=p["batch"], ids_per_example=p["ids_per_example"],
                    n=p["n"], windows=p["windows"], inner=p["inner"], methods=METHOD_ORDER)
               for v in p["vocab"]]
    prog = Progress("sparse", len(configs))
    prog.note(f"profile={args.profile}: {len(configs)} table sizes, each in a fresh subprocess "
              f"running {', '.join(METHOD_ORDER)} side by side")
    results, tfenv = {}, {}

    def done(i, w):
        v = configs[i]["vocab"]
        if w.get("status", "ok") != "ok" or "methods" not in w:  # the whole worker failed
            for m in METHOD_ORDER:
                results[f"{m}/{v}"] = {k: w[k] for k in ("status", "stderr_tail", "returncode") if k in w}
            prog.step(f"V={v:,}", f"{w.get('status')} {w.get('stderr_tail', '')[-300:]}", w.get("seconds"))
            return
        tfenv.update(w.get("env", {}))
        parts = []
        for m in METHOD_ORDER:
            r = w["methods"].get(m, {"status": "missing"})
            results[f"{m}/{v}"] = r
            if r.get("status") == "ok":
                parts.append(f"{m} {1e3 * r['mean_step_s']:.2f} ms, {fmt_mib(_peak_tensors(r), 0)} MiB")
            else:
                parts.append(f"{m} {r.get('status')} ({r.get('reason', '')[:100]})")
        prog.step(f"V={v:,} (mean time per micro-step, peak memory)", "; ".join(parts), w.get("seconds"))

    run_workers("benchmarks.sparse", configs, p["jobs"], p["timeout"], done)
    env.update(tfenv)
    gpu = bool(tfenv.get("gpu_count"))
    data = {"benchmark": "sparse", "profile": args.profile, "env": env,
            "settings": {**p, "methods": METHOD_ORDER, "ids_per_micro_batch": p["batch"] * p["ids_per_example"]},
            "memory_label": "GPU allocator" if gpu else "TF CPU allocator",
            "results": results}
    data["scaling"] = scaling(results, p["vocab"])
    data["wall_seconds"] = time.perf_counter() - t_start
    return print_and_write(args.out, "sparse", data, table(data), table(data, markdown=True), plot, prog)


if __name__ == "__main__":
    sys.exit(main())
