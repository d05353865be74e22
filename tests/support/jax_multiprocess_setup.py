"""The setting shared by the JAX multi-process test and its worker script
(``tests/backends/test_jax_multiprocess.py``,
``tests/support/jax_multiprocess_worker.py``), and a small launcher for the
worker processes. Imports no framework.

Two processes x two CPU devices each (``XLA_FLAGS`` below): four devices
in one ``keras.distribution.DataParallel`` mesh. ``B`` is the GLOBAL
micro-batch (``B / PROCESSES`` rows fed by each process, ``B / 4`` per
device); an update sees ``N * B`` rows, so the single-process reference
trains with batch ``N * B``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

PROCESSES = 2
DEVICES_PER_PROCESS = 2
XLA_FLAGS = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
LOOPBACK = "127.0.0.1"

N = 3  # gradient_accumulation_steps
B = 8  # global micro-batch: 4 rows per process, 2 per device
MICRO_STEPS = 12  # 4 updates
SAVE_AFTER = 7  # micro-steps before the mid-window save: 2 updates + 1 micro-step of the third window
FEATURES, HIDDEN = 5, 8

# AdamW with a schedule that changes at every update: a schedule stepped per
# micro-step, or an update counted twice, would end far from the reference.
LEARNING_RATE = dict(initial_learning_rate=2e-2, decay_steps=1, decay_rate=0.7)
WEIGHT_DECAY = 0.05


def make_mlp(keras):
    """The model, with the same initial weights wherever it is built (layer
    names fixed: a second run in one process has the same variable paths)."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
                             keras.layers.Dense(1, name="out")], name="mlp")


def make_inner(keras):
    """The inner optimizer: AdamW, its learning rate decayed at every update."""
    schedule = keras.optimizers.schedules.ExponentialDecay(**LEARNING_RATE)
    return keras.optimizers.AdamW(schedule, weight_decay=WEIGHT_DECAY)


def data() -> tuple[np.ndarray, np.ndarray]:
    """The global data: ``MICRO_STEPS * B`` rows, micro-batch ``k`` is rows
    ``[k * B, (k + 1) * B)``."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(MICRO_STEPS * B, FEATURES)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(FEATURES, 1))) + 0.1 * rng.normal(size=(MICRO_STEPS * B, 1))).astype("float32")
    return x, y


def process_share(array: np.ndarray, process_id: int) -> np.ndarray:
    """Process ``process_id``'s rows of every global micro-batch, in order:
    rows ``[k * B + p * B/P, k * B + (p + 1) * B/P)`` of micro-batch ``k``
    (what ``jax.make_array_from_process_local_data`` puts on that process's
    devices, which come ``p``-th in the mesh)."""
    per = B // PROCESSES
    shaped = array.reshape(MICRO_STEPS, PROCESSES, per, *array.shape[1:])
    return shaped[:, process_id].reshape(MICRO_STEPS * per, *array.shape[1:])


# ----------------------------------------------------------------- launching
def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago
    (the OS picks it: bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class ProcessError(RuntimeError):
    """A worker failed or ran out of time; the message has the logs."""


class Processes:
    """``PROCESSES`` worker processes running ``python argv... --process-id i
    --port PORT`` (one coordinator port, free at start), each in its own
    session (process group) with its output in ``log_dir/process<i>.log``.
    A context manager: leaving it SIGKILLs every process group still alive."""

    def __init__(self, argv: Sequence[str], log_dir: Path, env: dict | None = None) -> None:
        self.argv, self.log_dir, self.env = list(argv), Path(log_dir), dict(env or {})
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Processes":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        # The coordination service listens on the loopback interface only
        # (JAX's default is every interface, "[::]:PORT").
        env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
               "JAX_COORDINATOR_BIND_ADDRESS": f"{LOOPBACK}:{port}", "PYTHONUNBUFFERED": "1", **self.env}
        for i in range(PROCESSES):
            with open(self.log_path(i), "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *self.argv, "--process-id", str(i), "--port", str(port)], env=env,
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"process{i}.log"

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- process {i} (exit {p.poll()}) ---\n"
                         + self.log_path(i).read_text(errors="replace")[-tail:] for i, p in enumerate(self.procs))

    def kill_all(self) -> None:
        """SIGKILL each worker's process group (the workers this object
        started, by their ids) and reap it."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)

    def _check(self, deadline: float, what: str, done) -> None:
        while not done():
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes) or (what != "exit" and any(c is not None for c in codes)):
                time.sleep(1.0)  # let a peer's error reach its log too
                self.kill_all()
                raise ProcessError(f"a worker exited before {what}: exit codes {codes}\n{self.logs()}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise ProcessError(f"no {what} within the time limit: exit codes {codes}\n{self.logs()}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> None:
        """Until every worker has exited 0 (raises otherwise)."""
        self._check(time.monotonic() + timeout, "exit", lambda: all(p.poll() == 0 for p in self.procs))

    def wait_for_files(self, paths: Sequence[Path], timeout: float) -> None:
        """Until every path exists, every worker still running (raises otherwise)."""
        self._check(time.monotonic() + timeout, f"{[Path(p).name for p in paths]}",
                    lambda: all(Path(p).exists() for p in paths))
