"""One probe of the planner, in a fresh process: ``python -m
accum_optimizer.plan._probe '<json>'`` prints one line, ``PROBE_RESULT
<json>``. ``python -m accum_optimizer.plan._probe --wait BUILD BATCH``
first imports TensorFlow, this package and the user's two functions, then
reads its spec (``{"micro_batch_size", "budget_bytes", "remat"}``) as one JSON line
from standard input: the planner starts it while the previous probe still
trains, so that the imports are not on the search's critical path. It
prints ``PROBE_READY`` once imported, and ``PROBE_TRACED`` after its first
step, then waits for a line before the two timed steps: the planner sends
it once the next probe's process is ready (idle), so that no import shares
the CPU with the steps that are timed.

It builds the user's model (under ``keras.RematScope(mode=spec["remat"])``
when that is given), wraps its optimizer in
``AccumulatingOptimizer(inner, 2)`` (recompiled with the model's loss), and
trains three steps on one batch of size B: an accumulate-only micro-step
(which traces the step), the micro-step that updates, and one more
accumulate-only micro-step, so that the accumulators, the inner optimizer's
slots and the update's temporaries have all been allocated. It reports the
peak of TensorFlow's allocator over those steps (``get_memory_info``'s
``"peak"`` after ``reset_memory_stats``, taken once the model and the batch
exist, so the weights count): on a GPU the device's, capped at the planner's
budget (a logical device with that memory, so a batch that does not fit
fails with a real out-of-memory error); on the CPU the BFC allocator's
(``TF_CPU_ALLOCATOR_USE_BFC=true``, set by the planner). The seconds per
micro-step are the mean of the two steps after the first.

An out-of-memory error is reported as such; any other exception (the user's
build or batch function raising) as its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

PREFIX = "PROBE_RESULT "
READY, TRACED = "PROBE_READY", "PROBE_TRACED"  # imports done; first step done, waiting to time
EXIT = "PROBE_EXIT"  # --fork: a child died without a result


def _configure(budget_bytes: int | None) -> bool:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and budget_bytes:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=max(1, int(budget_bytes // 2**20)))])
    return bool(gpus)


def _accumulating(optimizer: Any, wrapper: Any) -> Any:
    """``AccumulatingOptimizer(inner, 2)`` for the model's ``optimizer``: a
    ``LossScaleOptimizer`` is unwrapped (``compile`` puts it back under a
    mixed policy); an ``AccumulatingOptimizer`` is rebuilt from its config
    with N = 2."""
    if not isinstance(optimizer, wrapper) and getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, wrapper):
        return wrapper.from_config({**optimizer.get_config(), "gradient_accumulation_steps": 2})
    return wrapper(optimizer, 2)


def remat_scope(mode: str | None) -> Any:
    """``keras.RematScope(mode=mode)`` around the model's build (Keras reads
    the scope when a layer is created), or nothing for ``None``.

    Raises:
        ValueError: ``mode`` given while ``tf.keras`` is Keras 2 (``tf_keras``
            or TF <= 2.15), which has no ``RematScope``.
    """
    import contextlib

    if mode is None:
        return contextlib.nullcontext()
    from accum_optimizer import _packages

    kind, package = _packages.active_keras()
    if kind != "keras3":
        raise ValueError(f"`remat`={mode!r} needs Keras 3's keras.RematScope; this model's Keras is "
                         f"{package.__name__} {package.__version__} (Keras 2 has no rematerialisation scope).")
    return package.RematScope(mode=mode)


def measure(spec: dict, before_timing: Any = None) -> dict:
    """Train the three steps of one probe (``spec``: build, batch, the micro
    batch size, the budget) and return its figures; ``before_timing()``, if
    given, is called after the first step (the trace), before the two timed
    ones."""
    from accum_optimizer.plan import load_function

    gpu = _configure(spec.get("budget_bytes"))
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    device = "GPU:0" if gpu else "CPU:0"
    result: dict[str, Any] = {"micro_batch_size": spec["micro_batch_size"], "device": device, "pid": os.getpid(),
                              "gpus": len(tf.config.list_physical_devices("GPU"))}
    build, make_batch = load_function(spec["build"], "build"), load_function(spec["batch"], "batch")
    result["remat"] = spec.get("remat")
    try:
        with remat_scope(spec.get("remat")):
            model = build()
        batch = make_batch(spec["micro_batch_size"])
        model.compile(optimizer=_accumulating(model.optimizer, AccumulatingOptimizer), loss=model.loss)
        tf.config.experimental.reset_memory_stats(device)
        times = []
        for step in range(3):
            if step == 1 and before_timing is not None:
                before_timing()
            start = time.perf_counter()
            model.train_on_batch(*batch) if isinstance(batch, (tuple, list)) else model.train_on_batch(batch)
            times.append(time.perf_counter() - start)
        result["peak_bytes"] = int(tf.config.experimental.get_memory_info(device)["peak"])
        result["seconds_per_micro_step"] = sum(times[1:]) / 2
        result["oom"] = False
    except tf.errors.ResourceExhaustedError:
        result.update(peak_bytes=None, seconds_per_micro_step=None, oom=True)
    return result


def _preload(build: str, batch: str) -> None:
    """Import what a probe needs before its size is known; a failure is
    reported by the probe itself (``measure`` imports again and raises)."""
    try:
        import tensorflow  # noqa: F401

        import accum_optimizer  # noqa: F401
        from accum_optimizer.plan import load_function

        if build:
            load_function(build, "build"), load_function(batch, "batch")
    except BaseException:  # noqa: BLE001 - measure() raises it again, and reports it
        pass


def _threads() -> int | None:
    """The process's OS threads (Linux's ``/proc/self/task``), or ``None``."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _answer(spec: dict, before_timing: Any) -> None:
    """Measure ``spec`` and write its ``PROBE_RESULT`` line."""
    try:
        result = measure(spec, before_timing)
    except BaseException:  # noqa: BLE001 - the parent shows the child's traceback
        result = {"micro_batch_size": spec.get("micro_batch_size"), "error": traceback.format_exc()}
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def _wait_for_go() -> None:  # the planner answers once nothing else runs beside the timed steps
    sys.stdout.write(TRACED + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


def fork_server(build: str, batch: str) -> int:
    """``--fork``: import TensorFlow, this package and the user's two
    functions once, then answer each spec line of standard input in a child
    forked for it (a fresh TensorFlow runtime: none was started here), and
    report a child that died without a result as ``PROBE_EXIT <json>``.
    ``PROBE_READY {"forkable": ...}`` first: false if the user's modules
    started TensorFlow's runtime at import (its threads; forking a process
    with a running runtime is unsafe), and the planner then starts a
    process per probe instead."""
    _preload("", "")  # TensorFlow and this package
    before = _threads()
    _preload(build, batch)
    after = _threads()
    forkable = before is not None and after is not None and after <= before
    sys.stdout.write(READY + " " + json.dumps({"forkable": forkable}) + "\n")
    sys.stdout.flush()
    if not forkable:
        return 0
    for line in sys.stdin:
        if not line.strip():  # a go line whose child had died
            continue
        spec = {"build": build, "batch": batch, **json.loads(line)}
        pid = os.fork()
        if pid == 0:
            _answer(spec, _wait_for_go)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            code = os.waitstatus_to_exitcode(status)
            sys.stdout.write(EXIT + " " + json.dumps({"micro_batch_size": spec["micro_batch_size"],
                                                      "returncode": code}) + "\n")
            sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    if argv[:1] == ["--fork"]:
        return fork_server(argv[1], argv[2])
    before_timing = None
    if argv[:1] == ["--wait"]:
        _preload(argv[1], argv[2])
        sys.stdout.write(READY + "\n")
        sys.stdout.flush()
        spec = {"build": argv[1], "batch": argv[2], **json.loads(sys.stdin.readline())}
        before_timing = _wait_for_go
    else:
        spec = json.loads(argv[0])
    _answer(spec, before_timing)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
