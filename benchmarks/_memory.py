"""Peak memory of this process from a start point: RSS and the framework's
allocator."""

from __future__ import annotations

import resource


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is None:  # not Linux: best effort
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kib * 1024


class PeakMemory:
    """Peak memory of this process from a start point, two ways.

    * ``rss``: resident set size. :meth:`start` resets the kernel's
      high-water mark (``/proc/self/clear_refs``) so the peak is measured
      from that point; where that is not possible, ``ru_maxrss`` (the
      lifetime peak) is used.
    * ``tf_allocator``: TensorFlow's allocator statistics for the device
      (``reset_memory_stats`` at :meth:`start`, ``get_memory_info(...)['peak']``
      at :meth:`stop`): tensor memory only (weights, optimizer state,
      gradients, activations, graph constants), no runtime or host overhead.
      On a GPU this is the device memory; on a CPU it needs TensorFlow's BFC
      CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, which
      :func:`run_worker` sets) to be complete.

    ``stop()`` returns both, each with ``peak``, ``base`` (at start),
    ``delta = peak - base`` and ``resident = current - base`` (what stays
    allocated at the end), plus ``delta_bytes``: the headline figure (GPU:
    the allocator's; CPU: RSS, as the benchmarks' docs say).
    """

    def __init__(self, gpu: bool, backend: str = "tensorflow") -> None:
        self.gpu, self.backend = gpu, backend
        self.device = "GPU:0" if gpu else "CPU:0"
        self.base = 0
        self.rss_base = 0
        self.alloc_base: int | None = None
        self.hwm_reset = False

    def _alloc_info(self) -> dict | None:
        if self.backend == "jax":  # the device's own counters (GPU; None on a CPU)
            import jax

            stats = jax.devices()[0].memory_stats()
            return None if not stats else {"current": stats["bytes_in_use"], "peak": stats["peak_bytes_in_use"]}
        if self.backend == "torch":
            import torch

            if not self.gpu:
                return None
            return {"current": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}
        import tensorflow as tf

        try:
            return tf.config.experimental.get_memory_info(self.device)
        except (ValueError, RuntimeError):
            return None

    def start(self) -> None:
        if self.backend == "torch" and self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.backend == "tensorflow":
            import tensorflow as tf

            try:
                tf.config.experimental.reset_memory_stats(self.device)
            except (ValueError, RuntimeError):
                pass
        # (JAX cannot reset its peak: the device's lifetime peak, which the
        # model's build stays below, minus the memory in use here.)
        info = self._alloc_info()
        self.alloc_base = None if info is None else info["current"]
        self.rss_base = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = _status_kib("VmHWM") is not None
        except OSError:
            self.hwm_reset = False
        self.base = self.alloc_base if self.gpu else self.rss_base

    def current(self) -> int:
        if self.gpu:
            return self._alloc_info()["current"]
        return rss_bytes()

    def stop(self) -> dict:
        if self.hwm_reset:
            rss_peak, rss_source = _status_kib("VmHWM") * 1024, "VmHWM after reset"
        else:
            rss_peak, rss_source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
        rss_now = rss_bytes()
        rss = {"peak": rss_peak, "base": self.rss_base, "delta": rss_peak - self.rss_base,
               "resident": rss_now - self.rss_base, "source": rss_source}
        info = self._alloc_info()
        alloc = None
        if info is not None and self.alloc_base is not None and info["peak"] > 0:
            alloc = {"device": self.device, "peak": info["peak"], "base": self.alloc_base,
                     "delta": info["peak"] - self.alloc_base, "resident": info["current"] - self.alloc_base}
        head = alloc if (self.gpu and alloc) else rss
        return {"peak_bytes": int(head["peak"]), "base_bytes": int(head["base"]),
                "delta_bytes": int(head["delta"]), "resident_bytes": int(head["resident"]),
                "source": f"{self.backend} allocator {self.device}" if self.gpu else f"RSS ({rss_source})",
                "rss": rss, "tf_allocator": alloc}
