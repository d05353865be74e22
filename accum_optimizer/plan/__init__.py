"""The accumulation planner: "my device holds B, I want an effective batch
of T", answered by measurement.

    from accum_optimizer.plan import plan_accumulation

    plan = plan_accumulation("mypkg.train:build_model", "mypkg.train:make_batch",
                             target_batch_size=256, memory_limit="10GiB")
    plan.micro_batch_size, plan.gradient_accumulation_steps

or ``python -m accum_optimizer.plan mypkg.train:build_model
mypkg.train:make_batch --target-batch-size 256 --memory-limit 10GiB``.

Every probe measures the user's model at one micro-batch size B with its
optimizer wrapped in ``AccumulatingOptimizer(inner, 2)``, so that the
accumulators and an update both count. How depends on the backend:

* TensorFlow (Keras 3 on TensorFlow, Keras 2): three steps in a fresh
  process (an out-of-memory error is not safe to recover from in-process,
  and TensorFlow keeps part of a cleared model alive), reading TensorFlow's
  allocator peak (:mod:`accum_optimizer.plan._probe`); the next probe's
  process is started, and has imported TensorFlow, while the current one
  trains.
* JAX: in this process, XLA's memory analysis of the compiled train step
  at B, no step run (:mod:`accum_optimizer.plan._jax`); under a
  ``keras.distribution`` per device, B being the global micro-batch.
* torch: on a CUDA device, in this process, torch's allocator peak over
  three steps (:mod:`accum_optimizer.plan._torch`); refused on the CPU.

On JAX and TensorFlow, ``remat=`` also searches the model built under each
``keras.RematScope`` mode and ranks the candidates by measured speed (a
mode Keras cannot apply to the model is listed with its error: on
TensorFlow, Keras 3.15's ``"full"`` raises in a graph).

The search is the same on every backend: it doubles B from its start until
a probe does not fit (or B reaches its maximum), then bisects between the
last fit and the first failure, on multiples of ``multiple_of``, or, once
the peaks grow with B, tries where the line through the two largest peaks
meets the budget (:func:`linear_estimate`); the
plan's trials always hold the chosen B and the next multiple above it
(unless the chosen B is the maximum), so the answer never rests on an
unprobed neighbour. N is ``ceil(target / (B * replicas))``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["Plan", "plan_accumulation", "parse_bytes", "search_micro_batch_size", "linear_estimate", "REMAT_MODES"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, name: str = "memory_limit") -> int:
    """Bytes from an int, a float or a string with a unit (``"10GiB"``,
    ``"512 MiB"``, ``"1.5GB"``, ``"2e9"``; binary units KiB-TiB, decimal
    KB-TB, case-insensitive).

    Raises:
        ValueError: not a positive amount, or an unknown unit (the message
            names ``name`` and the value).
    """
    amount = None
    if isinstance(value, bool):
        amount = None
    elif isinstance(value, (int, float)):
        amount = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            amount = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if amount is None or not math.isfinite(amount) or amount <= 0:
        raise ValueError(
            f"`{name}` must be a positive number of bytes or a string with a unit "
            f"(e.g. 10737418240, '10GiB', '512MiB', '1.5GB'). Received: {name}={value!r}."
        )
    return int(amount)


def load_function(path: Any, name: str) -> Callable[..., Any]:
    """The function an importable ``"module:function"`` names.

    Raises:
        ValueError: not of that form, the module does not import, or it has
            no such callable (the message names the argument and value).
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"`{name}` must be an importable 'module:function'. Received: {name}={path!r}.")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see
        raise ValueError(f"`{name}`={path!r}: module {module_name!r} cannot be imported ({type(e).__name__}: {e}).") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"`{name}`={path!r}: module {module_name!r} has no callable {attr!r}.")
    return function


def search_micro_batch_size(fits: Callable[[int], bool], maximum: int, start: int = 1, multiple_of: int = 1,
                            estimate: Callable[[int, int | None], int | None] | None = None) -> int | None:
    """The largest multiple of ``multiple_of`` up to ``maximum`` for which
    ``fits`` holds, assuming it holds below any size where it does (memory
    grows with B); ``None`` if it holds for none.

    Without ``estimate``: doubles from ``start`` (rounded up to a multiple)
    until ``fits`` fails or ``maximum`` is reached, then bisects between the
    last fit and the first failure. With ``estimate(last_fit, first_fail)``
    (sizes; ``last_fit`` 0 before any fit, ``first_fail`` ``None`` before any
    failure) returning a guess of the answer (or ``None``: no guess yet), the
    next size is the guess, rounded down to a multiple and kept inside what
    is still undecided (above the last fit, below the first failure, at most
    8 times the last fit); after two guesses in a row that left the answer
    open, one doubling or bisection step is taken, so a poor guesser costs at
    most about three times the probes of the plain search.

    Every size it returns was tried, and so was the next multiple above it
    unless it is ``maximum``. ``fits`` is called once per size.
    """
    unit_max = maximum // multiple_of
    if unit_max < 1:
        return None
    seen: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in seen:
            seen[k] = bool(fits(k * multiple_of))
        return seen[k]

    def guess(last_fit: int, first_fail: int | None) -> int | None:
        if estimate is None:
            return None
        size = estimate(last_fit * multiple_of, None if first_fail is None else first_fail * multiple_of)
        if size is None:
            return None
        low = last_fit + 1
        high = min(unit_max, 8 * max(last_fit, 1)) if first_fail is None else first_fail - 1
        return min(max(int(size) // multiple_of, low), high)

    last_fit, first_fail, guided = 0, None, 0
    k = min(max(1, -(-start // multiple_of)), unit_max)
    while True:
        if ok(k):
            last_fit = k
        else:
            first_fail = k
        if last_fit == unit_max or (first_fail is not None and first_fail - last_fit <= 1):
            break
        g = guess(last_fit, first_fail) if guided < 2 else None
        if g is not None:
            k, guided = g, guided + 1
        else:
            guided = 0
            k = min(2 * last_fit, unit_max) if first_fail is None else (last_fit + first_fail) // 2
    return last_fit * multiple_of if last_fit else None


def linear_estimate(trials: list, budget: int) -> Callable[[int, int | None], int | None]:
    """A guesser for :func:`search_micro_batch_size`: the B at which the line
    through the peaks of the two largest sizes measured so far (out-of-memory
    trials have no peak) reaches ``budget``. ``None`` until those two peaks
    differ by at least 15 %: at small B the peak is mostly weights and
    optimizer state, flat in B, and a slope from there is mostly the
    allocator's noise (the example CNN: 202.1, 202.4, 203.1, 241.5 MiB at
    B = 8, 16, 32, 64). Near the limit the peak grows about linearly with B
    (activations), which is where the line is drawn.

    ``trials`` is read at each call (the planner appends to it)."""

    def estimate(last_fit: int, first_fail: int | None) -> int | None:
        measured = sorted((t["micro_batch_size"], t["peak_bytes"]) for t in trials if t["peak_bytes"] is not None)
        if len(measured) < 2:
            return None
        (b0, p0), (b1, p1) = measured[-2], measured[-1]
        if p1 < 1.15 * p0:
            return None
        return int(b1 + (budget - p1) * (b1 - b0) / (p1 - p0))

    return estimate


@dataclasses.dataclass
class Plan:
    """What the planner chose and measured.

    Attributes:
        micro_batch_size: B, the largest size that fits (a multiple of
            ``multiple_of``).
        gradient_accumulation_steps: N = ``ceil(target_batch_size / (B * replicas))``.
        effective_batch_size: ``N * B * replicas`` (>= the target).
        peak_bytes: the measured peak at B (int, bytes), accumulators,
            optimizer slots and activations included.
        target_batch_size: the request's target (samples per update).
        memory_limit: the request's limit (bytes).
        margin: a probe fits at most ``margin * memory_limit``.
        replicas: devices in sync (each takes B per micro-step).
        multiple_of: B is a multiple of this.
        max_micro_batch_size: the largest B the search could choose.
        device: where the probes ran (``"GPU:0"`` or ``"CPU:0"``).
        trials: every probe in order, each a dict with
            ``micro_batch_size``, ``peak_bytes`` (``None`` after an
            out-of-memory error; the largest of its repeats),
            ``fits``, ``seconds_per_micro_step`` (``None`` on JAX: no step
            runs), and where they apply ``peaks`` (each repeat's, bytes),
            ``spread_bytes`` (largest minus smallest repeat), ``memory``
            (JAX: XLA's figures, bytes: argument, output, alias, temp,
            generated_code, peak) and ``probe_seconds``.
        seconds: how long planning took (wall clock).
        backend: ``"tensorflow"`` (Keras 3 on TensorFlow, or Keras 2),
            ``"jax"`` or ``"torch"``.
        method: what a probe measured, in words.
        data_parallel: under a ``keras.distribution``, the size of its batch
            axis: B is the global micro-batch (a multiple of it, each
            data-parallel group of devices takes ``B / data_parallel``) and
            the peaks are per device; 1 otherwise.
        devices: the devices one step runs on (the distribution's mesh), 1
            without a distribution.
        repeats: how many times each B was probed (``peak_bytes`` is the
            largest; a B fits when that plus the spread fits).
        spread_bytes: the chosen B's spread over its repeats (bytes), or
            ``None`` when it was probed once.
        remat: the chosen candidate's ``keras.RematScope`` mode (``None``:
            no remat).
        candidates: with ``remat=``, each mode's largest fitting B, fastest
            first: dicts with ``remat``, ``micro_batch_size``,
            ``gradient_accumulation_steps``, ``peak_bytes``,
            ``seconds_per_micro_step`` (measured) and ``samples_per_second``
            (``T / (N * seconds_per_micro_step)``), then any mode whose
            probe raised as ``{"remat", "error"}``; empty without.

    :attr:`balanced_micro_batch_size` is the same N's smallest micro-batch
    that reaches the target (it fits too); :attr:`headroom_bytes` the budget
    minus the chosen B's peak.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    effective_batch_size: int
    peak_bytes: int
    target_batch_size: int
    memory_limit: int
    margin: float
    replicas: int
    multiple_of: int
    max_micro_batch_size: int
    device: str
    trials: list
    seconds: float = 0.0
    backend: str = "tensorflow"
    method: str = "TensorFlow's allocator peak over three train_on_batch micro-steps, a process per B"
    data_parallel: int = 1
    devices: int = 1
    repeats: int = 1
    spread_bytes: int | None = None
    remat: str | None = None
    candidates: list = dataclasses.field(default_factory=list)

    @property
    def balanced_micro_batch_size(self) -> int:
        """The smallest multiple of ``multiple_of`` that reaches the target
        with the same N (``ceil(target / (N * replicas))``, rounded up): at
        most :attr:`micro_batch_size`, so it fits too (memory grows with B),
        and its effective batch is the closest to the target that N allows."""
        per_step = -(-self.target_batch_size // (self.gradient_accumulation_steps * self.replicas))
        return min(self.micro_batch_size, -(-per_step // self.multiple_of) * self.multiple_of)

    @property
    def balanced_effective_batch_size(self) -> int:
        """``N * balanced_micro_batch_size * replicas``."""
        return self.gradient_accumulation_steps * self.balanced_micro_batch_size * self.replicas

    @property
    def budget_bytes(self) -> int:
        """``margin * memory_limit``: the most a probe may use to fit."""
        return int(self.margin * self.memory_limit)

    @property
    def headroom_bytes(self) -> int:
        """:attr:`budget_bytes` minus :attr:`peak_bytes` (bytes; per device
        under a distribution)."""
        return self.budget_bytes - self.peak_bytes

    @property
    def headroom_fraction(self) -> float:
        """:attr:`headroom_bytes` as a fraction of :attr:`budget_bytes`."""
        return self.headroom_bytes / self.budget_bytes

    def table(self) -> str:
        """The trials and the choice, as text."""
        mode = (lambda m: f"{str(m):>11} ") if self.candidates else (lambda m: "")
        lines = [f"{mode('remat')}{'B':>6} {'peak MiB':>10} {'fits':>5} {'s/micro-step':>13}"]
        for t in self.trials:
            peak = "OOM" if t["peak_bytes"] is None else f"{t['peak_bytes'] / 2**20:.1f}"
            seconds = "-" if t["seconds_per_micro_step"] is None else f"{t['seconds_per_micro_step']:.4f}"
            lines.append(f"{mode(t.get('remat'))}{t['micro_batch_size']:>6} {peak:>10} "
                         f"{'yes' if t['fits'] else 'no':>5} {seconds:>13}")
        extra = self.effective_batch_size - self.target_batch_size
        lines.append(
            f"budget {self.budget_bytes / 2**20:.1f} MiB ({self.margin:g} x {self.memory_limit / 2**20:.1f} MiB) "
            f"on {self.device}: {f'remat={self.remat}, ' if self.candidates else ''}"
            f"micro_batch_size={self.micro_batch_size}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}, replicas={self.replicas}, "
            f"effective_batch_size={self.effective_batch_size} (target {self.target_batch_size}"
            + (f", {extra} more)" if extra else ")")
            + f"; planned in {self.seconds:.1f} s"
        )
        headroom = (f"headroom at B={self.micro_batch_size}: {self.headroom_bytes / 2**20:.1f} MiB "
                    f"({100 * self.headroom_fraction:.1f} % of the budget)")
        if self.spread_bytes is not None:
            headroom += (f"; its peak varied by {self.spread_bytes / 2**20:.1f} MiB over {self.repeats} probes "
                         "(a B fits when its largest peak plus that spread does)")
        elif self.backend == "jax":
            headroom += "; XLA's figure is the same at every compile (no spread)"
        else:
            headroom += "; each B probed once (repeats=1): its spread not measured"
        lines.append(headroom)
        if self.backend != "tensorflow":
            lines.append(f"peaks: {self.method}")
        if self.data_parallel > 1 or self.devices > 1:
            lines.append(f"B is the global micro-batch over data_parallel={self.data_parallel} "
                         f"({self.devices} devices); peaks are per device")
        if self.candidates:
            timed = ("its probe's two steps after the trace" if self.backend == "tensorflow"
                     else "three executed steps")
            lines.append(f"candidates, fastest first (samples/s = {self.target_batch_size} / (N x s/micro-step), "
                         f"each timed over {timed}):")
            lines.append(f"{'remat':>11} {'B':>6} {'N':>4} {'peak MiB':>10} {'s/micro-step':>13} {'samples/s':>10}")
            for c in self.candidates:
                if "error" in c:
                    lines.append(f"{str(c['remat']):>11}  not planned, its probe raised: {c['error']}")
                    continue
                lines.append(f"{str(c['remat']):>11} {c['micro_batch_size']:>6} {c['gradient_accumulation_steps']:>4} "
                             f"{c['peak_bytes'] / 2**20:>10.1f} {c['seconds_per_micro_step']:>13.4f} "
                             f"{c['samples_per_second']:>10.1f}")
        if self.balanced_micro_batch_size < self.micro_batch_size:
            lines.append(
                f"closest to the target with N={self.gradient_accumulation_steps}: "
                f"micro_batch_size={self.balanced_micro_batch_size} (effective batch "
                f"{self.balanced_effective_batch_size})"
            )
        return "\n".join(lines)

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON (written whole: a temporary file, then renamed)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Plan":
        """A plan written by :meth:`to_json`."""
        return cls(**json.loads(Path(path).read_text()))

    def plot(self, path: str | os.PathLike) -> Path:
        """Plot the measured peak against B with the budget (matplotlib).

        Raises:
            ImportError: matplotlib is not installed (``pip install
                "accum_optimizer[plan]"``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError('Plan.plot needs matplotlib: pip install "accum_optimizer[plan]" (from a clone: '
                              "pip install '.[plan]').") from None
        path = Path(path)
        measured = sorted((t for t in self.trials if t["peak_bytes"] is not None), key=lambda t: t["micro_batch_size"])
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "does not fit")):
            points = [t for t in measured if t["fits"] == fits]
            ax.scatter([t["micro_batch_size"] for t in points], [t["peak_bytes"] / 2**20 for t in points],
                       color=colour, label=label, zorder=3)
        ax.plot([t["micro_batch_size"] for t in measured], [t["peak_bytes"] / 2**20 for t in measured],
                color="grey", lw=1, zorder=2)
        ax.axhline(self.budget_bytes / 2**20, color="black", ls="--",
                   label=f"budget ({self.margin:g} x limit)")
        ax.axvline(self.micro_batch_size, color="tab:green", ls=":", label=f"B = {self.micro_batch_size}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size B")
        ax.set_ylabel(f"peak memory on {self.device} (MiB)")
        ax.set_title(f"N = {self.gradient_accumulation_steps}, effective batch {self.effective_batch_size} "
                     f"(target {self.target_batch_size})")
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        tmp = path.with_name(path.stem + ".tmp" + path.suffix)
        fig.savefig(tmp, dpi=120)
        plt.close(fig)
        tmp.replace(path)
        return path


def _check_positive_int(value: Any, name: str, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer{' or None' if allow_none else ''}. "
                         f"Received: {name}={value!r}.")
    return value


def gpu_memory_bytes() -> int | None:
    """Total memory of the first GPU (``nvidia-smi``), or ``None`` where
    there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_backend() -> str:
    """Which probe measures this process' Keras: ``"tensorflow"`` (Keras 3
    on TensorFlow, or Keras 2: ``tf_keras`` with ``TF_USE_LEGACY_KERAS=1``,
    or TF <= 2.15's ``tf.keras``), ``"jax"`` or ``"torch"`` (Keras 3's
    backend, ``KERAS_BACKEND``).

    Raises:
        NotImplementedError: Keras 3 on torch where torch sees no CUDA
            device (:func:`accum_optimizer.plan._torch.check_device`: its
            CPU allocator keeps no peak), or on a backend that does not
            train (``numpy``, ``openvino``); the message names the backend
            and what is accepted. A ``RuntimeError``.
    """
    from accum_optimizer._packages import keras3_backend, legacy_keras_requested

    backend = None if legacy_keras_requested() else keras3_backend()
    if backend in (None, "tensorflow"):
        return "tensorflow"
    if backend == "torch":
        from accum_optimizer.plan import _torch

        _torch.check_device()
        return "torch"
    if backend == "jax":
        return "jax"
    raise NotImplementedError(
        f"The planner cannot measure Keras 3 on the {backend!r} backend (KERAS_BACKEND="
        f"{os.environ.get('KERAS_BACKEND', '<unset>')}): it does not train. It accepts Keras 3 on "
        "TensorFlow, JAX, or torch with a CUDA device, and Keras 2 (tf_keras with "
        "TF_USE_LEGACY_KERAS=1, or tf.keras on TensorFlow <= 2.15)."
    )


class _Prober:
    """The probe processes of one search. Every probe runs in a process of
    its own, so it measures what a fresh training process holds (TensorFlow
    keeps buffers of a cleared model alive, and a process's first model
    pays one-time allocations: a reused process measures neither
    faithfully). Two ways to get there without importing TensorFlow per
    probe:

    * ``fork`` (Linux): one server process (:mod:`accum_optimizer.plan._probe`
      ``--fork``) imports TensorFlow, this package and the user's ``build``
      and ``batch`` once, and forks a child per probe: a fresh TensorFlow
      runtime each, since none was started before the fork. If the user's
      modules start TensorFlow's runtime at import, forking is unsafe: the
      server says so and the spawn route is taken.
    * ``spawn`` (elsewhere): a process per probe (``--wait``), started
      ahead: while one probe trains, the next ones (``AHEAD``) already
      import, then wait for their size; while a probe times its two steps
      they are paused (``SIGSTOP``/``SIGCONT``; without such signals the
      probe waits for their imports), so no import shares the CPU with the
      timed steps.

    Use as a context manager; :meth:`close` stops the processes."""

    AHEAD = 2  # an import (about 3 s here) is several small probes long: two import at once on 2 cores

    def __init__(self, build: str, batch: str, timeout: float = 1800, remat: str | None = None,
                 fork: bool | None = None):
        import collections

        self.build, self.batch, self.timeout, self.remat = build, batch, timeout, remat
        # None: fork where it can (Linux); the server's answer may still turn it off.
        self.fork = sys.platform.startswith("linux") and hasattr(os, "fork") if fork is None else fork
        self.server: tuple | None = None  # the fork server: (process, its stderr file)
        self.seconds: dict = {}  # micro_batch_size -> the last probe's seconds per micro-step
        self.spares: collections.deque = collections.deque()  # (process, its stderr file), oldest first
        self.processes_started = 0
        self.ready: set = set()  # pids of the started processes known to have imported

    def __enter__(self) -> "_Prober":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        while self.spares:
            self._stop(*self.spares.popleft())
        if self.server is not None:
            self._stop(*self.server)
            self.server = None

    @staticmethod
    def _stop(process: subprocess.Popen, stderr: Any) -> None:
        import signal

        if process.poll() is None:
            try:  # its process group: a fork server's child too
                os.killpg(process.pid, signal.SIGKILL)
            except (AttributeError, OSError):
                process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout, stderr):
            stream.close()

    def _start(self, mode: str = "--wait") -> tuple:
        import tempfile

        # The probe imports what this process can (its sys.path: where
        # `build` and `batch` were found).
        path = [p or os.getcwd() for p in sys.path]
        env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3",
               "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}
        stderr = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(
            [sys.executable, "-m", "accum_optimizer.plan._probe", mode, self.build, self.batch],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
            start_new_session=True)  # its own process group, killed whole
        self.processes_started += 1
        return process, stderr

    def _ready(self, process: subprocess.Popen) -> None:
        """Wait for a started process's imports: its ``PROBE_READY`` line
        (nothing more if it dies; killed after the timeout)."""
        import threading

        from accum_optimizer.plan import _probe

        if process.pid in self.ready:
            return
        timer = threading.Timer(self.timeout, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                if line.startswith(_probe.READY):
                    break
        finally:
            timer.cancel()
        self.ready.add(process.pid)

    def _quiet(self) -> list:
        """Pause the spare processes for a probe's timed steps; the paused
        ones (to resume with ``SIGCONT``)."""
        import signal

        if not hasattr(signal, "SIGSTOP"):
            for process, _ in self.spares:
                self._ready(process)
            return []
        paused = [process for process, _ in self.spares if process.poll() is None]
        for process in paused:
            os.kill(process.pid, signal.SIGSTOP)
        return paused

    @staticmethod
    def _resume(paused: list) -> None:
        import signal

        for process in paused:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)

    def _fork_server(self) -> tuple | None:
        """The running fork server (started on first use), or ``None`` once
        it said that it cannot fork (then ``self.fork`` is false)."""
        from accum_optimizer.plan import _probe

        if self.server is not None and self.server[0].poll() is None:
            return self.server
        if self.server is not None:
            self._stop(*self.server)
        self.server = self._start("--fork")
        line = self.server[0].stdout.readline()
        if not line.startswith(_probe.READY) or not json.loads(line[len(_probe.READY):] or "{}").get("forkable"):
            self._stop(*self.server)
            self.server, self.fork = None, False
        return self.server

    def _talk(self, process: subprocess.Popen, micro_batch_size: int, budget_bytes: int | None,
              kill: Callable[[], None], quiet: Callable[[], list]) -> list:
        """Send a probe process its spec, let it time its steps once
        ``quiet()`` paused what else runs (resumed after), and return its
        output lines up to its result (or its end: ``kill()`` at the
        timeout)."""
        import threading

        from accum_optimizer.plan import _probe

        timer = threading.Timer(self.timeout, kill)
        timer.start()
        output, paused = [], []
        try:
            process.stdin.write(json.dumps({"micro_batch_size": micro_batch_size, "budget_bytes": budget_bytes,
                                           "remat": self.remat}) + "\n")
            process.stdin.flush()
            for line in process.stdout:
                output.append(line)
                if line.startswith(_probe.TRACED):
                    paused = quiet()
                    process.stdin.write("\n")
                    process.stdin.flush()
                elif line.startswith((_probe.PREFIX, _probe.EXIT)):
                    break
        except (BrokenPipeError, ValueError):  # the process died (killed at the timeout)
            pass
        finally:
            timer.cancel()
            self._resume(paused)
        return output

    def _measure_forked(self, micro_batch_size: int, budget_bytes: int | None) -> dict:
        """One probe in a child of the fork server."""
        from accum_optimizer.plan import _probe

        process, stderr = self.server
        output = self._talk(process, micro_batch_size, budget_bytes, lambda: self._stop(process, stderr), list)
        last = output[-1] if output else ""
        result = last if last.startswith((_probe.PREFIX, _probe.EXIT)) else None
        if result is None or result.startswith(_probe.EXIT):
            code = json.loads(result[len(_probe.EXIT):])["returncode"] if result else None
            errors = ""
            if not stderr.closed:
                stderr.seek(0)
                errors = stderr.read()
            if result is None:  # the server itself died: the next probe starts a new one
                self._stop(process, stderr)
                self.server = None
            if code is None or code < 0:  # killed (the kernel's out-of-memory killer, or the timeout)
                return {"micro_batch_size": micro_batch_size, "peak_bytes": None, "seconds_per_micro_step": None,
                        "oom": True, "device": None, "gpus": 0}
            raise RuntimeError(
                f"The probe at micro_batch_size={micro_batch_size} exited with status {code} and no result. "
                f"Its output:\n{''.join(output)[-4000:]}\n{errors[-4000:]}"
            )
        return self._result(micro_batch_size, json.loads(result[len(_probe.PREFIX):]))

    def time_step(self, micro_batch_size: int) -> float | None:
        """The seconds per micro-step the last probe of that size measured
        (its two steps after the trace, timed with the spare processes paused)."""
        return self.seconds.get(micro_batch_size)

    def measure(self, micro_batch_size: int, budget_bytes: int | None = None, ahead: bool = True) -> dict:
        """One probe in a fresh process (see :func:`probe`), the model built
        under ``keras.RematScope(mode=self.remat)`` if that is set; with
        ``ahead``, the next probe's process is started before this one
        reports."""
        from accum_optimizer.plan import _probe

        if self.fork and self._fork_server() is not None:
            return self._measure_forked(micro_batch_size, budget_bytes)
        process, stderr = self.spares.popleft() if self.spares else self._start()
        while ahead and len(self.spares) < self.AHEAD:
            self.spares.append(self._start())
        output = self._talk(process, micro_batch_size, budget_bytes, process.kill, self._quiet)
        process.wait()
        out = "".join(output)
        stderr.seek(0)
        errors = stderr.read()
        self._stop(process, stderr)
        lines = [line for line in out.splitlines() if line.startswith(_probe.PREFIX)]
        if not lines:
            if process.returncode < 0:  # killed (the kernel's out-of-memory killer): does not fit
                return {"micro_batch_size": micro_batch_size, "peak_bytes": None, "seconds_per_micro_step": None,
                        "oom": True, "device": None, "gpus": 0}
            raise RuntimeError(
                f"The probe at micro_batch_size={micro_batch_size} exited with status {process.returncode} and no "
                f"result. Its output:\n{out[-4000:]}\n{errors[-4000:]}"
            )
        return self._result(micro_batch_size, json.loads(lines[-1][len(_probe.PREFIX):]))

    def _result(self, micro_batch_size: int, result: dict) -> dict:
        if "error" in result:
            raise RuntimeError(
                f"Building the model ({self.build}) or its batch ({self.batch}) at micro_batch_size="
                f"{micro_batch_size}{'' if self.remat is None else f' under keras.RematScope(mode={self.remat!r})'}"
                f" raised, in the probe process:\n{result['error']}"
            )
        if result.get("seconds_per_micro_step") is not None:
            self.seconds[micro_batch_size] = result["seconds_per_micro_step"]
        return result


def probe(build: str, batch: str, micro_batch_size: int, budget_bytes: int | None = None,
          timeout: float = 1800, remat: str | None = None) -> dict:
    """Measure one micro-batch size in a fresh process
    (:mod:`accum_optimizer.plan._probe`), the model built under
    ``keras.RematScope(mode=remat)`` when ``remat`` is given.

    Returns:
        ``{"micro_batch_size", "peak_bytes", "seconds_per_micro_step",
        "oom", "device", "gpus"}`` (``peak_bytes`` ``None`` after an
        out-of-memory error, or when the process was killed).

    Raises:
        RuntimeError: the build or batch function (or anything but an
            out-of-memory error) raised in the probe; the message holds its
            traceback.
    """
    with _Prober(build, batch, timeout, remat=remat, fork=False) as prober:  # one process, nothing to fork
        return prober.measure(micro_batch_size, budget_bytes, ahead=False)


def _error_summary(text: str) -> str:
    """The exception line of a probe's traceback (``Type: message``), with
    the next line of a Keras layer's wrapped error, for one row of a table."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines()]
    found = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b:", line)]
    if not found:
        return lines[-1][:300] if lines else ""
    i = found[-1]
    more = next((line for line in lines[i + 1:] if line and not line.startswith(("Arguments received", "•"))), "")
    return (lines[i] + (" " + more if more else ""))[:300]


REMAT_MODES = ("full", "activations")
"""The ``keras.RematScope`` modes ``remat=True`` plans: every layer's call
rematerialised, or its activation only. (``"larger_than"`` and
``"list_of_layers"`` need a threshold or names: not planned here.)"""


def _check_remat(remat: Any, backend: str) -> tuple:
    """``remat`` as a tuple of modes (empty for none), checked."""
    if remat is None or remat is False:
        return ()
    modes = REMAT_MODES if remat is True else (remat,) if isinstance(remat, str) else remat
    if not isinstance(modes, (tuple, list)) or not modes or any(m not in REMAT_MODES for m in modes):
        raise ValueError(f"`remat` must be True, False, None, or one or more of {REMAT_MODES} (keras.RematScope "
                         f"modes). Received: remat={remat!r}.")
    if backend not in ("jax", "tensorflow"):
        raise ValueError(f"`remat` is planned on JAX and TensorFlow; this is Keras on {backend} (its planner "
                         f"measures a CUDA device only, untested with remat): run with KERAS_BACKEND=jax or "
                         f"tensorflow, or without remat. Received: remat={remat!r}.")
    return tuple(dict.fromkeys(modes))


def _remat_scoped(build: Callable[[], Any], mode: str) -> Callable[[], Any]:
    """``build`` under ``keras.RematScope(mode=mode)`` (a layer takes its
    remat mode when it is created)."""

    def scoped() -> Any:
        import keras

        with keras.RematScope(mode=mode):
            return build()

    return scoped


def plan_accumulation(
    build: str,
    batch: str,
    target_batch_size: int,
    memory_limit: Any = None,
    margin: float = 0.9,
    max_micro_batch_size: int | None = None,
    multiple_of: int = 1,
    replicas: int | None = None,
    start: int = 1,
    verbose: bool = True,
    log: Callable[[str], None] = print,
    repeats: int = 1,
    remat: Any = None,
) -> Plan:
    """Find the largest micro-batch size that fits, and the N that reaches
    ``target_batch_size`` with it, by measurement.

    Args:
        build: importable ``"module:function"``; the function (no arguments)
            returns a compiled Keras model (any optimizer; Keras 3 on
            TensorFlow, JAX or torch with CUDA, or Keras 2: see
            :func:`check_backend`). On JAX, a ``keras.distribution`` active
            once it returns (set in it, or before this call) makes the plan
            per device, B the global micro-batch.
        batch: importable ``"module:function"``; ``function(B)`` returns one
            batch of B samples, ``(x, y)`` or ``(x, y, sample_weight)``.
        target_batch_size: the effective batch wanted (samples per update).
        memory_limit: bytes, or a string with a unit (``"10GiB"``); default:
            the first GPU's total memory (required where there is no GPU).
            Per device under a distribution.
        margin: a probe fits if its peak (plus its spread, ``repeats > 1``)
            is at most ``margin * memory_limit`` (and it raised no
            out-of-memory error), in (0, 1].
        max_micro_batch_size: an upper bound for B; B never exceeds
            ``target_batch_size`` either.
        multiple_of: B is a multiple of this (8 for tensor cores); under a
            distribution, of its least common multiple with the data-parallel
            size too.
        replicas: devices training in sync (each takes B per micro-step);
            default: the number of GPUs the probe sees on TensorFlow, 1 on
            JAX and torch. Not under a distribution (B is global there).
        start: the first B tried (rounded up to a multiple of ``multiple_of``).
        verbose: print one line per probe, then the table, through ``log``.
        repeats: probe each B this many times (an int >= 1; stops at the
            first that does not fit); its peak is the largest, its spread
            the largest minus the smallest, and it fits when peak plus
            spread is within the budget. On JAX every repeat gives the same
            figure.
        remat: on JAX and TensorFlow (Keras 3), also plan the model built
            under ``keras.RematScope(mode=...)``: ``True`` for every mode in
            :data:`REMAT_MODES`, or one mode or a list of them; ``None`` or
            ``False`` (default) for none. Each mode (and no remat) gets its
            own search; the largest B of each is timed over three executed
            steps (on TensorFlow, its probe's two steps after the trace),
            and the candidates are ranked by samples per second at the
            target, ``T / (N * seconds_per_micro_step)``, fastest first
            (:attr:`Plan.candidates`); the plan is the fastest. A mode whose
            probe raises (Keras cannot apply it to the model) is listed
            last, as ``{"remat": mode, "error": "Type: message"}``.

    Returns:
        The :class:`Plan`.

    Raises:
        ValueError: a bad argument (each message names it and the value
            received); ``build`` or ``batch`` cannot be imported;
            ``replicas`` given under a ``keras.distribution``; ``remat``
            not a mode of :data:`REMAT_MODES`, or given off JAX.
        RuntimeError: the build or batch function raised in a probe (its
            traceback in the message); the model does not fit even at the
            smallest B (the message gives the bytes it needed and the budget).
        NotImplementedError: Keras 3 on torch without a CUDA device, before
            any probe (:func:`check_backend`).
    """
    began = time.perf_counter()
    target_batch_size = _check_positive_int(target_batch_size, "target_batch_size")
    multiple_of = _check_positive_int(multiple_of, "multiple_of")
    max_micro_batch_size = _check_positive_int(max_micro_batch_size, "max_micro_batch_size", allow_none=True)
    replicas = _check_positive_int(replicas, "replicas", allow_none=True)
    start = _check_positive_int(start, "start")
    repeats = _check_positive_int(repeats, "repeats")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin <= 1:
        raise ValueError(f"`margin` must be a number in (0, 1]. Received: margin={margin!r}.")
    backend = check_backend()
    remat_modes = _check_remat(remat, backend)
    build_function = load_function(build, "build")
    batch_function = load_function(batch, "batch")
    if memory_limit is None:
        memory_limit = gpu_memory_bytes()
        if memory_limit is None:
            raise ValueError(
                "`memory_limit` is required where there is no GPU (none found by nvidia-smi): give the "
                "bytes the training may use, e.g. memory_limit='8GiB'. Received: memory_limit=None."
            )
    memory_limit = parse_bytes(memory_limit, "memory_limit")
    budget = int(margin * memory_limit)

    def largest(multiple: int) -> int:
        top = min(target_batch_size, max_micro_batch_size or target_batch_size)
        top -= top % multiple
        if top < 1:
            raise ValueError(
                f"No micro-batch size is a multiple of multiple_of={multiple} and at most "
                f"min(target_batch_size={target_batch_size}, max_micro_batch_size={max_micro_batch_size})."
            )
        return top

    maximum = largest(multiple_of)
    trials: list[dict] = []
    seen: dict = {}

    def open_prober(mode: str | None) -> Any:
        if backend == "tensorflow":
            return _Prober(build, batch, remat=mode)
        if backend == "jax":
            from accum_optimizer.plan._jax import JaxProbe

            return JaxProbe(build_function if mode is None else _remat_scoped(build_function, mode), batch_function)
        from accum_optimizer.plan._torch import TorchProbe

        return TorchProbe(build_function, batch_function, budget)

    def fits(size: int) -> bool:
        peaks, result, ok = [], None, True
        probe_began = time.perf_counter()
        for _ in range(repeats):
            result = prober.measure(size, budget)
            seen.update(device=result.get("device") or seen.get("device"), gpus=result.get("gpus", 0))
            if result["oom"] or result["peak_bytes"] is None:
                peaks, ok = None, False
                break
            peaks.append(result["peak_bytes"])
            if max(peaks) + (max(peaks) - min(peaks)) > budget:
                ok = False
                break
        peak = None if peaks is None else max(peaks)
        spread = None if peaks is None or repeats == 1 else max(peaks) - min(peaks)
        trial = {"micro_batch_size": size, "peak_bytes": peak, "fits": ok,
                 "seconds_per_micro_step": result["seconds_per_micro_step"] if peak is not None else None}
        if repeats > 1:
            trial.update(peaks=peaks, spread_bytes=spread)
        if result.get("memory") is not None:
            trial["memory"] = result["memory"]
        if backend != "tensorflow":
            trial["probe_seconds"] = time.perf_counter() - probe_began
        if remat_modes:
            trial["remat"] = mode
        trials.append(trial)
        if verbose:
            text = "out of memory" if peak is None else f"peak {peak / 2**20:.1f} MiB"
            if spread is not None:
                text += f" (spread {spread / 2**20:.1f} MiB over {len(peaks)} probes)"
            log(f"[plan] {f'remat={mode} ' if remat_modes else ''}B={size}: {text}, "
                f"{'fits' if ok else 'does not fit'} (budget {budget / 2**20:.1f} MiB)")
        return ok

    all_trials: list[dict] = []
    candidates: list[dict] = []
    method, data_parallel, devices = Plan.method, 1, 1
    for mode in (None, *remat_modes):
        trials = []  # this mode's (linear_estimate reads them)
        prober = open_prober(mode)
        method = getattr(prober, "method", Plan.method)
        data_parallel, devices = getattr(prober, "data_parallel", 1), getattr(prober, "devices", 1)
        distribution = getattr(prober, "distribution", None)
        seen.update(device=getattr(prober, "device", None) or seen.get("device"), gpus=0)
        seconds = None
        with prober:
            if distribution is not None:
                if replicas not in (None, 1):
                    raise ValueError(
                        f"`replicas` is not used under a keras.distribution ({type(distribution).__name__}): B is "
                        f"the global micro-batch, split over its data-parallel axis. Received: "
                        f"replicas={replicas!r}."
                    )
                multiple_of = math.lcm(multiple_of, data_parallel)
                maximum = largest(multiple_of)
            try:
                chosen = search_micro_batch_size(fits, maximum, start, multiple_of,
                                                 estimate=linear_estimate(trials, budget))
            except RuntimeError as e:  # a mode Keras cannot apply to this model (its probe raised)
                if mode is None:
                    raise
                all_trials.extend(trials)
                candidates.append({"remat": mode, "error": _error_summary(str(e))})
                continue
            if remat_modes and chosen is not None:
                seconds = prober.time_step(chosen)
        all_trials.extend(trials)
        if chosen is not None:
            peak = next(t["peak_bytes"] for t in trials if t["micro_batch_size"] == chosen)
            steps = -(-target_batch_size // (chosen * (replicas or 1)))
            candidates.append({"remat": mode, "micro_batch_size": chosen, "gradient_accumulation_steps": steps,
                               "peak_bytes": peak, "seconds_per_micro_step": seconds,
                               "samples_per_second": None if seconds is None else
                               target_batch_size / (steps * seconds)})
    trials = all_trials
    if not any("error" not in c for c in candidates):
        first = trials[0]
        needed = "an out-of-memory error" if first["peak_bytes"] is None else f"{first['peak_bytes']} bytes"
        raise RuntimeError(
            f"The model does not fit even at micro_batch_size={first['micro_batch_size']}: it needed "
            f"{needed} against a budget of {budget} bytes (margin={margin} x memory_limit={memory_limit}). "
            "Raise memory_limit or margin, or make the model smaller (mixed precision, fewer parameters)."
            + (" No remat mode fitted either." if remat_modes else "")
        )
    if remat_modes:
        candidates.sort(key=lambda c: -c.get("samples_per_second", -1.0))  # a mode that raised, last
    best = candidates[0]
    chosen, remat_chosen = best["micro_batch_size"], best["remat"]
    if backend == "tensorflow":
        replicas = replicas or max(1, int(seen.get("gpus") or 0))
    else:
        replicas = replicas or 1
    steps = -(-target_batch_size // (chosen * replicas))
    chosen_trial = next(t for t in trials if t["micro_batch_size"] == chosen and t.get("remat") == remat_chosen)
    plan = Plan(
        micro_batch_size=chosen, gradient_accumulation_steps=steps, effective_batch_size=steps * chosen * replicas,
        peak_bytes=chosen_trial["peak_bytes"], target_batch_size=target_batch_size, memory_limit=memory_limit,
        margin=float(margin), replicas=replicas, multiple_of=multiple_of, max_micro_batch_size=maximum,
        device=seen.get("device") or "CPU:0", trials=trials, seconds=time.perf_counter() - began,
        backend=backend, method=method, data_parallel=data_parallel, devices=devices, repeats=repeats,
        spread_bytes=chosen_trial.get("spread_bytes"), remat=remat_chosen, candidates=candidates if remat_modes else [],
    )
    if verbose:
        log(plan.table())
    return plan
