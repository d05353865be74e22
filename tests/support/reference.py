"""The independent reference: the same model trained with batch N*B, no accumulation.

Both trainers take the same initial weights (a seeded builder), the same
samples in the same order, and a loss that is a mean over the batch. The
accumulating run sees the N*B samples of each large batch as N consecutive
micro-batches of B.
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer


def make_mlp(seed: int = 0, in_dim: int = 6, hidden: int = 5, out_dim: int = 3, dtype: str = "float32"):
    """A small two-layer MLP whose initial weights depend only on ``seed``."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((in_dim,), dtype=dtype),
            keras.layers.Dense(hidden, activation="tanh", dtype=dtype),
            keras.layers.Dense(out_dim, dtype=dtype),
        ]
    )
    return model


def make_data(n: int, in_dim: int = 6, out_dim: int = 3, seed: int = 1, dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype(dtype)
    y = rng.normal(size=(n, out_dim)).astype(dtype)
    return x, y


def mse(y, p):
    return tf.reduce_mean(tf.square(y - p))


def make_train_step(model, optimizer, loss_fn=mse, jit_compile: bool = False):
    """A custom-loop step: tape, gradients, ``apply_gradients``.

    ``jit_compile=None`` gives an eager (untraced) step.
    """

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if jit_compile is None:
        return step
    return tf.function(step, jit_compile=jit_compile)


def train(model, optimizer, x, y, batch: int, steps: int, loss_fn=mse, jit_compile=False):
    # jit_compile: False (tf.function), True (tf.function with XLA), None (eager)
    """``steps`` optimizer calls on consecutive batches of ``batch`` samples."""
    step = make_train_step(model, optimizer, loss_fn, jit_compile)
    for s in range(steps):
        sl = slice(s * batch, (s + 1) * batch)
        step(tf.constant(x[sl]), tf.constant(y[sl]))
    return model


def reference_and_accumulated(
    model_fn: Callable[[], keras.Model],
    optimizer_fn: Callable[[], keras.optimizers.Optimizer],
    n: int,
    micro_batch: int,
    windows: int,
    reduction: str = "mean",
    data_seed: int = 1,
    dtype: str = "float32",
    jit_compile=False,
):
    """Train the reference (``windows`` steps of batch ``n*micro_batch``) and the
    accumulating model (``n*windows`` micro-steps of ``micro_batch``).

    With ``reduction="sum"`` the reference loss is multiplied by ``n`` (the
    sum of ``n`` micro-batch mean losses has that gradient).
    """
    ref_model, acc_model = model_fn(), model_fn()
    in_dim = ref_model.inputs[0].shape[-1]
    out_dim = ref_model.outputs[0].shape[-1]
    x, y = make_data(n * micro_batch * windows, in_dim, out_dim, data_seed, dtype)
    scale = float(n) if reduction == "sum" else 1.0

    def ref_loss(yt, yp):
        return mse(yt, yp) * tf.cast(scale, yp.dtype)

    ref_opt = optimizer_fn()
    acc_opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=n, reduction=reduction)
    train(ref_model, ref_opt, x, y, n * micro_batch, windows, loss_fn=ref_loss, jit_compile=jit_compile)
    train(acc_model, acc_opt, x, y, micro_batch, n * windows, jit_compile=jit_compile)
    return ref_model, acc_model, ref_opt, acc_opt


def max_abs_diff(a_list, b_list) -> float:
    a_list, b_list = list(a_list), list(b_list)
    if len(a_list) != len(b_list) or not a_list:
        raise AssertionError(f"cannot compare {len(a_list)} arrays with {len(b_list)}")
    return max(
        float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
        for a, b in zip(a_list, b_list)
    )


def weights(model_or_vars):
    vs = model_or_vars.weights if isinstance(model_or_vars, keras.Model) else list(model_or_vars)
    return [np.array(v.numpy()) for v in vs]


# ------------------------------------------------------ mixed precision
def epsilon_16(policy: str) -> float:
    """Machine epsilon of a mixed policy's compute dtype (float16: 2**-10,
    bfloat16: 2**-7)."""
    import ml_dtypes

    compute = {"mixed_float16": np.float16, "mixed_bfloat16": ml_dtypes.bfloat16}[policy]
    return float(ml_dtypes.finfo(compute).eps)


def mixed_precision_tolerance(optimizer_config: dict, eps: float, reference_weights: list) -> float:
    """Largest weight difference two runs of the same model can show when
    their gradients differ by 16-bit rounding only, to first order.

    Under a mixed policy the float32 master weights see gradients computed in
    16-bit. The accumulating run and the batch-N*B run compute every sample's
    forward and backward pass alike (the 1/batch factors differ by N, a power
    of two, and loss scales are powers of two); they differ in how the batch
    sum of each gradient is rounded to 16 bits: once over N*B samples, or once
    per micro-batch of B and then added in float32. So each gradient element
    of an update differs by at most ``eps`` relative (unit roundoff eps/2 on
    each side). What that does to the weights after U updates, to first order
    (the change of the gradient with the weights is second order):

    * SGD with momentum mu (``m = mu*m - lr*g``, ``w += m``): a gradient
      enters the step of its update and of every later one, weighted
      ``mu**k``, so ``|dw| <= eps * sum_s lr*|g_s| * (1 - mu**(U-s)) / (1 - mu)``.
      ``lr*g_s = mu*step_{s-1} - step_s`` comes from the reference's own steps.
    * Adam: the step ``lr * m_hat / (sqrt(v_hat) + epsilon)`` does not change
      when every gradient is scaled alike; relative errors ``eps`` in the
      gradients change ``m_hat`` by ``eps * sum_s a_s |g_s|`` and
      ``sqrt(v_hat)`` by ``eps * sqrt(v_hat)``, so the step changes by at most
      ``2 * eps * lr * sum_s a_s |g_s| / sqrt(v_hat) <= 2 * eps * lr * c_t``
      with ``c_t = sqrt(max_s a_s / b_s)`` (Cauchy-Schwarz), ``a_s`` and
      ``b_s`` the bias-corrected weights of gradient s in ``m_hat`` and
      ``v_hat`` at update t. Summed over the updates.

    Args:
        optimizer_config: the inner optimizer's ``get_config()`` (SGD or Adam).
        eps: :func:`epsilon_16` of the policy.
        reference_weights: the batch-N*B run's trainable weights, flattened,
            before the first update and after each update (U + 1 arrays).
    """
    steps = np.diff(np.asarray(reference_weights, np.float64), axis=0)
    updates = len(steps)
    lr = float(optimizer_config["learning_rate"])
    if "momentum" in optimizer_config:  # SGD
        mu = float(optimizer_config["momentum"])
        total = 0.0
        for s in range(updates):
            lr_g = np.max(np.abs(steps[s] - (mu * steps[s - 1] if s else 0.0)))
            total += lr_g * (1 - mu ** (updates - s)) / (1 - mu)
        return eps * total
    b1, b2 = float(optimizer_config["beta_1"]), float(optimizer_config["beta_2"])
    total = 0.0
    for t in range(1, updates + 1):
        s = np.arange(1, t + 1)
        a = (1 - b1) * b1 ** (t - s) / (1 - b1**t)
        b = (1 - b2) * b2 ** (t - s) / (1 - b2**t)
        total += 2 * lr * np.sqrt(np.max(a / b))
    return eps * total
