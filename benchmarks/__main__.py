"""Run the memory, step-overhead, sparse and step-profile benchmarks in one go.

    python -m benchmarks                  # quick profile of all four (what `make bench` runs)
    python -m benchmarks --full           # the bigger sweeps
    python -m benchmarks --tiny           # seconds; what the smoke test runs
    python -m benchmarks --only memory,sparse --out some_dir

Each benchmark prints its table and writes ``<name>.json``, ``<name>.png`` and
``<name>.md`` to the output folder; this entry point also writes
``SUMMARY.md`` (the tables, the plots and the command that produced
them, ready to paste into the README) and ``run_all.json`` (wall times).
The correctness studies (``experiments.compare_builtin``,
``experiments.caveats``, ``experiments.mixed_precision``) are in ``experiments/``.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks._env import load_average, static_env  # noqa: E402
from benchmarks._output import write_json  # noqa: E402
from benchmarks._profiles import benchmark_parser, parse_str_list  # noqa: E402

BENCHMARKS = {
    "memory": "1. Memory: what accumulation saves and what it costs",
    "overhead": "2. Step overhead: time per micro-step, median ratios with 95% confidence intervals",
    "sparse": "3. Sparse gradients: large embedding tables",
    "step_profile": "4. Where a micro-step's time goes: op by op against Keras' built-in",
}


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--only", type=parse_str_list, default=list(BENCHMARKS),
                        help=f"comma list of benchmarks to run (default: {','.join(BENCHMARKS)})")
    args = parser.parse_args(argv)
    unknown = [b for b in args.only if b not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    env = static_env()  # at the start: the load average is the one the runs saw
    timings, failed = {}, []
    for name in args.only:
        print(f"\n=== benchmarks.{name} ({args.profile}) ===", flush=True)
        t = time.perf_counter()
        try:
            rc = importlib.import_module(f"benchmarks.{name}").main([f"--{args.profile}", "--out", str(out)])
        except Exception:  # keep going: report every failure at the end
            traceback.print_exc()
            rc = 1
        timings[name] = time.perf_counter() - t
        if rc:
            failed.append(name)
        print(f"=== benchmarks.{name}: {'FAILED' if rc else 'done'} in {timings[name]:.0f} s ===", flush=True)
    total = time.perf_counter() - t0
    env["load_average_at_end"] = load_average()
    write_json(out / "run_all.json", {"profile": args.profile, "command": command, "seconds": timings,
                                        "total_seconds": total, "failed": failed, "env": env})
    _write_summary(out, args, command, timings, total, env)
    print(f"\nall benchmarks: {total:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}); "
          f"outputs in {out}/ (SUMMARY.md has the tables and plots)")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _write_summary(out: Path, args, command: str, timings: dict, total: float, env: dict) -> None:
    import json

    device = None
    for name in timings:
        j = out / f"{name}.json"
        if j.exists():
            device = device or json.loads(j.read_text()).get("env", {}).get("device")
    lines = [
        f"# accum_optimizer benchmarks ({args.profile} profile)",
        "",
        f"Produced by `{command}` in {total:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}) on {env['date_utc']}: "
        f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, {device or 'CPU'}, "
        f"{env['cpu_model']} x {env['cpus_usable']} CPUs, load average (1, 5, 15 min) at start "
        f"{', '.join(f'{x:.1f}' for x in env['load_average_at_start'] or [])}, at end "
        f"{', '.join(f'{x:.1f}' for x in env['load_average_at_end'] or [])}.",
        "",
    ]
    for name, title in BENCHMARKS.items():
        if name not in timings:
            continue
        md = out / f"{name}.md"
        lines += [f"## {title}", ""]
        if (out / f"{name}.png").exists():
            lines += [f"![{name}]({name}.png)", ""]
        lines += [md.read_text().rstrip() if md.exists() else "(no output: the benchmark failed)", ""]
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
