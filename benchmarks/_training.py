"""The optimizers compared, their accumulation state in bytes, the custom-loop
step, the runtime warm-up and the measured copy bandwidth."""

from __future__ import annotations

import statistics
import time

from benchmarks._models import build_model, make_batch, model_loss
from benchmarks._output import MIB
from benchmarks._profiles import MODEL_SIZES


class NotApplicable(Exception):
    """A configuration that cannot run (e.g. Keras' built-in with N=1)."""


def make_optimizer(method: str, n: int, inner: str = "adam", lr: float = 1e-3):
    """``plain``: the inner optimizer; ``accum``: AccumulatingOptimizer(inner, n);
    ``builtin``: the inner optimizer with Keras' ``gradient_accumulation_steps=n``."""
    import keras

    from accum_optimizer import AccumulatingOptimizer

    cls = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD,
           "adamw": keras.optimizers.AdamW}[inner]
    if method == "plain":
        return cls(lr)
    if method == "accum":
        return AccumulatingOptimizer(cls(lr), gradient_accumulation_steps=n)
    if method == "builtin":
        if n < 2:
            raise NotApplicable("Keras' built-in gradient_accumulation_steps must be >= 2")
        return cls(lr, gradient_accumulation_steps=n)
    raise ValueError(f"unknown method {method!r}; expected plain, accum or builtin")


def param_bytes(variables) -> int:
    import numpy as np

    return int(sum(int(np.prod(v.shape)) * _dtype_size(v.dtype) for v in variables))


def _dtype_size(dtype) -> int:
    import numpy as np

    name = getattr(dtype, "name", dtype)
    return np.dtype(str(name)).itemsize


def accumulator_bytes(opt) -> dict:
    """Bytes of the state an optimizer keeps *for accumulation* (beyond its
    inner/plain state): ``AccumulatingOptimizer``'s ``acc_grads`` (slots),
    and its bookkeeping: ``grad_received``, ``micro_steps``, ``mini_step``,
    ``window_weight`` and the row trackers of sparse variables; Keras'
    ``_accumulated_gradients``."""
    from accum_optimizer import AccumulatingOptimizer

    if isinstance(opt, AccumulatingOptimizer):
        slots = param_bytes(opt.acc_grads)
        counters = [getattr(opt, name, None) for name in ("grad_received", "micro_steps", "mini_step", "window_weight")]
        trackers = [t for t in (getattr(opt, "touched_rows", None) or []) if t is not None]
        extra = param_bytes([v for v in counters if v is not None] + trackers)
        return {"slots": slots, "bookkeeping": extra, "total": slots + extra}
    acc = getattr(opt, "_accumulated_gradients", None) or []
    slots = param_bytes(acc)
    return {"slots": slots, "bookkeeping": 0, "total": slots}


def make_train_step(model, opt, loss_fn, jit_compile: bool = False):
    """A ``tf.function`` custom-loop micro-step: forward, backward, ``apply``."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def warm_up_runtime(kind: str, size: dict, backend: str = "tensorflow") -> None:
    """Train a throwaway miniature of the model two steps (plain SGD).

    Memory workers call this before taking their baseline, so that
    TensorFlow's one-time runtime set-up (thread pools, oneDNN / cuDNN
    kernels and handles, about 25 MiB of RSS on a CPU) is already resident and
    not counted as training memory of the configuration being measured.
    """
    import keras

    if kind == "embedding":
        tiny = dict(size, vocab=16)
    else:
        tiny = MODEL_SIZES["tiny"][kind]
    model = build_model(kind, tiny, seed=0)
    x, y = make_batch(kind, tiny, 2)
    if backend != "tensorflow":  # (JAX, torch: fit, what their memory workers run)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model_loss(kind))
        model.fit(x, y, batch_size=2, epochs=2, verbose=0)
        return
    step = make_train_step(model, keras.optimizers.SGD(0.01), model_loss(kind))
    step(x, y).numpy()
    step(x, y).numpy()


def copy_bandwidth(megabytes: int = 64, repeats: int = 10, backend: str = "tensorflow") -> dict:
    """Measured bytes/s of ``a += b`` on float32 tensors of ``megabytes`` MiB
    (reads a and b, writes a: 3 x size bytes per call): ``assign_add`` in a
    ``tf.function`` (TensorFlow), a ``jax.jit`` add (JAX), an in-place
    ``add_`` (torch); the best of ``repeats`` calls after a warm-up."""
    n = megabytes * MIB // 4
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        state = {"a": jnp.zeros((n,), jnp.float32)}
        b = jnp.ones((n,), jnp.float32)
        jitted = jax.jit(lambda a, b: a + b, donate_argnums=0)

        def add():
            state["a"] = jitted(state["a"], b).block_until_ready()
    elif backend == "torch":
        import torch

        a, b = torch.zeros(n), torch.ones(n)

        def add():
            a.add_(b)
            if a.is_cuda:
                torch.cuda.synchronize()
    else:
        import tensorflow as tf

        a = tf.Variable(tf.zeros((n,), tf.float32))
        b = tf.ones((n,), tf.float32)
        @tf.function
        def step():
            a.assign_add(b)
            return tf.constant(0)

        def add():
            step().numpy()

    add()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        add()
        times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    moved = 3 * n * 4
    return {"tensor_mib": megabytes, "bytes_per_call": moved, "best_seconds": best,
            "median_seconds": med, "bytes_per_second": moved / best,
            "bytes_per_second_median": moved / med}
