"""What the planner's in-process probes (:mod:`accum_optimizer.plan._jax`,
:mod:`accum_optimizer.plan._torch`) share: the user's model built once and
recompiled with ``AccumulatingOptimizer(inner, 2)`` and its loss, as the
TensorFlow probe process does (:mod:`accum_optimizer.plan._probe`); the
user's batch at one B; a context manager whose :meth:`InProcessProbe.close`
releases what the probe holds.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable


class InProcessProbe:
    """Build the user's model once, in the planner's process.

    Args:
        build: the user's build function (no arguments -> a compiled Keras
            model).
        make_batch: the user's batch function (B -> ``(x, y[, sample_weight])``).

    Attributes:
        method: what :meth:`measure` reads, in words.
        device: where it measures (``"GPU:0"``, ``"CPU:0"``...).
        distribution: the active ``keras.distribution`` (``None`` here).
        data_parallel: the size of its batch axis (1 here).
        devices: the devices one step runs on (1 here).

    Raises:
        RuntimeError: ``build`` or the recompiling raised (its traceback in
            the message).
    """

    method = ""
    device = "CPU:0"
    distribution: Any = None
    data_parallel = 1
    devices = 1

    def __init__(self, build: Callable[[], Any], make_batch: Callable[[int], Any]):
        from accum_optimizer import AccumulatingOptimizer
        from accum_optimizer.plan._probe import _accumulating

        self._make_batch = make_batch
        try:
            model = build()
            model.compile(optimizer=_accumulating(model.optimizer, AccumulatingOptimizer), loss=model.loss)
        except Exception:  # noqa: BLE001 - the user's to see, whole
            raise RuntimeError(f"Building the model raised, in the planner's process:\n{traceback.format_exc()}") from None
        self.model: Any = model

    def __enter__(self) -> "InProcessProbe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model."""
        self.model = None

    def batch(self, micro_batch_size: int) -> tuple:
        """The user's batch at B = ``micro_batch_size``, as a tuple.

        Raises:
            RuntimeError: the batch function raised (its traceback in the
                message).
        """
        try:
            data = self._make_batch(micro_batch_size)
        except Exception:  # noqa: BLE001
            raise RuntimeError(f"The batch function at micro_batch_size={micro_batch_size} raised, in the planner's "
                               f"process:\n{traceback.format_exc()}") from None
        return tuple(data) if isinstance(data, (tuple, list)) else (data,)

    def measure(self, micro_batch_size: int, budget_bytes: int | None = None) -> dict:  # pragma: no cover
        """One probe at B: ``{"micro_batch_size", "peak_bytes",
        "seconds_per_micro_step", "oom", ...}``."""
        raise NotImplementedError
