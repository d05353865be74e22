"""The planner's probe on Keras 3's torch backend: torch's CUDA allocator
peak over real steps, in the planner's own process.

torch keeps a peak only for its CUDA caching allocator
(``torch.cuda.max_memory_allocated``); its CPU allocator keeps none, so on
the CPU the planner refuses (:func:`check_device`). On a CUDA device the
model is built once and recompiled with ``AccumulatingOptimizer(inner, 2)``
and its loss; the process is capped at the planner's budget
(``torch.cuda.set_per_process_memory_fraction``), so a B that does not fit
fails with torch's own ``OutOfMemoryError``, which torch recovers from
in-process (the caching allocator frees what the failed step held). For each
B: ``reset_peak_memory_stats``, then three ``train_on_batch`` micro-steps
(accumulate-only, the update, accumulate-only: every buffer allocated), then
``max_memory_allocated``: tensors only (weights, the inner optimizer's
slots, the accumulators, activations, the batch), not the allocator's cache.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

from accum_optimizer.plan._inprocess import InProcessProbe

METHOD = "torch.cuda.max_memory_allocated over three train_on_batch micro-steps"


def check_device() -> None:
    """Refuse where torch has no CUDA device.

    Raises:
        NotImplementedError: ``torch.cuda.is_available()`` is False (the
            message names the backend, the device, why, and what works).
    """
    import torch

    if not torch.cuda.is_available():
        raise NotImplementedError(
            "The planner cannot measure Keras 3 on the 'torch' backend on the CPU (torch "
            f"{torch.__version__} sees no CUDA device): torch keeps a peak only for its CUDA allocator "
            "(torch.cuda.max_memory_allocated); its CPU allocator keeps no peak to read. Plan on a CUDA "
            "device, or plan the same model with KERAS_BACKEND=jax (XLA's compile-time memory analysis, on "
            "the CPU too) or KERAS_BACKEND=tensorflow."
        )


class TorchProbe(InProcessProbe):
    """Build the user's model once on the CUDA device; :meth:`measure`
    trains three micro-steps at one B and reads the allocator's peak.

    Args:
        build: the user's build function (no arguments -> a compiled model).
        make_batch: the user's batch function (B -> ``(x, y[, sample_weight])``).
        budget_bytes: the process is capped there
            (``set_per_process_memory_fraction``, lifted by :meth:`close`),
            or not capped if ``None``.

    Raises:
        NotImplementedError: no CUDA device (:func:`check_device`).
        RuntimeError: ``build`` raised (its traceback in the message).
    """

    method = METHOD

    def __init__(self, build: Callable[[], Any], make_batch: Callable[[int], Any], budget_bytes: int | None = None):
        check_device()
        import torch

        self._torch = torch
        self._index = index = torch.cuda.current_device()
        self.device = f"GPU:{index}"
        self._capped = bool(budget_bytes)
        if self._capped:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)
        try:
            super().__init__(build, make_batch)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the model, free torch's cache and lift the process' cap (the
        planner's process may train next)."""
        torch = self._torch
        super().close()
        gc.collect()
        torch.cuda.empty_cache()
        if self._capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self._index)
            self._capped = False

    def measure(self, micro_batch_size: int, budget_bytes: int | None = None) -> dict:
        """Three micro-steps at B = ``micro_batch_size`` (the cap at the
        budget was set once, by the constructor: ``budget_bytes`` is not
        used).

        Returns:
            ``{"micro_batch_size", "peak_bytes", "seconds_per_micro_step",
            "oom"}``: ``peak_bytes`` (int, bytes; ``None`` after an
            out-of-memory error), ``seconds_per_micro_step`` the mean of the
            two micro-steps after the first.
        """
        torch = self._torch
        batch = self.batch(micro_batch_size)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        try:
            for _ in range(3):
                began = time.perf_counter()
                self.model.train_on_batch(*batch)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            return {"micro_batch_size": micro_batch_size, "peak_bytes": None, "seconds_per_micro_step": None,
                    "oom": True}
        return {"micro_batch_size": micro_batch_size, "peak_bytes": int(torch.cuda.max_memory_allocated()),
                "seconds_per_micro_step": sum(times[1:]) / 2, "oom": False}
