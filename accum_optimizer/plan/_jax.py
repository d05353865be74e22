"""The planner's probe on Keras 3's JAX backend: XLA's memory analysis of
the compiled train step, in the planner's own process.

The model is built once (the user's ``build()``), recompiled with
``AccumulatingOptimizer(inner, 2)`` and its loss, like the TensorFlow probe's,
and its optimizer built, so that the state (trainable and non-trainable
variables, the optimizer's variables with the accumulators, the metrics'
variables) exists. For each micro-batch size B the model's own JAX train
step, ``model.train_step(state, data)`` (Keras' public stateless step, what
``fit`` jits), is jitted as Keras jits it (``donate_argnums=0``; under a
``keras.distribution`` the state's shardings as ``out_shardings``), lowered
with the state and the *shapes* of ``batch(B)`` (``jax.ShapeDtypeStruct``,
sharded by the distribution's data layout: nothing of size B is put on a
device) and compiled. ``compiled.memory_analysis()`` then gives, in bytes,
for one device (under a distribution the SPMD program is the same on every
device, so this is each device's figure):

* ``argument``: the state and the batch (accumulators, the inner
  optimizer's slots, the weights: everything a step is given);
* ``output``: the new state and the logs; ``alias``: the part of the
  output that reuses donated argument buffers;
* ``temp``: XLA's temporaries (activations kept for the backward pass,
  gradients, the update's intermediates), after buffer assignment;
* ``generated_code``: the program's code.

The peak is ``argument + output - alias + temp + generated_code``: what the
step holds at once at most. No step runs, so a B that does not fit costs a
compile and no out-of-memory error. Accumulate-only and update micro-steps
are the two branches of one program (``lax.cond``), so the figure covers
both.
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any, Callable

from accum_optimizer.plan._inprocess import InProcessProbe

METHOD = "XLA memory_analysis of the compiled train step (no step run)"


def memory_figures(compiled: Any) -> dict:
    """``{"argument", "output", "alias", "temp", "generated_code", "peak"}``
    (ints, bytes) of a compiled JAX program (``jax.stages.Compiled``);
    ``peak = argument + output - alias + temp + generated_code``. A list of
    analyses (one per program) gives the largest peak's."""
    analysis = compiled.memory_analysis()
    analyses = analysis if isinstance(analysis, (list, tuple)) else [analysis]
    if not analyses or any(a is None for a in analyses):
        raise NotImplementedError(
            "XLA gives no memory analysis for this program on this JAX backend "
            "(compiled.memory_analysis() returned None): the planner cannot measure it here."
        )
    best = None
    for a in analyses:
        figures = {
            "argument": int(a.argument_size_in_bytes),
            "output": int(a.output_size_in_bytes),
            "alias": int(a.alias_size_in_bytes),
            "temp": int(a.temp_size_in_bytes),
            "generated_code": int(a.generated_code_size_in_bytes),
        }
        figures["peak"] = (figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
                           + figures["generated_code"])
        if best is None or figures["peak"] > best["peak"]:
            best = figures
    return best


def data_parallel_size(distribution: Any) -> int:
    """The size of the batch axis of a ``keras.distribution`` (1 without
    one): how many ways the global batch is split."""
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    axis = distribution.batch_dim_name
    if axis not in mesh.axis_names:  # pragma: no cover - Keras checks this itself
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(axis)])


class JaxProbe(InProcessProbe):
    """Build the user's model once; :meth:`measure` compiles its train step
    at one B and reads XLA's memory analysis.

    Args:
        build: the user's build function (no arguments -> a compiled Keras
            model); it may set a ``keras.distribution``.
        make_batch: the user's batch function (B -> ``(x, y[, sample_weight])``).

    Attributes:
        distribution: the active ``keras.distribution`` after ``build()``
            (``None`` without one).
        data_parallel: :func:`data_parallel_size` of it.
        devices: devices the program runs on (the distribution's mesh, or 1).
        device: ``"CPU:0"``/``"GPU:0"``..., or ``"4 x CPU (per device)"``
            under a distribution.

    Raises:
        RuntimeError: ``build`` or the wrapping raised (the traceback in the
            message).
    """

    method = METHOD

    def __init__(self, build: Callable[[], Any], make_batch: Callable[[int], Any]):
        import jax
        import keras

        super().__init__(build, make_batch)
        self._jax = jax
        self.distribution = keras.distribution.distribution()
        self.data_parallel = data_parallel_size(self.distribution)
        platform = jax.devices()[0].platform.upper()
        if self.distribution is None:
            self.devices, self.device = 1, f"{platform}:0"
        else:
            self.devices = int(math.prod(self.distribution.device_mesh.shape))
            self.device = f"{self.devices} x {platform} (per device)"
        self._step = None

    def close(self) -> None:
        """Drop the model and the jitted step (nothing else to release)."""
        super().close()
        self._step = None

    def _prepare(self, data: Any) -> None:
        """Build what ``build()`` left unbuilt (the model on one sample of
        ``data``; the optimizer's variables), then the state and
        the jitted step (once)."""
        jax, model = self._jax, self.model

        if not model.built:  # a subclassed model: one sample through it, eagerly (no training step)
            import numpy as np

            model(jax.tree.map(lambda a: np.asarray(a)[:1], data[0]))
        model.optimizer.build(model.trainable_variables)
        groups = (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
                  model.metrics_variables)
        self.state = tuple([v.value for v in group] for group in groups)
        out_shardings = None
        if self.distribution is not None:  # what Keras' make_train_function does
            out_shardings = (None, tuple([v.value.sharding for v in group] for group in groups))
        self._step = jax.jit(model.train_step, donate_argnums=0, out_shardings=out_shardings)

    def time_step(self, micro_batch_size: int, steps: int = 3) -> float:
        """Seconds per executed train step at B = ``micro_batch_size`` (the
        median of ``steps``, after one untimed execution), with the user's
        batch on the device(s). Runs the step (it allocates what the
        analysis counted), so call it for a B that fits, once the search is
        done: it donates the probe's state to the step.
        """
        import statistics

        jax = self._jax
        data = self.batch(micro_batch_size)
        if self._step is None:
            self._prepare(data)

        def put(a: Any) -> Any:
            if a is None:
                return None
            if self.distribution is None:
                return jax.device_put(a)
            return jax.device_put(a, self.distribution.get_data_layout(tuple(a.shape)).backend_layout)

        arrays = tuple(put(a) for a in data)
        compiled = self._step.lower(self.state, self._abstract(data)).compile()
        state, times = self.state, []
        for i in range(steps + 1):
            began = time.perf_counter()
            _, state = compiled(state, arrays)
            jax.block_until_ready(state)
            if i:
                times.append(time.perf_counter() - began)
        self.state = state
        return statistics.median(times)

    def _abstract(self, data: Any) -> Any:
        """``data``'s arrays as ``jax.ShapeDtypeStruct`` s (dtype as JAX
        would take it; sharded by the distribution's data layout)."""
        jax = self._jax

        def leaf(a: Any) -> Any:
            if a is None:
                return None
            shape = tuple(getattr(a, "shape", ()))
            dtype = jax.dtypes.canonicalize_dtype(getattr(a, "dtype", type(a)))
            sharding = None
            if self.distribution is not None and shape:
                sharding = self.distribution.get_data_layout(shape).backend_layout
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        return jax.tree.map(leaf, data, is_leaf=lambda a: a is None)

    def measure(self, micro_batch_size: int, budget_bytes: int | None = None) -> dict:
        """Compile the train step at B = ``micro_batch_size`` (the global
        micro-batch under a distribution) and read its memory
        (``budget_bytes`` is not needed: the figure is compared with the
        budget by the caller).

        Returns:
            ``{"micro_batch_size", "peak_bytes", "seconds_per_micro_step",
            "oom", "memory", "compile_seconds"}``: ``peak_bytes`` (int,
            bytes per device) as in the module's docstring, ``memory`` its
            parts (:func:`memory_figures`), ``seconds_per_micro_step``
            ``None`` (no step runs), ``compile_seconds`` the compile's wall
            time; ``oom`` True only where XLA itself refuses for lack of
            memory (``RESOURCE_EXHAUSTED``).

        Raises:
            RuntimeError: the batch function raised, or the step does not
                compile (the traceback in the message).
        """
        data = self.batch(micro_batch_size)
        began = time.perf_counter()
        try:
            if self._step is None:
                self._prepare(data)
            compiled = self._step.lower(self.state, self._abstract(data)).compile()
        except Exception as e:  # noqa: BLE001
            if "RESOURCE_EXHAUSTED" in str(e):
                return {"micro_batch_size": micro_batch_size, "peak_bytes": None, "seconds_per_micro_step": None,
                        "oom": True, "memory": None, "compile_seconds": time.perf_counter() - began}
            raise RuntimeError(f"Compiling the train step at micro_batch_size={micro_batch_size} raised:\n"
                               f"{traceback.format_exc()}") from None
        figures = memory_figures(compiled)
        return {"micro_batch_size": micro_batch_size, "peak_bytes": figures["peak"], "seconds_per_micro_step": None,
                "oom": False, "memory": figures, "compile_seconds": time.perf_counter() - began}
