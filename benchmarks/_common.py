"""Shared helpers for the benchmarks: environment, output files, progress,
per-process peak memory, worker subprocesses, models, data and optimizers.

Nothing here imports TensorFlow at module level: the parents of the memory
and sparse benchmarks only spawn workers, so they stay light and start fast.
TensorFlow-dependent helpers import it inside the function.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
RESULT_PREFIX = "BENCH_RESULT "

# --------------------------------------------------------------------- sizes
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


def parse_int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# ---------------------------------------------------------------- environment
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> list | None:
    """The machine's load average over 1, 5 and 15 minutes, or ``None``
    where the platform has none."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def static_env() -> dict:
    """Environment facts that need no TensorFlow import."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    load = load_average()
    return {
        "tensorflow": _version("tensorflow") or _version("tensorflow-cpu"),
        "keras": _version("keras"),
        "accum_optimizer": _version("accum-optimizer"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "load_average_at_start": load,
        "git_commit": commit,
        "argv": sys.argv[1:],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def tf_env() -> dict:
    """Device facts read through TensorFlow (imports it)."""
    import tensorflow as tf
    import keras

    gpus = tf.config.list_physical_devices("GPU")
    device = "CPU"
    if gpus:
        try:
            details = tf.config.experimental.get_device_details(gpus[0])
            device = f"GPU:0 ({details.get('device_name', 'GPU')})"
        except Exception:  # pragma: no cover - depends on the driver
            device = "GPU:0"
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "device": device,
        "gpu_count": len(gpus),
        "memory_source": "tf.config.experimental.get_memory_info('GPU:0')['peak']" if gpus
        else "peak RSS (/proc/self/status VmHWM after reset, else ru_maxrss)",
    }


def select_backend(parser: argparse.ArgumentParser, backend: str) -> None:
    """Run Keras on ``backend`` (``KERAS_BACKEND``, before Keras is imported);
    ``parser.error`` if Keras already runs another or the backend is not
    installed."""
    import importlib.util

    keras = sys.modules.get("keras")
    if keras is not None and keras.backend.backend() != backend:
        parser.error(f"--backend {backend}: Keras is already imported on {keras.backend.backend()!r}")
    if importlib.util.find_spec(backend) is None:
        parser.error(f"--backend {backend}: {backend} is not installed in this Python ({sys.executable}); "
                     "the make test legs have one venv per backend (.venvs/k3-jax, .venvs/k3-torch)")
    os.environ["KERAS_BACKEND"] = backend


def backend_env(backend: str) -> dict:
    """The Keras backend's versions and device (JAX or torch; TensorFlow:
    :func:`tf_env`)."""
    import keras

    env = {"keras": keras.__version__, "keras_backend": backend}
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        env.update(jax=jax.__version__, device=f"{device.platform}: {getattr(device, 'device_kind', device)}",
                   memory_source="jax device.memory_stats()['peak_bytes_in_use']" if device.platform == "gpu"
                   else "RSS")
    elif backend == "torch":
        import torch

        gpu = torch.cuda.is_available()
        env.update(torch=torch.__version__, device=torch.cuda.get_device_name(0) if gpu else "cpu",
                   memory_source="torch.cuda.max_memory_allocated()" if gpu else "RSS")
    return env


def has_gpu() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def configure_gpu(memory_limit_mib: float | None = None) -> bool:
    """Before TensorFlow initialises its devices: cap GPU:0 at
    ``memory_limit_mib`` (a logical device, so larger runs fail with a real
    OOM), or let it grow on demand (so concurrent workers can share it).
    Returns whether there is a GPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for i, gpu in enumerate(gpus):
        try:
            if memory_limit_mib and i == 0:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_limit_mib))])
            else:
                tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # devices already initialised
            pass
    return bool(gpus)


def on_device(*arrays):
    """The arrays as tensors on the accelerator if there is one (so a timed
    step does not include a host-to-device copy of its input), else on the CPU."""
    import tensorflow as tf

    device = "/GPU:0" if has_gpu() else "/CPU:0"
    with tf.device(device):
        return tuple(tf.identity(tf.constant(a)) for a in arrays)


# ----------------------------------------------------------------- progress
class Progress:
    """One line per finished item: ``[memory 3/26 +41s] label: result``."""

    def __init__(self, name: str, total: int, stream=None) -> None:
        self.name, self.total, self.done = name, total, 0
        self.start = time.perf_counter()
        self.stream = stream or sys.stdout

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def note(self, text: str) -> None:
        print(f"[{self.name} +{self.elapsed():.0f}s] {text}", file=self.stream, flush=True)

    def step(self, label: str, result: str = "", seconds: float | None = None) -> None:
        self.done += 1
        took = f" ({seconds:.1f}s)" if seconds is not None else ""
        print(f"[{self.name} {self.done}/{self.total} +{self.elapsed():.0f}s] {label}"
              f"{': ' + result if result else ''}{took}", file=self.stream, flush=True)


# ------------------------------------------------------------------- output
def write_json(path: Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default, allow_nan=False) + "\n")
    return path


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def clean_floats(obj: Any) -> Any:
    """Replace NaN/inf by None so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_floats(v) for v in obj]
    return obj


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_outputs(out: Path, name: str, data: dict, markdown: str, plot_fn, prog) -> None:
    """Write ``<name>.json`` (raw figures), ``<name>.png`` and ``<name>.md``."""
    out = Path(out)
    if isinstance(data.get("env"), dict):  # (the start's is in static_env)
        data["env"]["load_average_at_end"] = load_average()
    jpath = write_json(out / f"{name}.json", clean_floats(data))
    ppath = plot_fn(data, out / f"{name}.png")
    (out / f"{name}.md").write_text(markdown + "\n")
    prog.note(f"wrote {jpath}, {ppath}, {out / f'{name}.md'}")


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], markdown: bool = False) -> str:
    rows = [[str(c) for c in r] for r in rows]
    headers = [str(h) for h in headers]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def fmt_mib(b: float | None, digits: int = 1) -> str:
    return "n/a" if b is None else f"{b / MIB:.{digits}f}"


def fmt_ratio(median: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if median is None:
        return "n/a"
    if lo is None or hi is None:
        return f"{median:.3f}"
    return f"{median:.3f} [{lo:.3f}, {hi:.3f}]"


# --------------------------------------------------------------- statistics
def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) without numpy."""
    xs = sorted(values)
    if not xs:
        raise ValueError("empty")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_median_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median of ``values``.

    Draws ``resamples`` samples of ``len(values)`` with replacement (numpy's
    ``default_rng(seed)``: the same values give the same interval), takes
    each one's median, and returns the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles of those medians (Efron's percentile
    interval; ``scipy.stats.bootstrap(..., method="percentile")`` computes
    the same up to its own random draws).

    Raises:
        ValueError: ``values`` is empty, or ``confidence`` is not in (0, 1),
            or ``resamples < 1``.
    """
    import numpy as np

    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_median_ci: `values` is empty; it needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_median_ci: `confidence`={confidence!r}; expected a float in (0, 1)")
    if resamples < 1:
        raise ValueError(f"bootstrap_median_ci: `resamples`={resamples!r}; expected an int >= 1")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    lo, hi = np.quantile(medians, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


def summarize_with_ci(values: Sequence[float], confidence: float = 0.95, seed: int = 0) -> dict:
    """:func:`summarize` plus the median's percentile-bootstrap interval
    (:func:`bootstrap_median_ci`): ``ci_low``, ``ci_high``, ``confidence``."""
    out = summarize(values)
    out["ci_low"], out["ci_high"] = bootstrap_median_ci(values, confidence, seed=seed)
    out["confidence"] = confidence
    return out


def summarize(values: Sequence[float]) -> dict:
    """median, quartiles, min, max of a sample."""
    values = [float(v) for v in values]
    return {
        "median": statistics.median(values),
        "q1": quantile(values, 0.25),
        "q3": quantile(values, 0.75),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# ----------------------------------------------------------- process memory
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is None:  # not Linux: best effort
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


class PeakMemory:
    """Peak memory of this process from a start point, two ways.

    * ``rss``: resident set size. :meth:`start` resets the kernel's
      high-water mark (``/proc/self/clear_refs``) so the peak is measured
      from that point; where that is not possible, ``ru_maxrss`` (the
      lifetime peak) is used.
    * ``tf_allocator``: TensorFlow's allocator statistics for the device
      (``reset_memory_stats`` at :meth:`start`, ``get_memory_info(...)['peak']``
      at :meth:`stop`): tensor memory only (weights, optimizer state,
      gradients, activations, graph constants), no runtime or host overhead.
      On a GPU this is the device memory; on a CPU it needs TensorFlow's BFC
      CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, which
      :func:`run_worker` sets) to be complete.

    ``stop()`` returns both, each with ``peak``, ``base`` (at start),
    ``delta = peak - base`` and ``resident = current - base`` (what stays
    allocated at the end), plus ``delta_bytes``: the headline figure (GPU:
    the allocator's; CPU: RSS, as the benchmarks' docs say).
    """

    def __init__(self, gpu: bool, backend: str = "tensorflow") -> None:
        self.gpu, self.backend = gpu, backend
        self.device = "GPU:0" if gpu else "CPU:0"
        self.base = 0
        self.rss_base = 0
        self.alloc_base: int | None = None
        self.hwm_reset = False

    def _alloc_info(self) -> dict | None:
        if self.backend == "jax":  # the device's own counters (GPU; None on a CPU)
            import jax

            stats = jax.devices()[0].memory_stats()
            return None if not stats else {"current": stats["bytes_in_use"], "peak": stats["peak_bytes_in_use"]}
        if self.backend == "torch":
            import torch

            if not self.gpu:
                return None
            return {"current": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
        import tensorflow as tf

        try:
            return tf.config.experimental.get_memory_info(self.device)
        except (ValueError, RuntimeError):
            return None

    def start(self) -> None:
        if self.backend == "torch" and self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.backend == "tensorflow":
            import tensorflow as tf

            try:
                tf.config.experimental.reset_memory_stats(self.device)
            except (ValueError, RuntimeError):
                pass
        # (JAX cannot reset its peak: the device's lifetime peak, which the
        # model's build stays below, minus the memory in use here.)
        info = self._alloc_info()
        self.alloc_base = None if info is None else info["current"]
        self.rss_base = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = _status_kib("VmHWM") is not None
        except OSError:
            self.hwm_reset = False
        self.base = self.alloc_base if self.gpu else self.rss_base

    def current(self) -> int:
        if self.gpu:
            return self._alloc_info()["current"]
        return rss_bytes()

    def stop(self) -> dict:
        if self.hwm_reset:
            rss_peak, rss_source = _status_kib("VmHWM") * 1024, "VmHWM after reset"
        else:
            rss_peak, rss_source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
        rss_now = rss_bytes()
        rss = {"peak": rss_peak, "base": self.rss_base, "delta": rss_peak - self.rss_base,
               "resident": rss_now - self.rss_base, "source": rss_source}
        info = self._alloc_info()
        alloc = None
        if info is not None and self.alloc_base is not None and info["peak"] > 0:
            alloc = {"device": self.device, "peak": info["peak"], "base": self.alloc_base,
                     "delta": info["peak"] - self.alloc_base, "resident": info["current"] - self.alloc_base}
        head = alloc if (self.gpu and alloc) else rss
        return {"peak_bytes": int(head["peak"]), "base_bytes": int(head["base"]),
                "delta_bytes": int(head["delta"]), "resident_bytes": int(head["resident"]),
                "source": f"{self.backend} allocator {self.device}" if self.gpu else f"RSS ({rss_source})",
                "rss": rss, "tf_allocator": alloc}


# ------------------------------------------------------------------ workers
def run_worker(module: str, config: dict, timeout: float) -> dict:
    """Run ``python -m <module> --worker '<json config>'`` in a fresh process.

    The worker prints one ``BENCH_RESULT {json}`` line. Failures come back as
    ``{"status": ...}``: ``"OOM"`` (allocator ran out of memory, or the
    process was killed, usually by the kernel's OOM killer), ``"timeout"`` or
    ``"error"``, with the tail of stderr.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Complete tensor-memory statistics on the CPU (get_memory_info('CPU:0')).
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(config)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result.setdefault("status", "ok")
            result["seconds"] = seconds
            return result
    tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
    oom = proc.returncode in (-9, 137) or any(
        s in proc.stderr for s in ("ResourceExhaustedError", "OOM when allocating", "MemoryError",
                                   "std::bad_alloc"))
    return {"status": "OOM" if oom else "error", "returncode": proc.returncode,
            "stderr_tail": tail, "seconds": seconds}


def run_workers(module: str, configs: list[dict], jobs: int, timeout: float,
                on_done: Callable[[int, dict], None]) -> list[dict]:
    """Run workers, ``jobs`` at a time, in submission order; returns results
    in the order of ``configs`` and calls ``on_done(i, result)`` as each ends."""
    results: list[dict | None] = [None] * len(configs)
    if jobs <= 1:
        for i, c in enumerate(configs):
            results[i] = run_worker(module, c, timeout)
            on_done(i, results[i])
        return results  # type: ignore[return-value]
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_worker, module, c, timeout): i for i, c in enumerate(configs)}
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            on_done(i, results[i])
    return results  # type: ignore[return-value]


def emit_result(result: dict) -> None:
    """Worker side: print the result line the parent parses."""
    print(RESULT_PREFIX + json.dumps(clean_floats(result), default=_json_default), flush=True)


# -------------------------------------------------------------------- models
def build_model(kind: str, size: dict, seed: int = 0):
    """A small activation-heavy model with fixed-seed weights.

    ``cnn``: ResNet-style CNN on 32x32x3 images (conv stem, basic residual
    blocks with BatchNorm, stride-2 downsampling between stages, global
    average pooling, 10 logits). ``transformer``: pre-norm Transformer
    encoder on ``seq_len`` token ids (token ``Embedding`` + learned positions,
    ``layers`` x (MultiHeadAttention + MLP), mean pooling, 2 logits);
    ``transformer_wide`` and ``transformer_big`` are the same architecture
    at their own sizes (see ``MODEL_SIZES``).
    """
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    if kind == "cnn":
        w, img = size["width"], size["image"]
        inp = keras.Input((img, img, 3), name="image")
        x = L.Conv2D(w, 3, padding="same", use_bias=False)(inp)
        x = L.ReLU()(L.BatchNormalization()(x))
        for stage, n_blocks in enumerate(size["blocks"]):
            filters = w * 2**stage
            for b in range(n_blocks):
                stride = 2 if stage > 0 and b == 0 else 1
                shortcut = x
                y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
                y = L.ReLU()(L.BatchNormalization()(y))
                y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
                y = L.BatchNormalization()(y)
                if stride != 1 or shortcut.shape[-1] != filters:
                    shortcut = L.BatchNormalization()(
                        L.Conv2D(filters, 1, strides=stride, use_bias=False)(x))
                x = L.ReLU()(L.Add()([y, shortcut]))
        x = L.GlobalAveragePooling2D()(x)
        out = L.Dense(10)(x)
        return keras.Model(inp, out, name="resnet_cnn")
    if kind in TRANSFORMERS:
        d, seq = size["dim"], size["seq_len"]
        inp = keras.Input((seq,), dtype="int32", name="tokens")
        x = L.Embedding(size["vocab"], d, name="tokens_embedding")(inp)
        x = _PositionEmbedding(seq, d, name="positions")(x)
        for _ in range(size["layers"]):
            h = L.LayerNormalization()(x)
            h = L.MultiHeadAttention(size["heads"], d // size["heads"])(h, h)
            x = L.Add()([x, h])
            h = L.LayerNormalization()(x)
            h = L.Dense(size["ff"], activation="gelu")(h)
            h = L.Dense(d)(h)
            x = L.Add()([x, h])
        x = L.LayerNormalization()(x)
        x = L.GlobalAveragePooling1D()(x)
        out = L.Dense(2)(x)
        return keras.Model(inp, out, name="transformer_encoder")
    if kind == "embedding":
        # Sparse benchmark: ids -> Embedding(V, dim) -> mean -> Dense(1).
        inp = keras.Input((size["ids_per_example"],), dtype="int32", name="ids")
        x = L.Embedding(size["vocab"], size["dim"], name="table")(inp)
        x = L.GlobalAveragePooling1D()(x)
        out = L.Dense(1)(x)
        return keras.Model(inp, out, name="embedding_model")
    raise ValueError(f"unknown model kind {kind!r}; expected one of {ALL_MODELS + ('embedding',)}")


@functools.lru_cache(maxsize=None)
def _position_embedding_class():
    import keras

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned (seq_len, dim) position table to its input."""

        def __init__(self, seq_len, dim, **kwargs):
            super().__init__(**kwargs)
            self.seq_len, self.dim = seq_len, dim

        def build(self, input_shape):
            self.table = self.add_weight(shape=(self.seq_len, self.dim),
                                         initializer=keras.initializers.RandomNormal(stddev=0.02),
                                         name="table")

        def call(self, x):
            return x + self.table

    return PositionEmbedding


def _PositionEmbedding(*args, **kwargs):  # noqa: N802 - a layer factory
    return _position_embedding_class()(*args, **kwargs)


def model_loss(kind: str):
    import keras

    if kind == "embedding":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_batch(kind: str, size: dict, batch: int, seed: int = 1):
    """One synthetic (x, y) batch of the right shape and dtype, fixed seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "cnn":
        img = size["image"]
        x = rng.normal(size=(batch, img, img, 3)).astype("float32")
        y = rng.integers(0, 10, size=(batch,)).astype("int32")
    elif kind in TRANSFORMERS:
        x = rng.integers(0, size["vocab"], size=(batch, size["seq_len"])).astype("int32")
        y = rng.integers(0, 2, size=(batch,)).astype("int32")
    elif kind == "embedding":
        x = rng.integers(0, size["vocab"], size=(batch, size["ids_per_example"])).astype("int32")
        y = rng.normal(size=(batch, 1)).astype("float32")
    else:
        raise ValueError(kind)
    return x, y


class NotApplicable(Exception):
    """A configuration that cannot run (e.g. Keras' built-in with N=1)."""


def make_optimizer(method: str, n: int, inner: str = "adam", lr: float = 1e-3):
    """``plain``: the inner optimizer; ``accum``: AccumulatingOptimizer(inner, n);
    ``builtin``: the inner optimizer with Keras' ``gradient_accumulation_steps=n``."""
    import keras

    from accum_optimizer import AccumulatingOptimizer

    cls = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD,
           "adamw": keras.optimizers.AdamW}[inner]
    if method == "plain":
        return cls(lr)
    if method == "accum":
        return AccumulatingOptimizer(cls(lr), gradient_accumulation_steps=n)
    if method == "builtin":
        if n < 2:
            raise NotApplicable("Keras' built-in gradient_accumulation_steps must be >= 2")
        return cls(lr, gradient_accumulation_steps=n)
    raise ValueError(f"unknown method {method!r}; expected plain, accum or builtin")


def param_bytes(variables) -> int:
    import numpy as np

    return int(sum(int(np.prod(v.shape)) * _dtype_size(v.dtype) for v in variables))


def _dtype_size(dtype) -> int:
    import numpy as np

    name = getattr(dtype, "name", dtype)
    return np.dtype(str(name)).itemsize


def accumulator_bytes(opt) -> dict:
    """Bytes of the state an optimizer keeps *for accumulation* (beyond its
    inner/plain state): ``AccumulatingOptimizer``'s ``acc_grads`` (slots),
    and its bookkeeping: ``grad_received``, ``micro_steps``, ``mini_step``,
    ``window_weight`` and the row trackers of sparse variables; Keras'
    ``_accumulated_gradients``."""
    from accum_optimizer import AccumulatingOptimizer

    if isinstance(opt, AccumulatingOptimizer):
        slots = param_bytes(opt.acc_grads)
        counters = [getattr(opt, name, None) for name in ("grad_received", "micro_steps", "mini_step", "window_weight")]
        trackers = [t for t in (getattr(opt, "touched_rows", None) or []) if t is not None]
        extra = param_bytes([v for v in counters if v is not None] + trackers)
        return {"slots": slots, "bookkeeping": extra, "total": slots + extra}
    acc = getattr(opt, "_accumulated_gradients", None) or []
    slots = param_bytes(acc)
    return {"slots": slots, "bookkeeping": 0, "total": slots}


def make_train_step(model, opt, loss_fn, jit_compile: bool = False):
    """A ``tf.function`` custom-loop micro-step: forward, backward, ``apply``."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def warm_up_runtime(kind: str, size: dict, backend: str = "tensorflow") -> None:
    """Train a throwaway miniature of the model two steps (plain SGD).

    Memory workers call this before taking their baseline, so that
    TensorFlow's one-time runtime set-up (thread pools, oneDNN / cuDNN
    kernels and handles, about 25 MiB of RSS on a CPU) is already resident and
    not counted as training memory of the configuration being measured.
    """
    import keras

    if kind == "embedding":
        tiny = dict(size, vocab=16)
    else:
        tiny = MODEL_SIZES["tiny"][kind]
    model = build_model(kind, tiny, seed=0)
    x, y = make_batch(kind, tiny, 2)
    if backend != "tensorflow":  # (JAX, torch: fit, what their memory workers run)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model_loss(kind))
        model.fit(x, y, batch_size=2, epochs=2, verbose=0)
        return
    step = make_train_step(model, keras.optimizers.SGD(0.01), model_loss(kind))
    step(x, y).numpy()
    step(x, y).numpy()


def copy_bandwidth(megabytes: int = 64, repeats: int = 10, backend: str = "tensorflow") -> dict:
    """Measured bytes/s of ``a += b`` on float32 tensors of ``megabytes`` MiB
    (reads a and b, writes a: 3 x size bytes per call): ``assign_add`` in a
    ``tf.function`` (TensorFlow), a ``jax.jit`` add (JAX), an in-place
    ``add_`` (torch); the best of ``repeats`` calls after a warm-up."""
    n = megabytes * MIB // 4
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        state = {"a": jnp.zeros((n,), jnp.float32)}
        b = jnp.ones((n,), jnp.float32)
        jitted = jax.jit(lambda a, b: a + b, donate_argnums=0)

        def add():
            state["a"] = jitted(state["a"], b).block_until_ready()
    elif backend == "torch":
        import torch

        a, b = torch.zeros(n), torch.ones(n)

        def add():
            a.add_(b)
            if a.is_cuda:
                torch.cuda.synchronize()
    else:
        import tensorflow as tf

        a = tf.Variable(tf.zeros((n,), tf.float32))
        b = tf.ones((n,), tf.float32)
        @tf.function
        def step():
            a.assign_add(b)
            return tf.constant(0)

        def add():
            step().numpy()

    add()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        add()
        times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    moved = 3 * n * 4
    return {"tensor_mib": megabytes, "bytes_per_call": moved, "best_seconds": best,
            "median_seconds": med, "bytes_per_second": moved / best,
            "bytes_per_second_median": moved / med}
