"""A small launcher for multi-worker TensorFlow jobs on this machine.

Starts one Python process per worker with a ``TF_CONFIG`` that names
``127.0.0.1`` ports chosen free at run time (loopback only), each process in
its own session (process group), so that it and anything it spawned can be
killed as a whole. :class:`Cluster` is a context manager: leaving it, normally
or on an exception, SIGKILLs every process group still alive, so no worker
outlives a failed test or benchmark.

Used by the multi-worker tests (``tests/keras3/test_multiworker.py``,
``tests/keras2/test_multiworker.py``), by ``benchmarks/distributed.py`` and
by ``examples/multiworker.py`` (which put ``tests/`` on ``sys.path``, as the
tests have it). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on the loopback interface that were free a
    moment ago (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports: Sequence[int], index: int) -> str:
    """``TF_CONFIG`` of worker ``index`` in a cluster of workers on ``ports``."""
    return json.dumps({
        "cluster": {"worker": [f"{LOOPBACK}:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })


class ClusterError(RuntimeError):
    """A worker failed or the job ran out of time; the message has the logs."""


class Cluster:
    """``num_workers`` worker processes running ``argv`` (``argv[0]`` is a
    script or ``-m module``; ``sys.executable`` runs it).

    Each worker gets ``TF_CONFIG``, ``TF_CPP_MIN_LOG_LEVEL=3``,
    ``CUDA_VISIBLE_DEVICES=""`` (CPU only), the caller's ``PYTHONPATH`` plus
    ``pythonpath``, and its stdout and stderr in ``log_dir/worker<i>.log``.
    """

    def __init__(self, argv: Sequence[str], log_dir: Path, num_workers: int = 2,
                 pythonpath: Sequence[str] = (), env: dict | None = None) -> None:
        self.argv = list(argv)
        self.log_dir = Path(log_dir)
        self.num_workers = num_workers
        self.pythonpath = [str(p) for p in pythonpath]
        self.extra_env = dict(env or {})
        self.procs: list[subprocess.Popen | None] = [None] * num_workers
        self.ports: list[int] = []

    # ----------------------------------------------------------------- life
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = free_ports(self.num_workers)
        paths = self.pythonpath + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        for i in range(self.num_workers):
            env = dict(os.environ)
            env.update(
                TF_CONFIG=tf_config(self.ports, i),
                TF_CPP_MIN_LOG_LEVEL="3",
                CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join(paths),
                PYTHONUNBUFFERED="1",
            )
            env.update(self.extra_env)
            log = open(self.log_path(i), "w")
            try:
                self.procs[i] = subprocess.Popen(
                    [sys.executable, *self.argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                log.close()

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"worker{i}.log"

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for i in range(self.num_workers):
            p = self.log_path(i)
            text = p.read_text(errors="replace") if p.exists() else "(no log)"
            parts.append(f"--- worker {i} (exit {self.returncode(i)}) ---\n{text[-tail:]}")
        return "\n".join(parts)

    def returncode(self, i: int) -> int | None:
        p = self.procs[i]
        return None if p is None else p.poll()

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``i``'s process group and reap it."""
        p = self.procs[i]
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
            pass

    def kill_all(self) -> None:
        for i in range(self.num_workers):
            self.kill(i)

    # ------------------------------------------------------------- waiting
    def wait(self, timeout: float) -> None:
        """Wait until every worker has exited; raise :class:`ClusterError`
        (after killing the rest) if one fails or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [self.returncode(i) for i in range(self.num_workers)]
            if any(c not in (None, 0) for c in codes):
                time.sleep(1.0)  # let a peer's error reach its log too
                self.kill_all()
                raise ClusterError(f"a worker failed: exit codes {codes}\n{self.logs()}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                self.kill_all()
                raise ClusterError(f"timed out after {timeout:.0f} s: exit codes {codes}\n{self.logs()}")
            time.sleep(0.2)

    def wait_for_file(self, path: Path, timeout: float) -> None:
        """Wait until ``path`` exists; raise :class:`ClusterError` if a worker
        exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not Path(path).exists():
            codes = [self.returncode(i) for i in range(self.num_workers)]
            if any(c is not None for c in codes):
                self.kill_all()
                raise ClusterError(f"a worker exited before {path} appeared: {codes}\n{self.logs()}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise ClusterError(f"{path} did not appear within {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)


def run_cluster(argv: Sequence[str], log_dir: Path, timeout: float, num_workers: int = 2,
                pythonpath: Sequence[str] = (), env: dict | None = None, attempts: int = 2) -> None:
    """Run ``argv`` on ``num_workers`` workers until all exit 0.

    A port taken by another process between :func:`free_ports` and the
    worker's gRPC server start is retried with new ports (``attempts`` in
    all); any other failure raises :class:`ClusterError` at once.
    """
    for attempt in range(attempts):
        with Cluster(argv, log_dir, num_workers, pythonpath, env) as cluster:
            try:
                cluster.wait(timeout)
                return
            except ClusterError as e:
                if attempt + 1 < attempts and port_clash(str(e)):
                    continue
                raise


def port_clash(log: str) -> bool:
    """Does a failed job's log say a worker could not bind its port?"""
    return any(s in log for s in ("Address already in use", "Failed to add port", "Could not start gRPC server"))


def run_worker(main) -> None:
    """A worker script's entry: exit with ``main()``'s code (through
    ``sys.exit``: the framework's exit handlers run, e.g. JAX's shutdown, a
    barrier with the peers); on any exception, print it and exit at once
    (``os._exit(1)``): after a peer's failure TensorFlow's or JAX's shutdown
    can wait for the coordination service long after the error."""
    try:
        code = main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
