"""Device set-up before a run: the Keras backend, GPU memory and where the
inputs live."""

from __future__ import annotations

import argparse
import os
import sys


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
