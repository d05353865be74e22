"""``python -m accum_optimizer.plan BUILD BATCH --target-batch-size T
[--memory-limit 10GiB] [--repeats 3] [--json plan.json] [--plot plan.png]``:
the planner from the command line
(:func:`accum_optimizer.plan.plan_accumulation`, the same arguments). Prints
a line per probe, then the table; writes the JSON and the plot only once the
plan is complete. Exit status 2 for a bad argument, a model that does not
fit or a backend the planner cannot measure (torch without CUDA: refused
before any probe), with the message on stderr."""

from __future__ import annotations

import argparse
import sys

from accum_optimizer.plan import plan_accumulation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m accum_optimizer.plan",
        description="Find the largest micro-batch size B that fits in memory, and the "
                    "gradient_accumulation_steps N that reaches the target effective batch, by measurement "
                    "(TensorFlow: each B trained for three steps in a fresh process; JAX: XLA's memory analysis "
                    "of the compiled train step; torch: CUDA's allocator peak over three steps).",
    )
    parser.add_argument("build", help="importable 'module:function' returning a compiled Keras model")
    parser.add_argument("batch", help="importable 'module:function', B -> one batch (x, y[, sample_weight])")
    parser.add_argument("--target-batch-size", type=int, required=True, help="the effective batch wanted")
    parser.add_argument("--memory-limit", default=None,
                        help="bytes or a size with a unit ('10GiB'); default: the GPU's total memory")
    parser.add_argument("--margin", type=float, default=0.9, help="use at most margin x memory-limit (default 0.9)")
    parser.add_argument("--max-micro-batch-size", type=int, default=None, help="an upper bound for B")
    parser.add_argument("--multiple-of", type=int, default=1, help="B a multiple of this (default 1)")
    parser.add_argument("--replicas", type=int, default=None, help="devices in sync (default: the GPUs seen, >= 1)")
    parser.add_argument("--start", type=int, default=1, help="the first B tried (default 1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="probe each B this many times; it fits when its largest peak plus the spread does "
                             "(default 1)")
    parser.add_argument("--remat", nargs="?", const="all", default=None, metavar="MODE[,MODE]",
                        help="JAX and TensorFlow: also plan under keras.RematScope (every mode of REMAT_MODES, or "
                             "the modes given, comma-separated) and rank the candidates by samples per second at "
                             "the target")
    parser.add_argument("--json", default=None, help="write the plan here")
    parser.add_argument("--plot", default=None, help="plot peak memory against B here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # say so before minutes of probes, not after
            print('error: --plot needs matplotlib: pip install "accum_optimizer[plan]" (from a clone: '
                  "pip install '.[plan]'), or leave --plot out.", file=sys.stderr)
            return 2
    try:
        plan = plan_accumulation(
            args.build, args.batch, target_batch_size=args.target_batch_size, memory_limit=args.memory_limit,
            margin=args.margin, max_micro_batch_size=args.max_micro_batch_size, multiple_of=args.multiple_of,
            replicas=args.replicas, start=args.start, repeats=args.repeats,
            remat=None if args.remat is None else True if args.remat == "all" else args.remat.split(","),
        )
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(f"wrote {plan.to_json(args.json)}")
    if args.plot:
        print(f"wrote {plan.plot(args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
