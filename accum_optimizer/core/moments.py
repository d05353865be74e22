"""BatchNorm statistics pooled over a window of micro-batches.

A window's micro-batches, seen by a ``BatchNormalization`` layer one at a
time, are pooled per channel into a count, a mean and a (biased) variance,
the way Chan, Golub and LeVeque merge two samples (Welford's update for
batches): for a pool ``(n_a, μ_a, v_a)`` and a micro-batch ``(n_b, μ_b,
v_b)``, with ``n = n_a + n_b``, ``f_a = n_a / n``, ``f_b = n_b / n`` and
``δ = μ_b - μ_a``::

    μ = μ_a + f_b·δ
    v = f_a·v_a + f_b·v_b + f_a·f_b·δ²

This is Chan's ``M2 = M2_a + M2_b + δ²·n_a·n_b/n`` divided by ``n``: every
term is non-negative, so nothing cancels (``E[x²] - E[x]²`` does, in
float32). A first micro-batch (``n_a = 0``) gives ``f_a = 0``, ``f_b = 1``:
its own mean and variance, bitwise. When the window closes, the moving
statistics take one momentum step with the pool, as Keras'
``BatchNormalization`` does with one batch's moments (``moving·momentum +
batch·(1 - momentum)``), and the pool empties.

The pool of the window's micro-batches is the moments of their union (up to
rounding): what the layer would have seen as one batch of N·B.

The functions take any array values that support ``+ - * /`` (TensorFlow
tensors, Keras tensors, NumPy arrays) and an ``xp`` namespace with
``maximum`` and ``where`` (``keras.ops``, ``tf.math`` with ``tf.where``,
``numpy``); nothing here imports a framework.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Pool(NamedTuple):
    """A window's pooled statistics, per channel.

    Attributes:
        count: float32 scalar, the elements pooled per channel (units:
            elements: micro-batch size times the reduced spatial size, or the
            mask's sum). 0 for an empty window.
        mean: float32 ``(channels,)``, the pooled mean.
        variance: float32 ``(channels,)``, the pooled biased variance
            (divisor ``count``, as ``keras.ops.moments``).
    """

    count: Any
    mean: Any
    variance: Any


def merge(xp: Any, pool: Pool, count: Any, mean: Any, variance: Any) -> Pool:
    """``pool`` with one micro-batch's moments (``count`` elements per
    channel, its ``mean`` and biased ``variance``) added (Chan's merge).

    An empty micro-batch (``count == 0``) leaves the pool as it is."""
    total = pool.count + count
    safe = xp.maximum(total, 1.0)  # counts are whole: `total` itself unless both are 0
    f_a, f_b = pool.count / safe, count / safe
    delta = mean - pool.mean
    return Pool(
        total,
        pool.mean + f_b * delta,
        f_a * pool.variance + f_b * variance + (f_a * f_b) * (delta * delta),
    )


def merge_parts(xp: Any, reduce_sum: Any, count: Any, mean: Any, variance: Any) -> Pool:
    """The moments of the union of several parts (the replicas of a
    distribution strategy, each holding ``count``, ``mean``, ``variance``),
    through ``reduce_sum`` (a sum over the parts: an all-reduce), Chan's
    merge for k parts: ``n = Σ n_r``, ``μ = Σ f_r·μ_r``, ``v = Σ f_r·(v_r +
    (μ_r - μ)²)`` with ``f_r = n_r / n``. Three sums; every term of the
    variance is non-negative."""
    total = reduce_sum(count)
    share = count / xp.maximum(total, 1.0)
    pooled_mean = reduce_sum(share * mean)
    delta = mean - pooled_mean
    return Pool(total, pooled_mean, reduce_sum(share * (variance + delta * delta)))


def moving_step(xp: Any, moving_mean: Any, moving_variance: Any, pool: Pool, momentum: float) -> tuple:
    """The moving statistics after a window: one momentum step with the
    pool, exactly the expression of Keras' ``BatchNormalization`` for one
    batch's moments; unchanged where the window pooled nothing."""
    seen = pool.count > 0
    return (
        xp.where(seen, moving_mean * momentum + pool.mean * (1.0 - momentum), moving_mean),
        xp.where(seen, moving_variance * momentum + pool.variance * (1.0 - momentum), moving_variance),
    )
