"""Profiles (tiny, quick, full), the model sizes of each, and the command-line
arguments the benchmarks share."""

from __future__ import annotations

import argparse
import os


# Model sizes per profile. `tiny` is for the smoke test (seconds), `quick` is
# what `make bench` runs (the whole quick profile < 10 min on 2 CPU cores),
# `full` is the sweep to run on a quiet machine or a GPU.
#
# `cnn` and `transformer` are small and activation-heavy (the accumulator is
# lost in the noise next to them). The two models "where parameters matter"
# are Transformer encoders built like `transformer`:
#   * `transformer_wide` (overhead benchmark): d_model 256, 6 layers,
#     5,272,066 parameters (quick and full) on 32 tokens, so that the step is
#     short and the extra pass over the parameters is a measurable part of it;
#   * `transformer_big` (memory benchmark): d_model 512, 6 layers,
#     21,079,042 parameters (quick and full, 84 MiB float32) on 128 tokens,
#     so that at a micro-batch of a few sequences its activations and its
#     parameters are of the same order.
# Their `tiny` sizes only exercise the code paths.
MODEL_SIZES = {
    "tiny": {
        "cnn": dict(width=8, blocks=(1,), image=32),
        "transformer": dict(seq_len=256, vocab=256, dim=16, heads=2, ff=32, layers=1),
        "transformer_wide": dict(seq_len=16, vocab=256, dim=32, heads=2, ff=64, layers=1),
        "transformer_big": dict(seq_len=16, vocab=256, dim=32, heads=2, ff=64, layers=1),
    },
    "quick": {
        "cnn": dict(width=32, blocks=(1, 1), image=32),
        "transformer": dict(seq_len=256, vocab=1000, dim=64, heads=4, ff=128, layers=2),
        "transformer_wide": dict(seq_len=32, vocab=2048, dim=256, heads=4, ff=1024, layers=6),
        "transformer_big": dict(seq_len=128, vocab=4096, dim=512, heads=8, ff=2048, layers=6),
    },
    "full": {
        "cnn": dict(width=64, blocks=(2, 2, 2), image=32),
        "transformer": dict(seq_len=256, vocab=8000, dim=128, heads=4, ff=512, layers=4),
        "transformer_wide": dict(seq_len=32, vocab=2048, dim=256, heads=4, ff=1024, layers=6),
        "transformer_big": dict(seq_len=128, vocab=4096, dim=512, heads=8, ff=2048, layers=6),
    },
}
MODELS = ("cnn", "transformer")  # the small models (every profile of benchmarks.memory has them)
ALL_MODELS = MODELS + ("transformer_wide", "transformer_big")
TRANSFORMERS = ("transformer", "transformer_wide", "transformer_big")


def add_profile_args(parser: argparse.ArgumentParser, default_out: str = "bench_output") -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tiny", dest="profile", action="store_const", const="tiny",
                       help="smallest sizes, a few seconds (what the smoke test runs)")
    group.add_argument("--quick", dest="profile", action="store_const", const="quick",
                       help="the default: modest sizes, what `make bench` runs")
    group.add_argument("--full", dest="profile", action="store_const", const="full",
                       help="bigger models and sweeps (run on a quiet machine or a GPU)")
    parser.set_defaults(profile="quick")
    parser.add_argument("--out", default=default_out, help=f"output folder (default: {default_out})")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--models, --batch and --n, shared by the dense-model benchmarks."""
    parser.add_argument("--models", type=parse_str_list, help="comma list of " + ",".join(ALL_MODELS))
    parser.add_argument("--batch", type=int, help="micro-batch size B for every model")
    parser.add_argument("--n", type=parse_int_list, help="comma list of accumulation steps N")


def apply_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace, p: dict) -> dict:
    """``p`` (a profile's settings: ``models``, ``batch`` per model, ``ns``)
    with --models, --batch and --n applied; ``parser.error`` on an unknown
    model, or one the profile has no micro-batch for and --batch is not given."""
    if args.models:
        p["models"] = tuple(args.models)
    unknown = [m for m in p["models"] if m not in ALL_MODELS]
    if unknown:
        parser.error(f"--models: unknown model(s) {unknown}; choose from {list(ALL_MODELS)}")
    if args.batch:
        p["batch"] = {k: args.batch for k in ALL_MODELS}
    elif any(m not in p["batch"] for m in p["models"]):
        parser.error(f"--models {','.join(p['models'])}: the {args.profile} profile has no micro-batch for "
                     f"{[m for m in p['models'] if m not in p['batch']]}; pass --batch")
    if args.n:
        p["ns"] = tuple(args.n)
    return p


def parse_int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def benchmark_parser(doc: str, profiles: bool = True, models: bool = False) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help; the profile flags and
    --out (``profiles``), --models, --batch and --n (``models``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if profiles:
        add_profile_args(parser)
    if models:
        add_model_args(parser)
    return parser


def add_backend_arg(parser: argparse.ArgumentParser, note: str = "") -> None:
    """--backend tensorflow|jax|torch, by default ``KERAS_BACKEND`` (else
    tensorflow); ``note`` ends its help."""
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"),
                        default=os.environ.get("KERAS_BACKEND") or "tensorflow",
                        help="the Keras backend (default: KERAS_BACKEND, else tensorflow)" + note)
