"""Peak training memory: plain optimizer vs AccumulatingOptimizer vs Keras' built-in.

For each model (a small ResNet-style CNN on 32x32x3 images, a small
Transformer encoder on 256 tokens, and ``transformer_big``: a Transformer
encoder with d_model 512, 6 layers and 21M trainable parameters on 128
tokens, where the accumulator is a real cost next to the activations it
saves), micro-batch size B and accumulation steps N, it measures the peak memory of one training process for

  (a) batch B, plain optimizer (Adam);
  (b) batch B, AccumulatingOptimizer(Adam, N);
  (c) batch N*B, plain optimizer: what accumulation saves ("OOM" or
      "over budget" where it does not fit);
  (d) batch B, Keras' built-in Adam(gradient_accumulation_steps=N).

Each configuration runs in a fresh subprocess (a tf.function custom loop with
Adam; the accumulating runs take one full window, or ``windows`` of them, and
then one more accumulate-only micro-step, so the accumulators are in use when
the run ends). Before its baseline, the worker trains a throwaway miniature of
the model for two steps, so TensorFlow's one-time runtime set-up (~25 MiB of
RSS on a CPU) is not counted. Memory is measured from right after the model
is built (weights and the input batch resident) to the end of training:

  * GPU: ``tf.config.experimental.get_memory_info('GPU:0')['peak']`` after
    ``reset_memory_stats``, minus the memory in use at the baseline.
    ``--budget-mib`` caps the GPU (a logical device with that memory limit),
    so configurations that do not fit fail with a real OOM.
  * CPU: the headline is peak RSS minus the RSS at the baseline (the
    kernel's high-water mark is reset there). ``--budget-mib`` marks runs
    above it as "over budget". A second table gives TensorFlow's CPU
    allocator statistics (the workers run with TF_CPU_ALLOCATOR_USE_BFC=true):
    tensor memory only, what a GPU would report. RSS also counts host-side
    costs such as the traced graph (the accumulating step's graph, with its
    update branch, is larger), which a GPU would not hold.

The figures include everything training adds: optimizer state (Adam's two
slots; the accumulators), gradients, activations, temporaries. The
accumulator's own cost is reported next to the parameter bytes (the floor:
one float32 copy of the trainable parameters), both as the bytes of the state
the optimizer allocates and as measured differences (b) - (a): tensor memory
still allocated at the end, peak tensor memory, and peak RSS.

    python -m benchmarks.memory            # quick profile (default)
    python -m benchmarks.memory --full     # bigger models and batches
    python -m benchmarks.memory --tiny     # seconds; what the smoke test runs
    python -m benchmarks.memory --backend jax   # Keras 3 on JAX (a venv with jax: .venvs/k3-jax)

``--backend jax|torch`` (default: ``KERAS_BACKEND``, else tensorflow)
measures the same four cases on that Keras backend, each worker training
with ``model.fit`` on NumPy batches (JAX: XLA; torch: eager). GPU: JAX's
``device.memory_stats()['peak_bytes_in_use']`` (a lifetime peak: JAX cannot
reset it; the build before the baseline stays below it) or torch's
``max_memory_allocated()`` after ``reset_peak_memory_stats``, minus the
memory in use at the baseline; CPU: peak RSS as above (no allocator table).

Writes ``<out>/memory.json`` (raw figures and environment) and
``<out>/memory.png`` (peak memory against effective batch, one line per method,
and a dashed line at the plain micro-batch's peak plus one float32 copy of
the parameters: the least accumulation can cost; where the plain N*B line
rises above it, accumulation pays).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _training  # noqa: E402
from benchmarks._devices import configure_gpu, on_device, select_backend  # noqa: E402
from benchmarks._env import backend_env, static_env, tf_env  # noqa: E402
from benchmarks._memory import PeakMemory  # noqa: E402
from benchmarks._models import build_model, make_batch, model_loss  # noqa: E402
from benchmarks._output import MIB, Progress, fmt_mib, format_table, pyplot, save_figure, write_outputs  # noqa: E402
from benchmarks._profiles import (  # noqa: E402
    MODEL_SIZES, MODELS, add_backend_arg, apply_model_args, benchmark_parser)
from benchmarks._training import (  # noqa: E402
    NotApplicable, accumulator_bytes, make_optimizer, make_train_step, warm_up_runtime)
from benchmarks._workers import emit_result, run_worker, run_workers  # noqa: E402

# `model_ns`: the N swept for a model, where it differs from `ns`.
# transformer_big (21M parameters, 80 MiB float32) at B=2 sequences of 128
# tokens: one micro-batch adds about as much tensor memory as the parameters
# take (the quick run prints the ratio). Each of its workers spends ~30 s
# tracing on 2 CPU cores, so it is not in the quick profile's default models
# (`make bench` must stay < 10 min): `--models transformer_big` measures it
# with the quick settings at N=4 only (4 workers); --full sweeps N = 2, 4, 8, 16.
PROFILES = {
    "tiny": dict(models=("transformer",), batch={"cnn": 2, "transformer": 1, "transformer_big": 1},
                 ns=(2,), model_ns={}, plain_steps=1, windows=1, jobs=4, timeout=300),
    "quick": dict(models=MODELS, batch={"cnn": 16, "transformer": 4, "transformer_big": 2},
                  ns=(2, 4, 8, 16), model_ns={"transformer_big": (4,)},
                  plain_steps=2, windows=1, jobs=2, timeout=600),
    "full": dict(models=MODELS + ("transformer_big",), batch={"cnn": 32, "transformer": 8, "transformer_big": 2},
                 ns=(2, 4, 8, 16), model_ns={}, plain_steps=3, windows=2, jobs=2, timeout=1800),
}


def ns_of(p: dict, kind: str) -> tuple:
    return tuple(p.get("model_ns", {}).get(kind, p["ns"]))


# ------------------------------------------------------------------- worker
def worker(cfg: dict) -> dict:
    """One configuration in this (fresh) process; returns the figures."""
    import os

    if cfg.get("backend", "tensorflow") != "tensorflow":
        return keras_worker(cfg, cfg["backend"])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    gpu = configure_gpu(cfg.get("budget_mib"))
    result = {"env": tf_env()}
    kind, size = cfg["model"], cfg["size"]
    warm_up_runtime(kind, size)
    model = build_model(kind, size, seed=0)
    x, y = on_device(*make_batch(kind, size, cfg["batch"], seed=1))
    result["param_count"] = int(sum(int(v.shape.num_elements()) for v in model.trainable_variables))
    result["param_bytes"] = _training.param_bytes(model.trainable_variables)
    mem = PeakMemory(gpu)
    mem.start()  # the model is built: weights and the input batch are resident
    try:
        opt = make_optimizer(cfg["method"], cfg["n"], cfg.get("inner", "adam"))
    except NotApplicable as e:
        return {**result, "status": "n/a", "reason": str(e)}
    step = make_train_step(model, opt, model_loss(kind), jit_compile=False)
    losses = []
    t0 = time.perf_counter()
    for i in range(cfg["steps"]):
        losses.append(float(step(x, y).numpy()))
        if i == 0:
            result["after_first_step_bytes"] = mem.current() - mem.base
    result["train_seconds"] = time.perf_counter() - t0
    result["final_loss"] = losses[-1]
    del losses
    gc.collect()
    result.update(mem.stop())
    result["optimizer_state_bytes"] = _training.param_bytes(opt.variables)
    result["accumulator_bytes"] = accumulator_bytes(opt)
    result["iterations"] = int(opt.iterations.numpy())
    result["status"] = "ok"
    return result


def keras_worker(cfg: dict, backend: str) -> dict:
    """:func:`worker` on Keras 3's JAX or torch backend, training in ``fit``."""
    import math
    import os

    os.environ["KERAS_BACKEND"] = backend
    import numpy as np
    from keras import ops

    env = backend_env(backend)
    gpu = not env["device"].startswith(("cpu", "CPU"))
    result = {"env": env}
    kind, size = cfg["model"], cfg["size"]
    warm_up_runtime(kind, size, backend)
    model = build_model(kind, size, seed=0)
    x, y = make_batch(kind, size, cfg["batch"], seed=1)
    result["param_count"] = int(sum(math.prod(v.shape) for v in model.trainable_variables))
    result["param_bytes"] = _training.param_bytes(model.trainable_variables)
    mem = PeakMemory(gpu, backend)
    mem.start()  # the model is built: weights resident
    try:
        opt = make_optimizer(cfg["method"], cfg["n"], cfg.get("inner", "adam"))
    except NotApplicable as e:
        return {**result, "status": "n/a", "reason": str(e)}
    model.compile(optimizer=opt, loss=model_loss(kind))
    t0 = time.perf_counter()
    history = model.fit(np.concatenate([x] * cfg["steps"]), np.concatenate([y] * cfg["steps"]),
                        batch_size=cfg["batch"], epochs=1, shuffle=False, verbose=0)
    result["train_seconds"] = time.perf_counter() - t0
    result["final_loss"] = float(history.history["loss"][-1])
    gc.collect()
    result.update(mem.stop())
    result["optimizer_state_bytes"] = _training.param_bytes(opt.variables)
    result["accumulator_bytes"] = accumulator_bytes(opt)
    result["iterations"] = int(ops.convert_to_numpy(opt.iterations))
    result["status"] = "ok"
    return result


# ------------------------------------------------------------------- parent
def build_configs(p: dict, args) -> list[dict]:
    configs = []
    for kind in p["models"]:
        size = MODEL_SIZES[args.profile][kind]
        b = p["batch"][kind]
        base = dict(model=kind, size=size, micro_batch=b, inner="adam", budget_mib=args.budget_mib,
                    backend=args.backend)
        configs.append(dict(base, case="a", method="plain", n=1, batch=b, effective_batch=b,
                            steps=p["plain_steps"]))
        for n in ns_of(p, kind):
            # Whole windows plus one accumulate-only micro-step, so the
            # accumulators are in use (materialised) when the run ends.
            configs.append(dict(base, case="b", method="accum", n=n, batch=b, effective_batch=n * b,
                                steps=p["windows"] * n + 1))
            configs.append(dict(base, case="c", method="plain", n=n, batch=n * b, effective_batch=n * b,
                                steps=p["plain_steps"]))
            configs.append(dict(base, case="d", method="builtin", n=n, batch=b, effective_batch=n * b,
                                steps=p["windows"] * n + 1))
    return configs


CASE_LABEL = {"a": "(a) plain, batch B", "b": "(b) accum, batch B", "c": "(c) plain, batch N*B",
              "d": "(d) built-in, batch B"}


def _describe(cfg: dict) -> str:
    n = "" if cfg["case"] == "a" else f" N={cfg['n']}"
    return f"{cfg['model']} {CASE_LABEL[cfg['case']]}{n} (batch {cfg['batch']})"


# Figures read from a worker result: the headline (RSS on a CPU, the GPU
# allocator on a GPU) and TensorFlow's allocator statistics.
METRICS = {
    "headline_peak": lambda r: r["delta_bytes"],
    "alloc_peak": lambda r: (r.get("tf_allocator") or {}).get("delta"),
    "alloc_resident": lambda r: (r.get("tf_allocator") or {}).get("resident"),
    "rss_resident": lambda r: r["rss"]["resident"],
}


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok"


def _get(r: dict | None, metric: str):
    return METRICS[metric](r) if _ok(r) else None


def _status(r: dict | None, budget_mib: float | None) -> str:
    if r is None:
        return "n/a"
    if r.get("status") != "ok":
        return r.get("status", "error")
    if budget_mib and r["delta_bytes"] > budget_mib * MIB:
        return "over budget"
    return "ok"


def _diff(x, y):
    return None if x is None or y is None else x - y


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(configs: list[dict], results: list[dict], args, p: dict) -> dict:
    per_model = {}
    for kind in p["models"]:
        runs = [dict(cfg, result=res) for cfg, res in zip(configs, results) if cfg["model"] == kind]
        by = {(r["case"], r["n"]): r["result"] for r in runs}
        a = by.get(("a", 1))
        param_bytes = next((r["result"]["param_bytes"] for r in runs if "param_bytes" in r["result"]), None)
        param_count = next((r["result"]["param_count"] for r in runs if "param_count" in r["result"]), None)
        rows = []
        for n in ns_of(p, kind):
            b, c, d = by.get(("b", n)), by.get(("c", n)), by.get(("d", n))
            row = {"n": n, "effective_batch": n * p["batch"][kind],
                   "status": {k: _status(r, args.budget_mib) for k, r in (("a", a), ("b", b), ("c", c), ("d", d))}}
            for metric in METRICS:
                va, vb, vc, vd = (_get(r, metric) for r in (a, b, c, d))
                row[metric] = {"a_plain_B": va, "b_accum_B": vb, "c_plain_NB": vc, "d_builtin_B": vd,
                               "b_over_c": vb / vc if vb and vc else None,
                               "b_minus_a": _diff(vb, va), "d_minus_a": _diff(vd, va)}
            row["accum_state_bytes"] = b["accumulator_bytes"]["total"] if _ok(b) else None
            row["builtin_state_bytes"] = d["accumulator_bytes"]["total"] if _ok(d) else None
            rows.append(row)

        def med(metric, key):
            return _median([r[metric][key] for r in rows])

        static = next((r["accum_state_bytes"] for r in rows if r["accum_state_bytes"] is not None), None)
        static_d = next((r["builtin_state_bytes"] for r in rows if r["builtin_state_bytes"] is not None), None)
        cost = {"floor_bytes": param_bytes, "accum_state_bytes": static, "builtin_state_bytes": static_d}
        for metric in METRICS:
            cost[f"accum_{metric}_b_minus_a_median_bytes"] = med(metric, "b_minus_a")
            cost[f"builtin_{metric}_d_minus_a_median_bytes"] = med(metric, "d_minus_a")
            # What one micro-batch of B adds (activations, gradients' share and
            # temporaries that grow with the batch): ((c) - (a)) / (N - 1),
            # median over N; to set against the parameter bytes.
            cost[f"per_micro_batch_{metric}_bytes"] = _median(
                [(r[metric]["c_plain_NB"] - r[metric]["a_plain_B"]) / (r["n"] - 1) for r in rows
                 if r["n"] > 1 and r[metric]["c_plain_NB"] is not None and r[metric]["a_plain_B"] is not None])
        per_model[kind] = {"size": MODEL_SIZES[args.profile][kind], "micro_batch": p["batch"][kind],
                           "ns": list(ns_of(p, kind)),
                           "param_count": param_count, "param_bytes": param_bytes, "rows": rows,
                           "accumulator_cost": cost, "runs": runs}
    return per_model


def _cell(r: dict | None, metric: str, budget_mib: float | None) -> str:
    st = _status(r, budget_mib)
    v = _get(r, metric)
    if st == "ok" or (st == "over budget" and metric != "headline_peak"):
        return fmt_mib(v)
    if st == "over budget":
        return f"{fmt_mib(v)} over budget"
    return st


def _pct(x, floor):
    return "n/a" if x is None or not floor else f"{100 * x / floor:.0f}%"


def tables(per_model: dict, budget_mib: float | None, labels: dict, markdown: bool = False) -> str:
    """``labels``: metric -> description, for the metrics to tabulate."""
    out = []
    for kind, m in per_model.items():
        pb = m["param_bytes"]
        if not pb:
            out += [f"{kind}: no successful run", ""]
            continue
        by_run = {(r["case"], r["n"]): r["result"] for r in m["runs"]}
        for metric, label in labels.items():
            if all(_get(r["result"], metric) is None for r in m["runs"]):
                continue
            head = (f"{kind} ({m['param_count']:,} params = {fmt_mib(pb, 2)} MiB float32), micro-batch "
                    f"B={m['micro_batch']}: {label}, MiB")
            rows = []
            for row in m["rows"]:
                n, f = row["n"], row[metric]
                rows.append([n, row["effective_batch"],
                             _cell(by_run.get(("a", 1)), metric, budget_mib),
                             _cell(by_run.get(("b", n)), metric, budget_mib),
                             _cell(by_run.get(("c", n)), metric, budget_mib),
                             _cell(by_run.get(("d", n)), metric, budget_mib),
                             "n/a" if f["b_over_c"] is None else f"{f['b_over_c']:.2f}",
                             fmt_mib(f["b_minus_a"], 2), _pct(f["b_minus_a"], pb)])
            headers = ["N", "N*B", "(a) plain B", "(b) accum B", "(c) plain N*B", "(d) built-in B",
                       "(b)/(c)", "(b)-(a)", "(b)-(a)/params"]
            if markdown:
                out += [f"**{head}**", "", format_table(headers, rows, True), ""]
            else:
                out += [head, format_table(headers, rows), ""]
        ac = m["accumulator_cost"]
        lines = [f"Accumulator cost ({kind}): floor = one float32 copy of the trainable parameters = "
                 f"{fmt_mib(pb, 3)} MiB.",
                 f"  allocated state: AccumulatingOptimizer {fmt_mib(ac['accum_state_bytes'], 3)} MiB "
                 f"({_pct(ac['accum_state_bytes'], pb)} of the floor), Keras built-in "
                 f"{fmt_mib(ac['builtin_state_bytes'], 3)} MiB ({_pct(ac['builtin_state_bytes'], pb)})."]
        if ac.get("accum_alloc_resident_b_minus_a_median_bytes") is not None:
            lines.append(
                f"  measured, tensor memory still allocated after training (TF allocator), (b)-(a) median: "
                f"{fmt_mib(ac['accum_alloc_resident_b_minus_a_median_bytes'], 3)} MiB "
                f"({_pct(ac['accum_alloc_resident_b_minus_a_median_bytes'], pb)} of the floor); built-in (d)-(a): "
                f"{fmt_mib(ac['builtin_alloc_resident_d_minus_a_median_bytes'], 3)} MiB "
                f"({_pct(ac['builtin_alloc_resident_d_minus_a_median_bytes'], pb)}).")
            lines.append(
                f"  measured, peak tensor memory (TF allocator), (b)-(a) median: "
                f"{fmt_mib(ac['accum_alloc_peak_b_minus_a_median_bytes'], 3)} MiB "
                f"({_pct(ac['accum_alloc_peak_b_minus_a_median_bytes'], pb)}); built-in (d)-(a): "
                f"{fmt_mib(ac['builtin_alloc_peak_d_minus_a_median_bytes'], 3)} MiB "
                f"({_pct(ac['builtin_alloc_peak_d_minus_a_median_bytes'], pb)}).")
        per_b = ac.get("per_micro_batch_alloc_peak_bytes")
        per_b_src = "peak tensor memory"
        if per_b is None:
            per_b, per_b_src = ac.get("per_micro_batch_headline_peak_bytes"), "headline peak"
        if per_b is not None:
            lines.append(
                f"  what one micro-batch of B={m['micro_batch']} adds ({per_b_src}, ((c)-(a))/(N-1), median over N): "
                f"{fmt_mib(per_b, 1)} MiB = {per_b / pb:.2f} x the float32 parameters.")
        lines.append(
            f"  measured, headline peak, (b)-(a) median: "
            f"{fmt_mib(ac['accum_headline_peak_b_minus_a_median_bytes'], 2)} MiB; built-in (d)-(a): "
            f"{fmt_mib(ac['builtin_headline_peak_d_minus_a_median_bytes'], 2)} MiB.")
        out += ["\n".join(lines) if not markdown else "\n".join(l.strip() + "  " for l in lines), ""]
    return "\n".join(out)


def plot(per_model: dict, budget_mib: float | None, labels: dict, path: Path) -> Path:
    plt = pyplot()
    metrics = [m for m in labels if any(_get(r["result"], m) is not None
                                        for pm in per_model.values() for r in pm["runs"])] or ["headline_peak"]
    fig, axes = plt.subplots(len(metrics), len(per_model), figsize=(6 * len(per_model), 4.2 * len(metrics)),
                             squeeze=False, constrained_layout=True)
    styles = {"plain": ("tab:gray", "o", "plain optimizer, batch = effective batch"),
              "accum": ("tab:blue", "s", "AccumulatingOptimizer, micro-batch B"),
              "builtin": ("tab:orange", "^", "Keras built-in, micro-batch B")}
    for row_i, metric in enumerate(metrics):
        for ax, (kind, m) in zip(axes[row_i], per_model.items()):
            by_run = {(r["case"], r["n"]): r["result"] for r in m["runs"]}
            B = m["micro_batch"]
            pts = {"plain": [], "accum": [], "builtin": []}
            va = _get(by_run.get(("a", 1)), metric)
            if va is not None:
                for k in pts:
                    pts[k].append((B, va / MIB))
            failed = []
            for row in m["rows"]:
                n = row["n"]
                for case, key in (("b", "accum"), ("c", "plain"), ("d", "builtin")):
                    r = by_run.get((case, n))
                    v = _get(r, metric)
                    if v is not None:
                        pts[key].append((n * B, v / MIB))
                    elif r is not None and r.get("status") not in ("ok", "n/a"):
                        failed.append((key, n * B, r.get("status")))
            for key, xy in pts.items():
                if xy:
                    color, marker, label = styles[key]
                    ax.plot([q[0] for q in xy], [q[1] for q in xy], marker=marker, color=color, label=label)
            for key, xb, st in failed:
                ax.axvline(xb, color=styles[key][0], ls=":", lw=1)
                ax.annotate(f"{key}: {st}", (xb, 0.5), xycoords=("data", "axes fraction"), rotation=90,
                            fontsize=8, color=styles[key][0])
            if budget_mib and metric == "headline_peak":
                ax.axhline(budget_mib, color="red", ls="--", lw=1, label=f"budget {budget_mib:g} MiB")
            if m["param_bytes"]:
                ax.axhline(m["param_bytes"] / MIB, color="tab:green", ls=":", lw=1,
                           label="one float32 copy of the params")
                if va is not None:
                    # What accumulation costs at best: the micro-batch's own
                    # peak plus one float32 copy of the parameters. Where the
                    # plain line rises above it, accumulation pays.
                    ax.axhline((va + m["param_bytes"]) / MIB, color="tab:blue", ls="--", lw=1,
                               label="plain micro-batch peak + accumulator floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({B} | {row["effective_batch"] for row in m["rows"]})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(f"effective batch size N x B (B = {B})")
            ax.set_ylabel(f"MiB: {labels.get(metric, metric)}", fontsize=8)
            title = f"{kind} ({m['param_count']:,} params)" if m["param_count"] else kind
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Peak training memory against effective batch size")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, models=True)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="memory budget: GPU memory limit (real OOM) / CPU 'over budget' mark")
    parser.add_argument("--jobs", type=int, help="workers run at once on the CPU (memory figures are "
                        "per process, so they stay valid; always 1 on a GPU)")
    add_backend_arg(parser, "; jax and torch train in fit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        select_backend(parser, args.backend)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0

    p = apply_model_args(parser, args, dict(PROFILES[args.profile]))
    if args.n:
        p["model_ns"] = {}  # an explicit --n applies to every model
    if args.jobs:
        p["jobs"] = args.jobs
    t_start = time.perf_counter()
    env = static_env()
    configs = build_configs(p, args)
    prog = Progress("memory", len(configs))
    prog.note(f"profile={args.profile}: {len(configs)} configurations, each in a fresh subprocess")
    results: list[dict | None] = [None] * len(configs)

    def done(i, r):
        results[i] = r
        if r.get("status") == "ok":
            alloc = r.get("tf_allocator")
            res = f"peak {fmt_mib(r['delta_bytes'])} MiB ({r['source']})"
            if alloc and r["source"].startswith("RSS"):
                res += f", tensors {fmt_mib(alloc['delta'])} MiB"
        else:
            res = r.get("status", "error")
            detail = r.get("reason") or r.get("stderr_tail", "")
            if detail and res != "OOM":
                res += f" ({detail[-300:]})"
        prog.step(_describe(configs[i]), res, r.get("seconds"))

    # The first worker alone: it reports the device; on a GPU run the rest one at a time.
    done(0, run_worker("benchmarks.memory", configs[0], p["timeout"]))
    tfenv = results[0].get("env", {})
    jobs = 1 if tfenv.get("gpu_count") or (args.backend != "tensorflow" and tfenv.get("memory_source", "RSS") != "RSS") \
        else p["jobs"]
    run_workers("benchmarks.memory", configs[1:], jobs, p["timeout"], lambda i, r: done(i + 1, r))
    env.update(tfenv)
    gpu = bool(tfenv.get("gpu_count")) or (args.backend != "tensorflow"
                                             and not str(tfenv.get("device", "cpu")).lower().startswith("cpu"))
    if gpu:
        labels = {"headline_peak": f"peak GPU memory ({args.backend} allocator) - after build"}
    elif args.backend != "tensorflow":
        labels = {"headline_peak": "peak RSS - RSS after build"}
    else:
        labels = {"headline_peak": "peak RSS - RSS after build",
                  "alloc_peak": "peak tensor memory (TF CPU allocator) - after build"}
    per_model = summarize(configs, results, args, p)
    text = tables(per_model, args.budget_mib, labels)
    print()
    print(text)
    out = Path(args.out)
    data = {
        "benchmark": "memory",
        "profile": args.profile,
        "env": env,
        "settings": {**p, "budget_mib": args.budget_mib, "headline_memory": labels["headline_peak"],
                     "inner_optimizer": "adam", "backend": args.backend,
                     "loop": "tf.function custom loop, jit_compile off" if args.backend == "tensorflow"
                     else "model.fit on NumPy batches (JAX: XLA; torch: eager)",
                     "jobs_used": jobs},
        "models": per_model,
        "wall_seconds": time.perf_counter() - t_start,
    }
    md = tables(per_model, args.budget_mib, labels, markdown=True)
    narrow = [k for k in p["models"] if args.profile != "full" and not args.n
              and len(ns_of(p, k)) < len(ns_of(PROFILES["full"], k))]
    if narrow:
        md += ("\n" + ", ".join(narrow) + f": N = {', '.join(str(n) for n in ns_of(p, narrow[0]))} only in the "
               f"{args.profile} profile; the sweep over N = {', '.join(str(n) for n in PROFILES['full']['ns'])}: "
               f"`.venv/bin/python -m benchmarks.memory --full --models {','.join(narrow)}`.\n")
    write_outputs(
        out, "memory" if args.backend == "tensorflow" else f"memory_{args.backend}", data, md,
        lambda _data, path: plot(per_model, args.budget_mib, labels, path), prog,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
