"""Mixed-precision references, for every family and backend (NumPy only:
``tests/backends/`` runs without TensorFlow)."""

from __future__ import annotations

import numpy as np


def update_weights_recorder(keras):
    """The ``UpdateWeights`` callback class of a Keras package: the trainable
    weights, flattened, before training and after each batch, what
    :func:`mixed_precision_tolerance` reads as ``reference_weights``."""

    class UpdateWeights(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.history = [self._flat()]

        def on_train_batch_end(self, batch, logs=None):
            self.history.append(self._flat())

        def _flat(self):
            return np.concatenate([np.ravel(np.asarray(v)).astype(np.float64) for v in self.model.trainable_variables])

    return UpdateWeights


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
