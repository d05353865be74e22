"""One probe of the planner, in a fresh process: ``python -m
accum_optimizer.plan._probe '<json>'`` prints one line, ``PROBE_RESULT
<json>``.

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


def measure(spec: dict) -> dict:
    """Train the three steps of one probe (``spec``: build, batch, the micro
    batch size, the budget) and return its figures."""
    from accum_optimizer.plan import load_function

    gpu = _configure(spec.get("budget_bytes"))
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    device = "GPU:0" if gpu else "CPU:0"
    result: dict[str, Any] = {"micro_batch_size": spec["micro_batch_size"], "device": device,
                              "gpus": len(tf.config.list_physical_devices("GPU"))}
    build, make_batch = load_function(spec["build"], "build"), load_function(spec["batch"], "batch")
    try:
        model = build()
        batch = make_batch(spec["micro_batch_size"])
        model.compile(optimizer=_accumulating(model.optimizer, AccumulatingOptimizer), loss=model.loss)
        tf.config.experimental.reset_memory_stats(device)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.train_on_batch(*batch) if isinstance(batch, (tuple, list)) else model.train_on_batch(batch)
            times.append(time.perf_counter() - start)
        result["peak_bytes"] = int(tf.config.experimental.get_memory_info(device)["peak"])
        result["seconds_per_micro_step"] = sum(times[1:]) / 2
        result["oom"] = False
    except tf.errors.ResourceExhaustedError:
        result.update(peak_bytes=None, seconds_per_micro_step=None, oom=True)
    return result


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    try:
        result = measure(spec)
    except BaseException:  # noqa: BLE001 - the parent shows the child's traceback
        result = {"micro_batch_size": spec.get("micro_batch_size"), "error": traceback.format_exc()}
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
