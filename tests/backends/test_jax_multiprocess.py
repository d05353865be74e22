"""Several processes on JAX: two processes x two CPU devices each on
127.0.0.1, JAX's distributed runtime (``keras.distribution.initialize``,
gloo CPU collectives) and ``keras.distribution.DataParallel(
auto_shard_dataset=False)`` over the four devices, each process feeding
``fit`` its share of every global micro-batch.

The worker script, ``tests/support/jax_multiprocess_worker.py``, trains
``AccumulatingOptimizer(AdamW with an ExponentialDecay schedule, N=3)``;
the setting is in ``tests/support/jax_multiprocess_setup.py``. Two launches
(a module fixture: 23 to 28 s of the module's 28 to 34 s on 2 CPU cores
shared with other jobs):

1. both processes train uninterrupted; then both start the same run again,
   save with ``model.save_weights`` after 7 micro-steps (2 updates and one
   micro-step into the third window) and are SIGKILLed;
2. both restart, ``model.load_weights`` into the compiled model, and finish.

The reference is independent: the plain inner optimizer in this process,
one device, no accumulation, ``fit(batch_size=N*B)`` on the global data.

Runs in the k3-jax leg of ``make test``; skips elsewhere (no JAX, or Keras
on another backend).
"""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("jax") is None:
    pytest.skip("needs JAX (its distributed runtime and CPU collectives); the k3-jax leg runs this",
                allow_module_level=True)
try:
    import keras
except ImportError as e:  # (Keras on its default backend, TensorFlow, not installed here)
    pytest.skip(f"needs Keras 3 on JAX (the k3-jax leg runs this); importing keras failed: {e}",
                allow_module_level=True)
if not keras.__version__.startswith("3.") or keras.backend.backend() != "jax":
    pytest.skip(f"needs Keras 3 on JAX; here Keras {keras.__version__} on {keras.backend.backend()!r} "
                "(the k3-jax leg runs this)", allow_module_level=True)

from support import jax_multiprocess_setup as S  # noqa: E402
from support.arrays import assert_bitwise_equal, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.multiworker

WORKER = Path(__file__).resolve().parents[1] / "support" / "jax_multiprocess_worker.py"
LAUNCH_TIMEOUT = 300  # seconds per launch (10 to 14 s each on 2 busy cores)
ULPS_PER_UPDATE = 2  # see _tolerance


def _tolerance(reference_weights: list) -> float:
    """How far the four-device run may end from the large batch: the two
    runs do the same float32 arithmetic but for the order in which each
    gradient is summed (2 rows per device, an all-reduce over 4 devices in
    2 processes, 3 micro-batches accumulated; or 24 rows on one device).
    That changes a gradient element by a few float32 roundings relative,
    which AdamW's step (invariant to the gradient's scale) turns into a
    relative change of the same order of a step of at most ``lr <= 0.02``:
    some 1e-9 of the weight, far under one ulp of it. What remains, to
    first order, is the rounding of ``w + step`` (and of the decay
    ``lr * wd * w``) landing on different float32 neighbours: one ulp of
    the weight per update, carried on. So ``ULPS_PER_UPDATE`` (2: that ulp,
    and as much again for what it carries into the next gradients) ulps of
    the largest weight per update, ``4 * 2 * spacing(0.72) = 4.8e-07``
    here; one ulp, 5.96e-08, measured. The controls end more than 1e-2
    away."""
    largest = max(float(np.abs(w).max()) for w in reference_weights)
    return S.MICRO_STEPS // S.N * ULPS_PER_UPDATE * float(np.spacing(np.float32(largest)))


def _launch(out: Path, name: str, runs: str, wait_for: list | None = None) -> None:
    """One launch of both processes; retried once with a new port if the
    coordinator's port was taken in between."""
    argv = [str(WORKER), "--out", str(out), "--run", runs]
    for attempt in range(2):
        try:
            with S.Processes(argv, out / "logs" / f"{name}.{attempt}") as processes:
                if wait_for is None:
                    processes.wait(LAUNCH_TIMEOUT)
                else:  # then the `with` SIGKILLs both
                    processes.wait_for_files(wait_for, LAUNCH_TIMEOUT)
            return
        except S.ProcessError as e:
            if attempt == 0 and any(s in str(e) for s in ("Address already in use", "Failed to add port")):
                continue
            host = socket.gethostname()
            try:
                resolved = socket.gethostbyname(host)
            except OSError as error:
                resolved = f"nothing ({error})"
            # gloo listens on the address the machine's hostname resolves to.
            raise S.ProcessError(f"{e}\n(hostname {host!r} resolves to {resolved})") from None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_multiprocess")
    saved = [out / f"saved.process{i}" for i in range(S.PROCESSES)]
    _launch(out, "launch1", "uninterrupted,start", wait_for=saved)
    _launch(out, "launch2", "resume")

    def load(name):
        return [json.loads((out / f"{name}.process{i}{'' if name == 'saved' else '.json'}").read_text())
                for i in range(S.PROCESSES)]

    return {name: load(name) for name in ("uninterrupted", "saved", "resume")}


def _arrays(values) -> list:
    return [np.asarray(v, dtype=np.float32) for v in values]


def _large_batch(x, y, batch_size: int):
    """The plain inner optimizer, one process, one device, no accumulation."""
    assert keras.distribution.distribution() is None, "a test left a keras.distribution set"
    assert keras.config.dtype_policy().name == "float32", keras.config.dtype_policy()
    model = S.make_mlp(keras)
    initial = model.get_weights()
    model.compile(optimizer=S.make_inner(keras), loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model, initial


def _names(paths: list) -> list:
    """Variable paths without the optimizer's unique name (``adam_w_1/...``
    in a second run of the same process)."""
    return [p.rsplit("/", 1)[1] for p in paths]


def _assert_processes_identical(results: list[dict]) -> None:
    first, second = results
    for key in ("weights", "optimizer_variables"):
        assert_bitwise_equal(_arrays(first[key]), _arrays(second[key]), f"process 1's {key}")
    assert (first["micro_steps"], first["iterations"]) == (second["micro_steps"], second["iterations"])


def test_two_processes_train_like_the_single_process_large_batch(runs):
    """Four devices in two processes, micro-batches of B = 8 (4 rows fed by
    each process, 2 per device), N = 3, 12 micro-steps: the weights of both
    processes equal one device's ``fit(batch_size=24)`` within
    :func:`_tolerance` (4.8e-07), and each other bit for bit."""
    results = runs["uninterrupted"]
    x, y = S.data()
    reference, initial = _large_batch(x, y, S.N * S.B)
    tol = _tolerance(reference.get_weights())
    for i, r in enumerate(results):
        assert (r["process_count"], r["device_count"], r["batch_axis_devices"]) == (
            S.PROCESSES, S.PROCESSES * S.DEVICES_PER_PROCESS, S.PROCESSES * S.DEVICES_PER_PROCESS)
        assert r["micro_steps"] == S.MICRO_STEPS
        updates = int(keras.ops.convert_to_numpy(reference.optimizer.iterations))
        assert r["iterations"] == S.MICRO_STEPS // S.N == updates
        diff = max_abs_diff(_arrays(r["weights"]), reference.get_weights())
        print(f"process {i}: max |dw| from the large batch {diff:.3g} (tolerance {tol:.3g})")
        assert diff <= tol, (diff, tol)  # (pytest -rP shows the figures)
    _assert_processes_identical(results)
    # The comparison means something: training moved the weights, and a
    # process that trained on its own share alone (no reduction across the
    # processes) would end far away.
    assert max_abs_diff(reference.get_weights(), initial) > 1e-2
    alone, _ = _large_batch(S.process_share(x, 0), S.process_share(y, 0), S.N * S.B // S.PROCESSES)
    assert max_abs_diff(_arrays(results[0]["weights"]), alone.get_weights()) > 1e-2


def test_resume_after_sigkill_mid_window_is_bitwise_uninterrupted(runs):
    """Saved with ``model.save_weights`` after 7 micro-steps (2 updates and
    one micro-batch of the third window in the accumulators), both
    processes SIGKILLed, restarted, ``model.load_weights`` into the
    compiled model, ``fit`` on the remaining 5 micro-batches: the restored
    state is the saved one, and the finished weights, optimizer variables
    (accumulators, counters, AdamW's moments) and counters equal the
    uninterrupted run's bit for bit, in both processes."""
    for saved, resumed, uninterrupted in zip(runs["saved"], runs["resume"], runs["uninterrupted"]):
        assert (saved["micro_steps"], saved["iterations"]) == (S.SAVE_AFTER, S.SAVE_AFTER // S.N)
        # A partial window was saved: the accumulators hold its gradient.
        accumulators = [a for p, a in zip(saved["optimizer_paths"], _arrays(saved["optimizer_variables"]))
                        if p.endswith("_acc_grad")]
        assert accumulators and all(np.any(a != 0) for a in accumulators)
        restored = resumed["restored"]
        assert _names(restored["optimizer_paths"]) == _names(saved["optimizer_paths"])
        for key in ("weights", "optimizer_variables"):
            assert_bitwise_equal(_arrays(restored[key]), _arrays(saved[key]), f"restored {key}")
        assert (restored["micro_steps"], restored["iterations"]) == (saved["micro_steps"], saved["iterations"])

        assert _names(resumed["optimizer_paths"]) == _names(uninterrupted["optimizer_paths"])
        for key in ("weights", "optimizer_variables"):
            assert_bitwise_equal(_arrays(resumed[key]), _arrays(uninterrupted[key]), f"resumed {key}")
        assert (resumed["micro_steps"], resumed["iterations"]) == (S.MICRO_STEPS, S.MICRO_STEPS // S.N)
    _assert_processes_identical(runs["resume"])
