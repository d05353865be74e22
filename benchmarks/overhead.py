"""Time per micro-step: plain optimizer vs AccumulatingOptimizer vs Keras' built-in.

For each model (the small ResNet-style CNN and Transformer encoder of
``benchmarks.memory``, and ``transformer_wide``, a 5.3M-parameter encoder on
32 tokens where one more pass over the parameters is a measurable part of a
step) at micro-batch B, and each way of running a step (``model.fit`` and a
``tf.function`` custom loop, with ``jit_compile`` off and on), it builds
every configuration first (its own model and optimizer, traced and warmed up):

  * plain Adam,
  * ``AccumulatingOptimizer(Adam, N)`` for each N,
  * Keras' built-in ``Adam(gradient_accumulation_steps=N)`` for each N >= 2
    (N=1 is rejected by Keras: "n/a"),

then, after one untimed round, runs them interleaved: in each of
``--rounds`` rounds (60 in the quick profile, 50 in the full one), a block of
``--block`` micro-steps of every configuration in turn (the order rotates
from round to round). The block is a multiple of every N, so each block
holds whole accumulation windows and its mean time per micro-step includes
the update steps' share (a per-step median would hide the one-in-N update).

The ratios accum/plain and accum/built-in are taken within each round, side
by side, so that a slow round (another process on the machine) slows every
configuration of it alike. Each is reported as the median over the rounds
with a 95% percentile-bootstrap confidence interval of that median (10,000
resamples of the rounds, numpy, seed 0: ``benchmarks._stats.bootstrap_median_ci``);
quartiles, min and max are in the JSON. A "<= 3% overhead" claim holds for a
configuration only where the interval's upper bound is <= 1.03 (the table's
last column).

The floor for the accumulation overhead is one more pass over the parameters
per micro-step (read the gradient, read the accumulator, write it: 12 bytes
per float32 parameter) at the copy bandwidth measured here (``assign_add`` on
a 64 MiB tensor, best of 10). It is printed next to the measured overhead
(accum - plain per round: median and 95% interval) and their ratio. With
N >= 2 the accumulating step also skips the inner optimizer's update on
N - 1 of N micro-steps, which plain training pays every step, so accum/plain
can be below 1 (Keras' built-in skips it too: accum/built-in compares like
with like). N=1 is the library's pass-through: floor 0.

The quick profile (what ``make bench`` runs) times N=4 in the two default
ways of running a step (a custom loop's ``tf.function``, ``jit_compile``
off; ``model.fit``, whose ``jit_compile="auto"`` is XLA on), and
``transformer_wide`` in the custom loop with XLA off and on; ``--full`` times the whole grid (N = 1, 4, 16; all four ways;
all three models; 50 rounds).

    python -m benchmarks.overhead            # quick profile (default)
    python -m benchmarks.overhead --full     # the whole grid, more rounds
    python -m benchmarks.overhead --tiny     # seconds; what the smoke test runs
    python -m benchmarks.overhead --backend jax   # Keras 3 on JAX (a venv with jax: .venvs/k3-jax)

``--backend jax|torch`` (default: ``KERAS_BACKEND``, else tensorflow) times
the same three optimizers on that Keras backend in ``model.fit`` only (JAX:
its default ``jit_compile``, XLA; torch: eager), with NumPy batches, and the
floor's copy bandwidth from a ``jax.jit`` add or a torch ``add_``. On JAX,
Keras' built-in computes the inner update on every micro-step and keeps the
old values on N - 1 of N; the wrapper computes it on updates only
(``docs/families/backends.md``): accum/built-in shows what that saves.

Writes ``<out>/overhead.json``, ``<out>/overhead.md`` and ``<out>/overhead.png``
(``overhead_jax.*``, ``overhead_torch.*`` for the other backends).
"""

from __future__ import annotations

import gc
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks._devices import configure_gpu, on_device, select_backend  # noqa: E402
from benchmarks._env import backend_env, static_env, tf_env  # noqa: E402
from benchmarks._models import build_model, make_batch, model_loss  # noqa: E402
from benchmarks._output import MIB, Progress, fmt_ratio, format_table, pyplot, save_figure, write_outputs  # noqa: E402
from benchmarks._profiles import (  # noqa: E402
    MODEL_SIZES, add_backend_arg, apply_model_args, benchmark_parser, parse_str_list)
from benchmarks._stats import summarize, summarize_with_ci  # noqa: E402
from benchmarks._training import NotApplicable, copy_bandwidth, make_optimizer, make_train_step  # noqa: E402

ALL_MODES = (("custom", False), ("custom", True), ("fit", False), ("fit", True))
# The defaults of each loop: a custom loop's tf.function compiles without XLA;
# Keras' fit() uses jit_compile="auto", which is XLA on for these models.
DEFAULT_MODES = (("custom", False), ("fit", True))
MODELS = ("cnn", "transformer", "transformer_wide")
PROFILES = {
    # tiny: every code path (both loops, XLA on and off, N=1 "n/a", the wide
    # model's floor ratio) in seconds.
    "tiny": dict(models=("cnn", "transformer_wide"), batch={"cnn": 2, "transformer": 1, "transformer_wide": 1},
                 ns=(1, 2), modes=(("custom", True), ("fit", False)),
                 model_modes={"transformer_wide": (("custom", False),)}, rounds=3, block=2, bandwidth_mib=16),
    # quick: the 5M-parameter transformer_wide in the custom loop, XLA off
    # and on (about 2 minutes on 2 cores).
    "quick": dict(models=("cnn", "transformer", "transformer_wide"),
                  batch={"cnn": 16, "transformer": 4, "transformer_wide": 2}, ns=(4,),
                  modes=DEFAULT_MODES, model_modes={"transformer_wide": (("custom", False), ("custom", True))},
                  rounds=60, block=4, bandwidth_mib=64),
    "full": dict(models=MODELS, batch={"cnn": 32, "transformer": 8, "transformer_wide": 4}, ns=(1, 4, 16),
                 modes=ALL_MODES, model_modes={}, rounds=50, block=16, bandwidth_mib=256),
}
CONFIDENCE = 0.95
CLAIM = 1.03  # "<= 3% overhead" needs the interval's upper bound <= this


def _make_timer():
    """A Keras callback timing ``fit`` from the first batch's begin to the
    last batch's end. (Overriding ``on_train_batch_end`` makes Keras call it
    synchronously, so the time covers the steps themselves.)"""
    import keras

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.t1 = time.perf_counter()

        def reset(self):
            self.t0 = self.t1 = None

    timer = Timer()
    timer.reset()
    return timer


class Config:
    """One (model, optimizer) pair with a way to run a block of micro-steps."""

    def __init__(self, kind, size, batch, method, n, loop, jit, backend="tensorflow"):
        self.kind, self.method, self.n, self.loop, self.jit = kind, method, n, loop, jit
        self.backend = backend
        self.label = "plain" if method == "plain" else f"{method} N={n}"
        self.model = build_model(kind, size, seed=0)
        x, y = make_batch(kind, size, batch, seed=1)
        self.opt = make_optimizer(method, n)  # may raise NotApplicable
        loss = model_loss(kind)
        if loop == "custom":
            self.x, self.y = on_device(x, y)
            self.step = make_train_step(self.model, self.opt, loss, jit_compile=jit)
        elif backend != "tensorflow":  # fit on NumPy batches, repeated
            self.model.compile(optimizer=self.opt, loss=loss, jit_compile=jit)
            self.batch, self.xy = batch, (x, y)
            self.timer = _make_timer()
        else:
            import tensorflow as tf

            self.model.compile(optimizer=self.opt, loss=loss, jit_compile=jit)
            self.ds = tf.data.Dataset.from_tensors((x, y)).repeat()
            self.timer = _make_timer()

    def run(self, steps: int) -> float:
        """Run ``steps`` micro-steps; returns seconds per micro-step."""
        if self.loop == "custom":
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = self.step(self.x, self.y)
            loss.numpy()  # wait for the last step
            return (time.perf_counter() - t0) / steps
        self.timer.reset()
        if self.backend != "tensorflow":
            import numpy as np

            x, y = (np.concatenate([a] * steps) for a in self.xy)
            self.model.fit(x, y, batch_size=self.batch, epochs=1, verbose=0, shuffle=False, callbacks=[self.timer])
        else:
            self.model.fit(self.ds, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                           callbacks=[self.timer])
        return (self.timer.t1 - self.timer.t0) / steps

    def micro_steps_taken(self) -> int:
        from accum_optimizer import AccumulatingOptimizer

        from keras import ops

        if isinstance(self.opt, AccumulatingOptimizer):
            return int(ops.convert_to_numpy(self.opt.micro_steps))
        # Keras' `iterations` counts updates when it accumulates; `_iterations` counts steps.
        return int(ops.convert_to_numpy(self.opt._iterations))


def run_group(kind, size, batch, loop, jit, p, prog, backend="tensorflow") -> dict:
    """Build, warm up and time all configurations of one (model, loop, jit)."""
    import keras

    keras.backend.clear_session()
    gc.collect()
    block = p["block"]
    specs = [("plain", 1)] + [("accum", n) for n in p["ns"]] + [("builtin", n) for n in p["ns"]]
    configs, na, errors, build_s = [], {}, {}, {}
    tag = f"{kind} {loop} jit={'on' if jit else 'off'}"
    for method, n in specs:
        label = "plain" if method == "plain" else f"{method} N={n}"
        t0 = time.perf_counter()
        try:
            c = Config(kind, size, batch, method, n, loop, jit, backend)
            c.run(1)  # trace / compile
            configs.append(c)
            build_s[label] = time.perf_counter() - t0
            prog.step(f"{tag} {label}: built and traced", seconds=time.perf_counter() - t0)
        except NotApplicable as e:
            na[label] = str(e)
            prog.step(f"{tag} {label}", f"n/a ({e})")
        except Exception as e:  # Keras' built-in fails in some setups: report, don't stop
            errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            prog.step(f"{tag} {label}", f"n/a (error: {errors[label]})")
    times = {c.label: [] for c in configs}
    t0 = time.perf_counter()
    # Warm-up round, after *all* configurations are built: a function's first
    # call after other functions were traced is slow once (~0.1 s on a CPU),
    # and the block runs the update branch too.
    for c in configs:
        c.run(block)
    for r in range(p["rounds"]):
        k = r % max(len(configs), 1)
        for c in configs[k:] + configs[:k]:
            times[c.label].append(c.run(block))
    prog.step(f"{tag}: timed {p['rounds']} rounds x {block} micro-steps x {len(configs)} configs",
              seconds=time.perf_counter() - t0)

    def ratios(num: str, den: str):
        if num not in times or den not in times:
            return None
        rs = [a / b for a, b in zip(times[num], times[den])]
        return summarize_with_ci(rs, CONFIDENCE)

    def differences(num: str, den: str):
        if num not in times or den not in times:
            return None
        return summarize_with_ci([a - b for a, b in zip(times[num], times[den])], CONFIDENCE)

    rows = []
    for n in p["ns"]:
        acc, bi = f"accum N={n}", f"builtin N={n}"
        rows.append({
            "n": n,
            "plain_s": summarize(times["plain"]) if "plain" in times else None,
            "accum_s": summarize(times[acc]) if acc in times else None,
            "builtin_s": summarize(times[bi]) if bi in times else None,
            "builtin_na": na.get(bi) or errors.get(bi),
            "accum_over_plain": ratios(acc, "plain"),
            "accum_over_builtin": ratios(acc, bi),
            "builtin_over_plain": ratios(bi, "plain"),
            "accum_minus_plain_s": differences(acc, "plain"),
        })
        r = rows[-1]
        prog.note(f"{tag} N={n}: accum/plain {_ratio(r['accum_over_plain'])}, "
                  f"accum/built-in {_ratio(r['accum_over_builtin'])} (median [95% CI] over {p['rounds']} rounds)")
    result = {"model": kind, "loop": loop, "jit_compile": jit, "micro_batch": batch,
              "block_micro_steps": block, "rounds": p["rounds"],
              "times_s_per_micro_step": times, "not_applicable": na, "errors": errors,
              "build_and_trace_s": build_s,
              "micro_steps_taken": {c.label: c.micro_steps_taken() for c in configs},
              "rows": rows}
    param_count = sum(math.prod(v.shape) for v in configs[0].model.trainable_variables) if configs else None
    del configs
    gc.collect()
    return {"result": result, "param_count": param_count}


def _ms(s: dict | None) -> str:
    return "n/a" if s is None else f"{1e3 * s['median']:.2f}"


def _ratio(s: dict | None) -> str:
    return "n/a" if s is None else fmt_ratio(s["median"], s["ci_low"], s["ci_high"])


def _claim(s: dict | None) -> str:
    """Whether "<= 3% overhead" is shown: the interval's upper bound <= 1.03."""
    if s is None:
        return "n/a"
    return "yes" if s["ci_high"] <= CLAIM else "no"


def _build_seconds(group: dict, n: int) -> str:
    b = group["build_and_trace_s"]
    return " / ".join("n/a" if b.get(k) is None else f"{b[k]:.1f}" for k in ("plain", f"accum N={n}", f"builtin N={n}"))


def _build_ratio(group: dict, n: int) -> str:
    b = group["build_and_trace_s"]
    accum, builtin = b.get(f"accum N={n}"), b.get(f"builtin N={n}")
    return "n/a" if accum is None or builtin is None else f"{accum / builtin:.2f}"


def table(data: dict, markdown: bool = False) -> str:
    bw = data["bandwidth"]["bytes_per_second"]
    conf = f"{100 * CONFIDENCE:.0f}% CI"
    headers = ["model", "loop", "jit", "N", "plain ms", "accum ms", "built-in ms",
               f"accum/plain [{conf}]", f"accum/built-in [{conf}]", f"overhead ms [{conf}]", "floor ms",
               "overhead/floor", f"accum/plain <= {CLAIM:g} shown", "build + trace s: plain / accum / built-in",
               "accum/built-in build + trace"]
    rows = []
    for g in data["groups"]:
        floor_s = data["models"][g["model"]]["floor_seconds"]
        for row in g["rows"]:
            d = row.get("accum_minus_plain_s")
            over = "n/a" if d is None else (f"{1e3 * d['median']:+.2f} [{1e3 * d['ci_low']:+.2f}, "
                                            f"{1e3 * d['ci_high']:+.2f}]")
            fl = 0.0 if row["n"] == 1 else floor_s
            ratio = "n/a" if d is None or not fl else f"{d['median'] / fl:+.1f}"
            rows.append([g["model"], g["loop"], "on" if g["jit_compile"] else "off", row["n"],
                         _ms(row["plain_s"]), _ms(row["accum_s"]),
                         _ms(row["builtin_s"]) if row["builtin_s"] else "n/a",
                         _ratio(row["accum_over_plain"]), _ratio(row["accum_over_builtin"]),
                         over, "0" if row["n"] == 1 else f"{1e3 * floor_s:.3f}", ratio,
                         _claim(row["accum_over_plain"]), _build_seconds(g, row["n"]),
                         _build_ratio(g, row["n"])])
    lines = [format_table(headers, rows, markdown)]
    lines.append("")
    s = data["settings"]
    lines.append(f"Time per micro-step: median over {s['rounds']} interleaved rounds of the mean over a block "
                 f"of {s['block']} micro-steps (whole windows). Ratios and the overhead (accum - plain) are "
                 f"taken within each round, side by side: median over the rounds [{conf}: percentile "
                 "bootstrap of the median, 10,000 resamples of the rounds, seed 0]; quartiles, min and max are "
                 "in the JSON. 'floor' = one more pass over the parameters per micro-step (read gradient, "
                 "read and write accumulator) at the measured copy bandwidth; N=1 is the pass-through (floor "
                 f"0). '<= {CLAIM:g} shown': the interval's upper bound for accum/plain is <= {CLAIM:g}. With "
                 "N >= 2 the accumulating step skips the inner optimizer's update on N-1 of N micro-steps, "
                 "which plain training pays every step: accum/built-in compares like with like. 'build + "
                 "trace': seconds from building the model and optimizer to the end of the first step (trace, "
                 "graph optimisation or XLA compilation, first run), one run of each, side by side.")
    if markdown:
        lines.append("")
    for kind, m in data["models"].items():
        plain = [r["plain_s"]["median"] for g in data["groups"] if g["model"] == kind
                 for r in g["rows"] if r["plain_s"]]
        frac = (f", {100 * m['floor_seconds'] / min(plain):.2f}% of the fastest plain step "
                f"({1e3 * min(plain):.2f} ms)") if plain else ""
        lines.append(f"floor ({kind}, micro-batch {m['micro_batch']}): 3 x 4 B x {m['param_count']:,} params = "
                     f"{m['floor_bytes'] / MIB:.2f} MiB per micro-step at {bw / 1e9:.1f} GB/s "
                     f"(measured assign_add) = {1e3 * m['floor_seconds']:.3f} ms{frac}" + ("  " if markdown else ""))
    return "\n".join(lines)


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    models = list(data["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], models):
        groups = [g for g in data["groups"] if g["model"] == kind]
        labels, pos, seen = [], 0, set()
        for g in groups:
            mode = f"{g['loop']}\njit {'on' if g['jit_compile'] else 'off'}"
            for i, row in enumerate(g["rows"]):
                for j, (key, color, name) in enumerate((("accum_over_plain", "tab:blue", "accum / plain"),
                                                        ("accum_over_builtin", "tab:orange",
                                                         "accum / built-in"))):
                    s = row[key]
                    if s is None:
                        continue
                    x = pos + i + (j - 0.5) * 0.35
                    ax.errorbar([x], [s["median"]],
                                yerr=[[s["median"] - s["ci_low"]], [s["ci_high"] - s["median"]]],
                                fmt="o", color=color, capsize=3, label=None if name in seen else name)
                    seen.add(name)
                labels.append((pos + i, f"N={row['n']}\n{mode}"))
            pos += len(g["rows"]) + 1
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.03, color="tab:red", lw=0.8, ls="--", label="+3% target")
        ax.set_xticks([p for p, _ in labels])
        ax.set_xticklabels([t for _, t in labels], fontsize=7)
        ax.set_ylabel("time per micro-step ratio (median, 95% CI over rounds)")
        ax.set_title(f"{kind} ({data['models'][kind]['param_count']:,} params), "
                     f"micro-batch {data['models'][kind]['micro_batch']}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("AccumulatingOptimizer micro-step time relative to plain and to Keras' built-in")
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, models=True)
    parser.add_argument("--modes", type=parse_str_list,
                        help="comma list of custom-jit-off,custom-jit-on,fit-jit-off,fit-jit-on")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--block", type=int, help="micro-steps per block (rounded up to a multiple of every N)")
    add_backend_arg(parser, "; jax and torch: fit only")
    args = parser.parse_args(argv)
    select_backend(parser, args.backend)

    p = apply_model_args(parser, args, dict(PROFILES[args.profile]))
    for key in ("rounds", "block"):
        if getattr(args, key):
            p[key] = getattr(args, key)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: expected an int >= 1")
    if args.modes:
        valid = ("custom-jit-off", "custom-jit-on", "fit-jit-off", "fit-jit-on")
        bad = [m for m in args.modes if m not in valid]
        if bad:
            parser.error(f"--modes: unknown mode(s) {bad}; choose from {list(valid)}")
        p["modes"] = tuple((m.split("-")[0], m.endswith("-on")) for m in args.modes)
        p["model_modes"] = {}  # an explicit --modes applies to every model
    if args.backend != "tensorflow":
        # fit only (a custom loop is a tf.function here), in the backend's
        # default way: XLA on JAX, eager on torch.
        if args.modes and any(loop != "fit" for loop, _ in p["modes"]):
            parser.error(f"--modes: --backend {args.backend} times fit only (fit-jit-on on jax, fit-jit-off on torch)")
        p["modes"], p["model_modes"] = (("fit", args.backend == "jax"),), {}
    lcm = 1
    for n in p["ns"]:
        lcm = lcm * n // math.gcd(lcm, n)
    p["block"] = -(-p["block"] // lcm) * lcm

    t_start = time.perf_counter()
    env = static_env()
    if args.backend == "tensorflow":
        configure_gpu()
        env.update(tf_env())
    else:
        env.update(backend_env(args.backend))
    modes_of = lambda kind: p["model_modes"].get(kind, p["modes"])  # noqa: E731
    n_groups = sum(len(modes_of(kind)) for kind in p["models"])
    per_group = 1 + 2 * len(p["ns"]) + 1
    prog = Progress("overhead", n_groups * per_group + 1)
    bw = copy_bandwidth(p["bandwidth_mib"], backend=args.backend)
    prog.step("copy bandwidth (a += b, %d MiB)" % p["bandwidth_mib"], f"{bw['bytes_per_second'] / 1e9:.2f} GB/s")
    groups, models = [], {}
    for kind in p["models"]:
        size = MODEL_SIZES[args.profile][kind]
        for loop, jit in modes_of(kind):
            g = run_group(kind, size, p["batch"][kind], loop, jit, p, prog, args.backend)
            groups.append(g["result"])
            if kind not in models and g["param_count"]:
                floor_bytes = 3 * 4 * g["param_count"]
                models[kind] = {"size": size, "micro_batch": p["batch"][kind], "param_count": g["param_count"],
                                "floor_bytes": floor_bytes,
                                "floor_seconds": floor_bytes / bw["bytes_per_second"]}
    data = {"benchmark": "overhead", "profile": args.profile, "backend": args.backend, "env": env,
            "settings": {**p, "inner_optimizer": "adam"}, "bandwidth": bw, "models": models,
            "groups": groups, "wall_seconds": time.perf_counter() - t_start}
    # Floor as a fraction of the plain step, per group and N.
    for g in groups:
        fs = models[g["model"]]["floor_seconds"]
        for row in g["rows"]:
            row["floor_seconds"] = 0.0 if row["n"] == 1 else fs
            row["floor_over_plain"] = (row["floor_seconds"] / row["plain_s"]["median"]) if row["plain_s"] else None
            d = row.get("accum_minus_plain_s")
            row["overhead_over_floor"] = d["median"] / row["floor_seconds"] if d and row["floor_seconds"] else None
            r = row["accum_over_plain"]
            row["within_3_percent_shown"] = None if r is None else r["ci_high"] <= CLAIM
    print()
    print(table(data))
    md = table(data, markdown=True)
    if args.profile == "quick":
        md += ("\n\nQuick profile: N = 4, each loop's default way (custom loop XLA off, fit XLA on). N = 1 "
               "(the pass-through) and 16, XLA on and off in both loops, 50 rounds: "
               "`.venv/bin/python -m benchmarks.overhead --full`.")
    name = "overhead" if args.backend == "tensorflow" else f"overhead_{args.backend}"
    write_outputs(args.out, name, data, md, plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
