"""Where a micro-step's time goes: AccumulatingOptimizer against Keras' built-in, op by op.

For one model (``transformer_wide``: 5.3M parameters, micro-batch 2, N = 4,
Adam) in a ``tf.function`` custom loop, with ``jit_compile`` off and on, it
builds both optimizers' train steps and reports:

* **Build and trace**: seconds to trace the step (``get_concrete_function``,
  the optimizer's variables created on the way) and to run it the first time
  (graph optimisation and the first execution), and the traced graph's size:
  its ops at the top level and inside its functions (the ``cond`` branches),
  and how many functions.
* **Time per micro-step, by kind**: an accumulate-only micro-step (the first
  N - 1 of a window) and an update (the last), each timed on its own
  (``.numpy()`` after each), over ``--rounds`` interleaved rounds of one
  window of each optimizer; accum/built-in per round, median [95% CI:
  percentile bootstrap of the median, 10,000 resamples, seed 0].
* **Op by op** (``jit_compile`` off): per op type, how many ops a
  micro-step of each kind runs, read from the traced graph (the ops outside
  the ``cond`` that picks update steps, plus its false or true branch), and
  their summed run time from TensorFlow's profiler
  (``tf.profiler.experimental``) around ``--traced`` single micro-steps of
  each kind (milliseconds, summed over the executor's threads,
  so it can exceed the wall time; the profiler's own overhead included alike
  in both). With XLA the step is one compiled cluster and the profiler sees
  no TensorFlow ops on a CPU: only its wall time is reported.

    python -m benchmarks.step_profile            # quick profile (what `make bench` runs)
    python -m benchmarks.step_profile --tiny     # seconds: the smoke test
    python -m benchmarks.step_profile --full     # more rounds and traces
    python -m benchmarks.step_profile --self-check   # the harness's own bias

``--self-check`` runs Keras' built-in in both slots (the ``accum`` columns
are a second instance of it, built and traced the same way): every ratio
should be 1 within its interval; one that is not is the harness's bias (the
order of building, of timing within a round), which the real comparison
would carry too.

Writes ``<out>/step_profile.json``, ``.md`` and ``.png``;
``docs/performance.md`` explains the table.
"""

from __future__ import annotations

import collections
import glob
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks._devices import configure_gpu, on_device, select_backend  # noqa: E402
from benchmarks._env import static_env, tf_env  # noqa: E402
from benchmarks._models import build_model, make_batch, model_loss  # noqa: E402
from benchmarks._output import Progress, fmt_ratio, format_table, pyplot, save_figure, write_outputs  # noqa: E402
from benchmarks._profiles import MODEL_SIZES, benchmark_parser  # noqa: E402
from benchmarks._stats import summarize_with_ci  # noqa: E402
from benchmarks._training import make_optimizer, make_train_step  # noqa: E402

PROFILES = {
    "tiny": dict(model="transformer_wide", sizes="tiny", batch=1, n=2, rounds=3, traced=1, jit=(False, True)),
    "quick": dict(model="transformer_wide", sizes="quick", batch=2, n=4, rounds=60, traced=4, jit=(False, True)),
    "full": dict(model="transformer_wide", sizes="quick", batch=2, n=4, rounds=120, traced=8, jit=(False, True)),
}
METHODS = ("accum", "builtin")
KINDS = ("accumulate", "update")
CONFIDENCE = 0.95
TOP_OPS = 14


def op_events(logdir: str) -> dict:
    """``{op type: [count, milliseconds]}`` of the TensorFlow ops in the
    profiler trace written to ``logdir``.

    The trace is an ``XSpace`` protobuf (``*.xplane.pb``); its schema ships
    with TensorFlow as ``tensorflow.tsl.profiler.protobuf.xplane_pb2`` (no
    public reader exists without the TensorBoard profile plugin). An op's
    event is named ``<node name>:<op type>``; the executor's own events
    (``ExecutorState::Process``, ``Run``) have no such name and are left out.
    oneDNN's kernels are counted under their graph op (``_MklMatMul`` as
    ``MatMul``); ops the graph optimizer fused (``_UnaryOpsComposition``,
    ``NativeFusedMatMul``) keep their own names.
    Checked with TensorFlow 2.21.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    ops: dict = collections.defaultdict(lambda: [0, 0.0])
    for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                for event in line.events:
                    name = names[event.metadata_id].name
                    if ":" not in name or "::" in name or " " in name or name.startswith("__"):
                        continue
                    kind = name.rsplit(":", 1)[1]
                    # oneDNN's kernels of graph ops (`_MklMatMul` runs a `MatMul`)
                    op = ops[kind[4:] if kind.startswith("_Mkl") else kind]
                    op[0] += 1
                    op[1] += event.duration_ps / 1e9
    return ops


def graph_op_counts(concrete) -> dict:
    """``{"accumulate": {op type: count}, "update": {...}}`` read from the
    traced graph: the ops outside any ``cond`` run on every micro-step; of
    each top-level ``If``, an accumulate-only micro-step runs the false
    branch and an update the true one (for both optimizers the ``cond``
    that picks update steps; a ``cond`` nested in a branch counts both of
    its branches: an upper bound). The ``If`` nodes themselves and the
    function's ``Placeholder``/``NoOp``/``Identity`` plumbing are left out."""
    graph = concrete.graph.as_graph_def()
    functions = {f.signature.name: f for f in graph.library.function}
    plumbing = {"Placeholder", "NoOp", "Identity", "_Arg", "_Retval", "Const"}

    def count(nodes, into, branch):
        for node in nodes:
            if node.op in ("If", "StatelessIf"):
                names = [node.attr[branch].func.name] if branch else [
                    node.attr["then_branch"].func.name, node.attr["else_branch"].func.name]
                for name in names:
                    count(functions[name].node_def, into, None)
            elif node.op not in plumbing:
                into[node.op] = into.get(node.op, 0) + 1

    counts = {}
    for kind, branch in (("accumulate", "else_branch"), ("update", "then_branch")):
        counts[kind] = {}
        count(graph.node, counts[kind], branch)
    return counts


def graph_size(concrete) -> dict:
    graph = concrete.graph.as_graph_def()
    inner = sum(len(f.node_def) for f in graph.library.function)
    return {"top_level_ops": len(graph.node), "ops_in_functions": inner,
            "all_ops": len(graph.node) + inner, "functions": len(graph.library.function)}


class Step:
    """One optimizer's model, batch and traced custom-loop step."""

    def __init__(self, method: str, p: dict, jit: bool) -> None:
        import gc

        import keras

        keras.backend.clear_session()
        gc.collect()
        kind, size = p["model"], MODEL_SIZES[p["sizes"]][p["model"]]
        t0 = time.perf_counter()
        self.model = build_model(kind, size, seed=0)
        self.x, self.y = on_device(*make_batch(kind, size, p["batch"], seed=1))
        self.opt = make_optimizer(method, p["n"])
        self.step = make_train_step(self.model, self.opt, model_loss(kind), jit_compile=jit)
        t1 = time.perf_counter()
        concrete = self.step.get_concrete_function(self.x, self.y)
        t2 = time.perf_counter()
        self.run()
        t3 = time.perf_counter()
        self.build = {"model_and_optimizer_s": t1 - t0, "trace_s": t2 - t1, "first_call_s": t3 - t2,
                      "build_and_trace_s": t3 - t0, "graph": graph_size(concrete)}
        self.graph_ops = graph_op_counts(concrete)
        self.n = p["n"]
        for _ in range(2 * self.n - 1):  # back to a window's first micro-step, warm
            self.run()

    def run(self) -> float:
        t0 = time.perf_counter()
        self.step(self.x, self.y).numpy()
        return time.perf_counter() - t0

    def window(self) -> list:
        """One window, each micro-step timed on its own."""
        return [self.run() for _ in range(self.n)]

    def profiled_window(self) -> dict:
        """One window, the ops of its first micro-step (accumulate-only) and
        of its last (the update) profiled."""
        import tensorflow as tf

        found = {}
        for position in range(self.n):
            kind = "update" if position == self.n - 1 else "accumulate"
            if kind in found:
                self.run()
                continue
            logdir = tempfile.mkdtemp(prefix="step_profile_")
            try:
                # host_tracer_level=3: every op (level 2 leaves out the
                # inexpensive ones, run inline: most of the counters' ops).
                tf.profiler.experimental.start(
                    logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
                try:
                    self.run()
                finally:
                    tf.profiler.experimental.stop()
                found[kind] = op_events(logdir)
            finally:
                shutil.rmtree(logdir, ignore_errors=True)
        return found


def run_mode(p: dict, jit: bool, prog) -> dict:
    steps = {}
    for method in METHODS:
        steps[method] = Step("builtin" if p.get("self_check") else method, p, jit)
        b = steps[method].build
        prog.step(f"jit={'on' if jit else 'off'} {method}: built and traced",
                  f"trace {b['trace_s']:.1f} s, first call {b['first_call_s']:.1f} s, "
                  f"{b['graph']['all_ops']} ops", seconds=b["build_and_trace_s"])
    times = {m: {k: [] for k in KINDS} for m in METHODS}
    for r in range(p["rounds"]):
        for method in METHODS[r % 2:] + METHODS[: r % 2]:
            window = steps[method].window()
            times[method]["accumulate"].append(sum(window[:-1]) / (len(window) - 1))
            times[method]["update"].append(window[-1])
    prog.step(f"jit={'on' if jit else 'off'}: timed {p['rounds']} interleaved windows of each")
    ratios = {k: summarize_with_ci([a / b for a, b in zip(times["accum"][k], times["builtin"][k])], CONFIDENCE)
              for k in KINDS}
    mean_ratio = summarize_with_ci(
        [((p["n"] - 1) * aa + au) / ((p["n"] - 1) * ba + bu) for aa, au, ba, bu in zip(
            times["accum"]["accumulate"], times["accum"]["update"],
            times["builtin"]["accumulate"], times["builtin"]["update"])], CONFIDENCE)
    ops = {m: {k: collections.defaultdict(lambda: [0.0, 0.0]) for k in KINDS} for m in METHODS}
    if not jit:
        for _ in range(p["traced"]):
            for method in METHODS:
                for kind, found in steps[method].profiled_window().items():
                    for op, (count, ms) in found.items():
                        ops[method][kind][op][0] += count / p["traced"]
                        ops[method][kind][op][1] += ms / p["traced"]
        prog.step(f"jit={'on' if jit else 'off'}: profiled {p['traced']} micro-steps of each kind")
    build = {m: steps[m].build for m in METHODS}
    graph_ops = {m: steps[m].graph_ops for m in METHODS}
    param_count = sum(math.prod(v.shape) for v in steps["accum"].model.trainable_variables)
    del steps
    return {"jit_compile": jit, "param_count": param_count, "build": build, "graph_ops": graph_ops,
            "times_s": times, "accum_over_builtin": ratios, "accum_over_builtin_per_window": mean_ratio,
            "ops": {m: {k: {op: {"count": c, "ms": ms} for op, (c, ms) in ops[m][k].items()} for k in KINDS}
                    for m in METHODS}}


def _ms(values: list) -> str:
    return f"{1e3 * sorted(values)[len(values) // 2]:.2f}"


def table(data: dict) -> str:
    s = data["settings"]
    lines = [f"{s['model']} ({data['param_count']:,} params), micro-batch {s['batch']}, N = {s['n']}, Adam, "
             f"custom loop (`tf.function`); {s['rounds']} interleaved rounds of one window of each optimizer.", ""]
    if s.get("self_check"):
        lines += ["**Self-check** (`--self-check`): both slots run Keras' built-in; the `accum` columns are a "
                  "second instance of it. Every ratio should be 1 within its interval.", ""]
    headers = ["jit", "micro-step", "accum ms", "built-in ms", "accum/built-in [95% CI]"]
    rows = []
    for g in data["groups"]:
        jit = "on" if g["jit_compile"] else "off"
        for kind in KINDS:
            r = g["accum_over_builtin"][kind]
            rows.append([jit, f"{kind}{' (each of N-1)' if kind == 'accumulate' else ''}",
                         _ms(g["times_s"]["accum"][kind]), _ms(g["times_s"]["builtin"][kind]),
                         fmt_ratio(r["median"], r["ci_low"], r["ci_high"])])
        w = g["accum_over_builtin_per_window"]
        rows.append([jit, "whole window (mean)", "", "", fmt_ratio(w["median"], w["ci_low"], w["ci_high"])])
    lines += ["**Time per micro-step** (median over rounds; ratios within each round)", "",
              format_table(headers, rows, True), ""]
    headers = ["jit", "optimizer", "trace s", "first call s", "build + trace s", "graph ops (top level + in functions)",
               "functions"]
    rows = []
    for g in data["groups"]:
        for m in METHODS:
            b = g["build"][m]
            rows.append(["on" if g["jit_compile"] else "off", "accum" if m == "accum" else "built-in",
                         f"{b['trace_s']:.1f}", f"{b['first_call_s']:.1f}", f"{b['build_and_trace_s']:.1f}",
                         f"{b['graph']['all_ops']:,} ({b['graph']['top_level_ops']:,} + "
                         f"{b['graph']['ops_in_functions']:,})", b["graph"]["functions"]])
    lines += ["**Build and trace** (one run each; the first call includes graph optimisation)", "",
              format_table(headers, rows, True), ""]
    for g in data["groups"]:
        if g["jit_compile"]:
            continue
        for kind in KINDS:
            a, b = g["ops"]["accum"][kind], g["ops"]["builtin"][kind]
            ga, gb = g["graph_ops"]["accum"][kind], g["graph_ops"]["builtin"][kind]
            names = sorted(set(a) | set(b) | set(ga) | set(gb),
                           key=lambda op: (-max(a.get(op, {}).get("ms", 0), b.get(op, {}).get("ms", 0)),
                                           -abs(ga.get(op, 0) - gb.get(op, 0))))
            headers = ["op", "accum count", "accum ms", "built-in count", "built-in ms", "accum - built-in ms"]
            rows = []

            def cells(d, op, counts=None):
                e = d.get(op, {"count": 0, "ms": 0.0})
                return (counts or {}).get(op, 0), e["ms"]

            for op in names[:TOP_OPS]:
                (ac, am), (bc, bm) = cells(a, op, ga), cells(b, op, gb)
                rows.append([op, f"{ac:.0f}", f"{am:.2f}", f"{bc:.0f}", f"{bm:.2f}", f"{am - bm:+.2f}"])
            rest = names[TOP_OPS:]
            if rest:
                ac, am = sum(cells(a, op, ga)[0] for op in rest), sum(cells(a, op)[1] for op in rest)
                bc, bm = sum(cells(b, op, gb)[0] for op in rest), sum(cells(b, op)[1] for op in rest)
                rows.append([f"{len(rest)} other op types", f"{ac:.0f}", f"{am:.2f}", f"{bc:.0f}", f"{bm:.2f}",
                             f"{am - bm:+.2f}"])
            ac, am = sum(ga.values()), sum(e["ms"] for e in a.values())
            bc, bm = sum(gb.values()), sum(e["ms"] for e in b.values())
            rows.append(["**all ops**", f"{ac:.0f}", f"{am:.2f}", f"{bc:.0f}", f"{bm:.2f}", f"{am - bm:+.2f}"])
            lines += [f"**Ops of one {kind} micro-step** (jit off; count: ops of that kind of micro-step in the "
                      "traced graph, before TensorFlow's graph optimizer; ms: TensorFlow's profiler, mean over "
                      f"{s['traced']} traced micro-steps, summed over the executor's threads)", "",
                      format_table(headers, rows, True), ""]
    lines.append(f"Produced by `{command(data)}`; explained in docs/performance.md.")
    return "\n".join(lines)


def command(data: dict) -> str:
    """The command line that gives ``data`` again: its profile, and the
    options that changed the profile's settings."""
    s, default = data["settings"], PROFILES[data["profile"]]
    words = [".venv/bin/python -m benchmarks.step_profile"]
    words += [] if data["profile"] == "quick" else [f"--{data['profile']}"]
    words += [f"--{key} {s[key]}" for key in ("rounds", "traced") if s[key] != default[key]]
    words += ["--self-check"] if s.get("self_check") else []
    return " ".join(words)


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(KINDS), figsize=(12, 4.5), squeeze=False)
    group = next((g for g in data["groups"] if not g["jit_compile"]), data["groups"][0])
    for ax, kind in zip(axes[0], KINDS):
        a, b = group["ops"]["accum"][kind], group["ops"]["builtin"][kind]
        names = sorted(set(a) | set(b), key=lambda op: -max(a.get(op, {}).get("ms", 0), b.get(op, {}).get("ms", 0)))
        names = names[:TOP_OPS]
        y = range(len(names))
        ax.barh([i + 0.2 for i in y], [a.get(op, {}).get("ms", 0) for op in names], 0.4, label="accum")
        ax.barh([i - 0.2 for i in y], [b.get(op, {}).get("ms", 0) for op in names], 0.4, label="built-in")
        ax.set_yticks(list(y))
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per micro-step (summed over threads)")
        ax.set_title(f"{kind} micro-step, jit {'on' if group['jit_compile'] else 'off'}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['settings']['model']}: time by op type, AccumulatingOptimizer vs Keras' built-in")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (windows of each optimizer)")
    parser.add_argument("--traced", type=int, help="profiled micro-steps of each kind")
    parser.add_argument("--self-check", action="store_true",
                        help="Keras' built-in in both slots: the harness's own bias (every ratio should be 1)")
    args = parser.parse_args(argv)
    select_backend(parser, "tensorflow")
    p = dict(PROFILES[args.profile])
    for key in ("rounds", "traced"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                parser.error(f"--{key}={value}: expected an int >= 1")
            p[key] = value
    p["self_check"] = args.self_check
    t_start = time.perf_counter()
    env = static_env()
    configure_gpu()
    env.update(tf_env())
    prog = Progress("step_profile", len(p["jit"]) * (len(METHODS) + 2))
    groups = [run_mode(p, jit, prog) for jit in p["jit"]]
    data = {"benchmark": "step_profile", "profile": args.profile, "env": env, "settings": p,
            "param_count": groups[0]["param_count"], "groups": groups, "wall_seconds": time.perf_counter() - t_start}
    md = table(data)
    print()
    print(md)
    write_outputs(args.out, "step_profile", data, md, plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
