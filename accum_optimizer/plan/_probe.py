"""One probe of the planner, in a fresh process: ``python -m
accum_optimizer.plan._probe '<json>'`` prints one line, ``PROBE_RESULT
<json>``. ``python -m accum_optimizer.plan._probe --wait BUILD BATCH``
first imports TensorFlow, this package and the user's two functions, then
reads its spec (``{"micro_batch_size", "budget_bytes"}``) as one JSON line
from standard input: the planner starts it while the previous probe still
trains, so that the imports are not on the search's critical path. It
prints ``PROBE_READY`` once imported, and ``PROBE_TRACED`` after its first
step, then waits for a line before the two timed steps: the planner sends
it once the next probe's process is ready (idle), so that no import shares
the CPU with the steps that are timed.

It builds the user's model, wraps its optimizer in
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
READY, TRACED = "PROBE_READY", "PROBE_TRACED"  # --wait: imports done; first step done, waiting to time


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
    try:
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

        load_function(build, "build"), load_function(batch, "batch")
    except BaseException:  # noqa: BLE001 - measure() raises it again, and reports it
        pass


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    before_timing = None
    if argv[:1] == ["--wait"]:
        _preload(argv[1], argv[2])
        sys.stdout.write(READY + "\n")
        sys.stdout.flush()
        spec = {"build": argv[1], "batch": argv[2], **json.loads(sys.stdin.readline())}

        def before_timing() -> None:  # the planner answers once the next probe's process is idle
            sys.stdout.write(TRACED + "\n")
            sys.stdout.flush()
            sys.stdin.readline()
    else:
        spec = json.loads(argv[0])
    try:
        result = measure(spec, before_timing)
    except BaseException:  # noqa: BLE001 - the parent shows the child's traceback
        result = {"micro_batch_size": spec.get("micro_batch_size"), "error": traceback.format_exc()}
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
