"""Time and all-reduce traffic per accumulation window under MultiWorkerMirroredStrategy.

Two worker processes on 127.0.0.1 (``tests/support/cluster.py``: ``TF_CONFIG``
with free loopback ports, one CPU device each, so 2 replicas), an MLP of
more than 1M parameters (quick and full profiles), Adam, a custom loop
(``strategy.run`` in a ``tf.function``) on a fixed global micro-batch ``B``
(``B / 2`` samples per worker). For each N, one window of N micro-batches is
trained by:

  * ``plain``: plain Adam, N separate steps (each all-reduces the gradients),
  * ``accum``: ``AccumulatingOptimizer(Adam, N)`` (one all-reduce per window),
  * ``builtin``: Keras' ``Adam(gradient_accumulation_steps=N)``; in a
    ``tf.function`` it raises under MWMS (a ``merge_call`` inside its update
    ``cond``), recorded as the error;
  * ``builtin-eager`` and ``accum-eager``: the same two without
    ``tf.function``, where Keras' built-in runs, side by side (eager steps are
    slower; compare these two with each other). N=1 is rejected by Keras'
    built-in: "n/a".

Traffic is counted, not assumed (``tests/support/collectives.py``): the bytes,
elements and launches of the collective all-reduces that execute during a
window, in all and for the gradient reductions. The wrapper's gradient bytes
per window must be 1/N of plain's (the script exits 1 otherwise).

Timing: every configuration is built, traced and warmed up first; then in
each of ``--rounds`` rounds one window of each configuration runs, in an
order that rotates from round to round, timed on both workers (worker 0's
figures are reported; the collectives keep the two in step). Time per window
is the median [interquartile range] over rounds.

    python -m benchmarks.distributed            # quick profile (default; ~2-4 min on 2 busy cores)
    python -m benchmarks.distributed --full     # more rounds, bigger batch
    python -m benchmarks.distributed --tiny     # seconds of training; a smoke run

Writes ``<out>/distributed.json``, ``<out>/distributed.png`` and
``<out>/distributed.md``. Not part of ``make bench`` (the quick ``make bench``
already takes most of its 10-minute budget).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/distributed.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks._env import REPO_ROOT, static_env, tests_support  # noqa: E402
from benchmarks._output import MIB, Progress, fmt_mib, format_table, print_and_write, pyplot, save_figure  # noqa: E402
from benchmarks._profiles import benchmark_parser, parse_int_list  # noqa: E402
from benchmarks._stats import summarize  # noqa: E402


WORKERS = 2
METHODS = ("plain", "accum", "builtin", "accum-eager", "builtin-eager")
PROFILES = {
    "tiny": dict(in_dim=32, hidden=64, layers=2, out_dim=10, batch=8, ns=(1, 2), rounds=2,
                 methods=METHODS, timeout=600),
    # 256*1024 + 1024*1024 + 1024*10 weights + 2058 biases = 1,323,018 parameters.
    "quick": dict(in_dim=256, hidden=1024, layers=2, out_dim=10, batch=16, ns=(1, 4, 16), rounds=10,
                  methods=METHODS, timeout=1200),
    "full": dict(in_dim=512, hidden=1024, layers=3, out_dim=10, batch=64, ns=(1, 4, 16), rounds=15,
                 methods=METHODS, timeout=3600),
}


# ------------------------------------------------------------------ worker
def _model(p: dict):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((p["in_dim"],))]
    layers += [keras.layers.Dense(p["hidden"], activation="relu") for _ in range(p["layers"])]
    layers += [keras.layers.Dense(p["out_dim"])]
    return keras.Sequential(layers)


def _optimizer(method: str, n: int):
    import keras

    from accum_optimizer import AccumulatingOptimizer

    if method == "plain":
        return keras.optimizers.Adam(1e-3)
    if method.startswith("accum"):
        return AccumulatingOptimizer(keras.optimizers.Adam(1e-3), gradient_accumulation_steps=n)
    return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=n)


def worker(p: dict, out: Path) -> None:
    import numpy as np
    import tensorflow as tf

    tests_support()  # the multi-worker tests' launcher and collective counter
    from support.collectives import CollectiveCounter

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    assert strategy.num_replicas_in_sync == WORKERS
    counter = CollectiveCounter()
    rng = np.random.default_rng(task)
    local = p["batch"] // WORKERS
    x = tf.constant(rng.normal(size=(local, p["in_dim"])).astype("float32"))
    y = tf.constant(rng.integers(0, p["out_dim"], size=(local,)))
    batch = strategy.experimental_distribute_values_from_function(lambda ctx: (x, y))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    configs, results = [], []
    for n in p["ns"]:
        for method in p["methods"]:
            row = {"n": n, "method": method}
            results.append(row)
            if method.startswith("builtin") and n == 1:
                row.update(runs=False, error="n/a: Keras rejects gradient_accumulation_steps=1")
                continue
            try:
                with strategy.scope():
                    model = _model(p)
                    opt = _optimizer(method, n)
                    opt.build(model.trainable_variables)

                def step_fn(xb, yb, model=model, opt=opt):
                    with tf.GradientTape() as tape:
                        loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)),
                                                          global_batch_size=p["batch"])
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables))

                def step(b, step_fn=step_fn):
                    strategy.run(step_fn, args=b)

                if not method.endswith("eager"):
                    step = tf.function(step)
                window = _window(step, batch, opt, n)
                window()  # traces (graph) and warms up
                before = counter.read()
                window()
                after = counter.read()
                row.update(runs=True, param_count=int(sum(np.prod(v.shape) for v in model.trainable_variables)),
                           per_window={k: after[k] - before[k] for k in after}, seconds=[])
                configs.append((row, window))
            except Exception as e:  # Keras' built-in in a tf.function: recorded
                text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # no terminal colours
                msg = [line.strip() for line in text.splitlines() if line.strip()]
                keep = [line for line in msg if "merge_call" in line or "Error" in line] or msg
                row.update(runs=False, error=f"{type(e).__name__}: {keep[-1][:300] if keep else ''}")
            print(f"[worker {task}] built N={n} {method}: {'ok' if row['runs'] else row['error'][:80]}", flush=True)

    for r in range(p["rounds"]):
        shift = r % max(1, len(configs))
        for row, window in configs[shift:] + configs[:shift]:
            t0 = time.perf_counter()
            window()
            row["seconds"].append(time.perf_counter() - t0)
        print(f"[worker {task}] round {r + 1}/{p['rounds']}", flush=True)
    (out / f"worker{task}.json").write_text(json.dumps(results))


def _window(step, batch, opt, n: int):
    def window():
        for _ in range(n):
            step(batch)
        # A read that waits for the window's last step to finish.
        return int(opt.iterations.numpy())

    return window


# ------------------------------------------------------------------ parent
def run(p: dict) -> dict:
    """Run the two workers; their figures, worker 0's as the row."""
    tests_support()  # the multi-worker tests' launcher and collective counter
    from support.cluster import run_cluster

    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp) / "params.json"
        params.write_text(json.dumps(p))
        run_cluster(["-m", "benchmarks.distributed", "--worker", str(params), "--out", tmp],
                    Path(tmp) / "logs", timeout=p["timeout"], num_workers=WORKERS, pythonpath=[str(REPO_ROOT)])
        workers = [json.loads((Path(tmp) / f"worker{i}.json").read_text()) for i in range(WORKERS)]
    rows = []
    for i, row in enumerate(workers[0]):
        row = dict(row)
        if row.get("runs"):
            row["window_s"] = summarize(row.pop("seconds"))
            row["window_s_worker1"] = summarize(workers[1][i]["seconds"])
            row["per_window_worker1"] = workers[1][i]["per_window"]
        rows.append(row)
    return {"rows": rows}


def checks(data: dict) -> list[str]:
    """The wrapper's gradient all-reduce bytes per window are 1/N of plain's."""
    problems = []
    by = {(r["n"], r["method"]): r for r in data["rows"]}
    for n in data["settings"]["ns"]:
        plain, accum = by.get((n, "plain")), by.get((n, "accum"))
        if not (plain and accum and plain.get("runs") and accum.get("runs")):
            problems.append(f"N={n}: plain or accum did not run")
            continue
        pb, ab = plain["per_window"]["grad_bytes"], accum["per_window"]["grad_bytes"]
        if pb != n * ab or ab != 4 * accum["param_count"]:
            problems.append(f"N={n}: gradient bytes per window plain {pb}, accum {ab} (expected plain = N * accum "
                            f"= N * 4 * {accum['param_count']})")
    return problems


def table(data: dict, markdown: bool = False) -> str:
    headers = ["N", "method", "ms / window (median [IQR])", "ms / micro-step", "grad all-reduce MiB / window",
               "grad launches / window", "all collectives MiB / window", "vs plain bytes"]
    rows = []
    by = {(r["n"], r["method"]): r for r in data["rows"]}
    for r in data["rows"]:
        if not r.get("runs"):
            error = r.get("error", "n/a").split(". ")[0]  # its first sentence
            rows.append([r["n"], r["method"], error if markdown else error[:70], "", "", "", "", ""])
            continue
        s, w = r["window_s"], r["per_window"]
        plain = by.get((r["n"], "plain"))
        ratio = (w["grad_bytes"] / plain["per_window"]["grad_bytes"]) if plain and plain.get("runs") else None
        rows.append([r["n"], r["method"],
                     f"{1e3 * s['median']:.1f} [{1e3 * s['q1']:.1f}, {1e3 * s['q3']:.1f}]",
                     f"{1e3 * s['median'] / r['n']:.1f}",
                     fmt_mib(w["grad_bytes"], 2), w["grad_launches"], fmt_mib(w["all_bytes"], 2),
                     "n/a" if ratio is None else f"1/{1 / ratio:.0f}" if ratio < 1 else f"{ratio:.2f}"])
    return format_table(headers, rows, markdown=markdown)


def markdown(data: dict) -> str:
    st = data["settings"]
    params = next((r["param_count"] for r in data["rows"] if r.get("param_count")), None)
    lines = [
        f"MultiWorkerMirroredStrategy, {WORKERS} worker processes on 127.0.0.1 (one CPU device each), "
        f"MLP {st['in_dim']}-{'-'.join([str(st['hidden'])] * st['layers'])}-{st['out_dim']} "
        f"({params:,} parameters, float32), Adam, custom loop, global micro-batch {st['batch']} "
        f"({st['batch'] // WORKERS} per worker), {st['rounds']} interleaved rounds; "
        f"`{data['command']}` in {data['wall_seconds']:.0f} s.",
        "",
        table(data, markdown=True),
        "",
        "`grad all-reduce`: the collectives executed while an optimizer all-reduces gradients, counted per "
        "window by `tests/support/collectives.py`; `all collectives` adds everything else (none here: the "
        "input is a fixed distributed batch). The eager rows are `strategy.run` without `tf.function` "
        "(where Keras' built-in runs): compare them with each other.",
    ]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"plain": ("tab:gray", "o"), "accum": ("tab:blue", "s"), "accum-eager": ("tab:cyan", "s"),
              "builtin-eager": ("tab:orange", "^")}
    for method, (color, marker) in styles.items():
        rows = [r for r in data["rows"] if r["method"] == method and r.get("runs")]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        med = [1e3 * r["window_s"]["median"] for r in rows]
        err = [[1e3 * (r["window_s"]["median"] - r["window_s"]["q1"]) for r in rows],
               [1e3 * (r["window_s"]["q3"] - r["window_s"]["median"]) for r in rows]]
        ax_t.errorbar(ns, med, yerr=err, color=color, marker=marker, capsize=3, label=method)
        ax_b.plot(ns, [r["per_window"]["grad_bytes"] / MIB for r in rows], color=color, marker=marker,
                  label=method)
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["settings"]["ns"])
        ax.set_xticklabels([str(n) for n in data["settings"]["ns"]])
        ax.set_xlabel("N (micro-steps per window)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per window, ms (median, IQR)")
    ax_t.set_title("time per window")
    ax_b.set_yscale("log")
    ax_b.set_ylabel("gradient bytes all-reduced per window, MiB")
    ax_b.set_title("all-reduce traffic per window (counted)")
    fig.suptitle(f"MultiWorkerMirroredStrategy, {WORKERS} workers on loopback")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--n", type=parse_int_list, help="comma list of accumulation steps N")
    parser.add_argument("--rounds", type=int, help="interleaved timed rounds")
    parser.add_argument("--batch", type=int, help="global micro-batch B (even)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: run as a worker
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker.read_text()), Path(args.out))
        return 0
    p = dict(PROFILES[args.profile])
    if args.n:
        p["ns"] = tuple(args.n)
    if args.rounds:
        p["rounds"] = args.rounds
    if args.batch:
        p["batch"] = args.batch
    command = " ".join([".venv/bin/python", "-m", "benchmarks.distributed",
                        *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    env = static_env()
    prog = Progress("distributed", 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(p)
    data = {"benchmark": "distributed", "profile": args.profile, "command": command, "env": env,
            "settings": {**p, "workers": WORKERS, "inner_optimizer": "adam"}, **result,
            "wall_seconds": time.perf_counter() - t0}
    data["problems"] = checks(data)
    prog.step("two workers", f"{data['wall_seconds']:.0f} s")
    print_and_write(out, "distributed", data, table(data), markdown(data), plot, prog)
    for problem in data["problems"]:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if data["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
