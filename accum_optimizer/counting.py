"""The channel by which a counted loss reports its micro-batch's count.

A loss that knows what its mean was taken over (samples, sum of sample
weights, unmasked tokens: :class:`accum_optimizer.CountedLoss` for Keras 3)
calls :func:`report_count` when it is computed; the next ``apply`` of an
``AccumulatingOptimizer`` in the same train step (the same thread and the
same graph: each replica of a ``tf.distribute`` strategy runs in its own
thread) takes it with :func:`reported_count` as that micro-step's
``weight``. No Keras import: every family can read it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_pending = threading.local()


def _graph() -> Any:
    """The TensorFlow graph being built (``None`` when executing eagerly,
    and on JAX and torch)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def _graphs() -> list:
    """The graph being built and the graphs it is nested in (a
    ``LossScaleOptimizer`` applies inside a ``cond`` branch, whose graph is
    inside the train step's, where the loss reported)."""
    graph, chain = _graph(), []
    while graph is not None:
        chain.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return chain or [None]


def report_count(count: Any, loss_reduction: str, source: str, reporter: Any = None) -> None:
    """Record ``count`` (float32 scalar tensor) for this train step.

    ``loss_reduction``: the reduction of the loss that computed it (the
    optimizer checks that its own ``reduction`` fits); ``source``: the
    loss's name, for messages; ``reporter``: the loss object. A second
    report in the same graph before an optimizer took the first is
    remembered, and :func:`reported_count` then raises: one window weight
    per micro-step cannot serve two losses with different counts. A report
    by a loss that already reported one not taken starts afresh: that one
    came from a step no optimizer followed (an evaluation step; a trace of
    the loss alone, as Keras' JAX trainer makes when it builds).
    """
    graph = _graph()
    previous = getattr(_pending, "value", None)
    sources, reporters = [source], [reporter]
    if (previous is not None and previous["graph"] is graph
            and (reporter is None or not any(r is reporter for r in previous["reporters"]))):
        sources, reporters = previous["sources"] + sources, previous["reporters"] + reporters
    _pending.value = {"graph": graph, "count": count, "reduction": loss_reduction, "sources": sources,
                      "reporters": reporters}


def reported_count(reduction: str | None = None) -> Any:
    """Take the count reported in this train step (see :func:`report_count`),
    or ``None`` if there is none (or only one from another graph: a test
    step's, or an earlier trace's).

    ``reduction``: the optimizer's reduction. A count from a loss with
    ``reduction="sum"`` is 1 per micro-step and fits only an optimizer that
    sums (``reduction="sum"``).

    Raises:
        ValueError: more than one counted loss reported in this train step,
            or a ``"sum"`` loss with a ``"mean"`` optimizer.
    """
    pending = getattr(_pending, "value", None)
    if pending is None or not any(pending["graph"] is g for g in _graphs()):
        return None
    _pending.value = None
    if len(pending["sources"]) > 1:
        raise ValueError(
            "More than one counted loss reported a micro-batch count in this "
            f"train step ({', '.join(pending['sources'])}); a micro-step has one "
            "count. Count one loss (the one whose reduction the large batch "
            "uses), or pass `weight=` to apply() in a custom train step."
        )
    if reduction is not None and pending["reduction"] == "sum" and reduction != "sum":
        raise ValueError(
            f"The counted loss {pending['sources'][0]!r} sums over its micro-batch "
            "(reduction='sum'): the large batch's loss is the sum over all its "
            "samples, so the window must sum too. Use "
            "AccumulatingOptimizer(..., reduction='sum'), or a mean-reduced loss."
        )
    return pending["count"]


def take_report() -> dict | None:
    """Take the whole report pending in this train step (``count``,
    ``reduction``, ``sources``, ``reporters``), or ``None``: for a train step
    that turns a per-device count into the micro-batch's and reports that
    (:class:`accum_optimizer.OneReductionPerWindow`)."""
    pending = getattr(_pending, "value", None)
    if pending is None or not any(pending["graph"] is g for g in _graphs()):
        return None
    _pending.value = None
    return pending


def micro_batch_count(values: Any, weights: Any, mask: Any, reduction: str, xp: Any = None) -> Any:
    """float32 scalar: the count ``c`` of one micro-batch, such that the
    Keras loss reduced with ``reduction`` is ``Σ(terms) / c``; 0 for a
    micro-batch whose every element is masked (Keras' loss is then 0,
    ``divide_no_nan``). The one count of every family's ``CountedLoss``.

    ``values``: the loss terms as the Keras package's reduction divides
    them (the per-element losses times the sample weights, after the
    package's own mask merge and rank alignment); ``weights``: those merged
    sample weights (``None`` without sample weights and mask); ``mask``: the
    merged mask (``None`` if none). ``reduction``: ``"sum"`` (1 per
    micro-step), ``"sum_over_batch_size"`` / ``"mean"`` (the number of
    elements; with a mask, the divisor of the valid ones: Keras weighs them
    by total / valid), ``"mean_with_sample_weight"`` (Keras 3: the sum of
    the weights). ``xp``: the ops it is computed with (TensorFlow's by
    default; :class:`KerasOps` for ``keras.ops``)."""
    xp = xp or _TensorFlow()
    if reduction == "sum":
        return xp.float32(1.0)
    values = xp.convert(values)
    elements = xp.float32(xp.size(values))
    if reduction == "mean_with_sample_weight":
        count = elements if weights is None else xp.float32(xp.sum(weights * xp.ones_like(values)))
    elif mask is not None:
        # The divisor of the valid entries' sum is `elements * valid / total`,
        # `valid` when the mask has the losses' shape.
        total = xp.float32(xp.size(mask))
        valid = xp.sum(xp.float32(xp.cast(mask, "bool")))
        count = xp.where(xp.equal(total, elements), valid, elements * valid / total)
    else:
        count = elements
    return xp.stop_gradient(count)


class _TensorFlow:
    """The ops :func:`micro_batch_count` uses, in TensorFlow (the Keras 2
    families, Keras 3 on TensorFlow); :class:`KerasOps` has them in
    ``keras.ops``."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf
        self.convert, self.size, self.ones_like = tf.convert_to_tensor, tf.size, tf.ones_like
        self.sum, self.where, self.equal, self.stop_gradient = tf.reduce_sum, tf.where, tf.equal, tf.stop_gradient

    def cast(self, x: Any, dtype: str) -> Any:
        return self.tf.cast(x, dtype)

    def float32(self, x: Any) -> Any:
        return self.tf.cast(x, self.tf.float32)


class KerasOps:
    """:func:`micro_batch_count`'s ops in ``keras.ops`` (any Keras 3 backend)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.convert, self.size, self.ones_like = ops.convert_to_tensor, ops.size, ops.ones_like
        self.sum, self.where, self.equal, self.stop_gradient = ops.sum, ops.where, ops.equal, ops.stop_gradient
        self.cast = ops.cast

    def float32(self, x: Any) -> Any:
        return self.ops.cast(x, "float32")
