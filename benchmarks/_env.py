"""What a run ran on (versions, machine, load average and devices, recorded in
each benchmark's JSON) and where the repository is."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent


def tests_support() -> None:
    """Put ``tests/`` on ``sys.path``, so that ``support`` imports: the code a
    benchmark or a study shares with the tests (``tests/support/``)."""
    path = str(REPO_ROOT / "tests")
    if path not in sys.path:
        sys.path.insert(0, path)


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
