"""How a pooling layer finds the optimizer whose windows it follows (every Keras).

When an accumulating wrapper builds (its first step, in ``fit`` or a custom
loop), :func:`follow` links every pooling layer whose trainable weights are
in its ``var_list``, and returns their ``end_window`` methods for the
wrapper's ``WindowState.followers``. A layer's training forward pass decides
between pooling and its parent's own update on a run-time flag the link
sets: a custom loop's first forward pass is traced before its optimizer
builds. Where the link is known when the step is traced (``fit`` builds its
optimizer first), the layer traces the pooling branch alone.

Eagerly, a custom loop's first forward pass even *runs* before the
optimizer builds: an unlinked eager forward pass takes its parent's update,
keeping what the moving statistics were and the micro-batch
(:attr:`Link.undo`); a link made by that micro-step's own build undoes the
update and pools the micro-batch. Any other link keeps what unlinked passes
did (a warm-up ``model(x, training=True)`` before ``fit``: Keras' update).

Nothing here imports a framework until a link is made (TensorFlow then: the
layers pool on the TensorFlow backend only).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from accum_optimizer.core import moments

_POOLING_LAYERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


class Link:
    """What ties a layer to its optimizer, kept off Keras' tracking (so not
    saved).

    Attributes:
        optimizer: a weak reference to the optimizer, or ``None``.
        pooling: int32 scalar variable, 1 while linked (``None`` where the
            layer cannot pool: a backend other than TensorFlow).
        backend: the Keras backend the layer runs on (for messages).
        undo: ``(moving_mean, moving_variance, micro_batch)`` (NumPy copies):
            the moving statistics before the last eager, unlinked forward
            pass, and what that micro-batch adds to a pool; or ``None``.
        traced_unlinked: a step was traced with the parent's update because
            no optimizer had linked the layer yet, under a strategy with more
            than one replica.
    """

    def __init__(self, backend: str) -> None:
        self.optimizer: Any = None
        self.pooling: Any = None
        self.backend = backend
        self.undo: tuple | None = None
        self.traced_unlinked = False

    def owner(self) -> Any:
        """The linked optimizer, if it is alive."""
        return self.optimizer() if self.optimizer is not None else None

    def lost(self) -> bool:
        """Was it linked to an optimizer that is gone?"""
        return self.optimizer is not None and self.optimizer() is None


def register(layer: Any) -> None:
    """A built pooling layer (``layer._window_link``: its :class:`Link`;
    ``layer.moving_mean``/``moving_variance``; ``layer.add_to_pool(micro_batch)``;
    ``layer.end_window()``)."""
    _POOLING_LAYERS.add(layer)


def executing_eagerly() -> bool:
    import tensorflow as tf

    return tf.executing_eagerly()


def set_flag(link: Link, value: int) -> None:
    """Set the run-time flag now, also while a step is being traced (the
    optimizer builds inside the first step's trace)."""
    import tensorflow as tf

    with tf.init_scope():
        link.pooling.assign(value)


def forward(layer: Any, pooled: Any, parent: Any, prepare: Any) -> Any:
    """A pooling layer's training forward pass (TensorFlow).

    ``prepare()`` gives the micro-batch's moments: a tuple whose first item
    is what it adds to the pool, ``(count, mean, variance)`` over every
    replica (it runs outside any ``cond``: an all-reduce may not sit in a
    branch); ``pooled(prepared)`` normalises and pools; ``parent()`` is the
    parent layer's own training step. While linked: ``pooled``. Once the
    optimizer is gone: ``parent`` (the link is dropped). Not linked yet:
    eagerly, ``parent``, remembering what the moving statistics were and the
    micro-batch (:attr:`Link.undo`, for a link made by this micro-step's
    own build); traced, a ``tf.cond`` on the flag between the two.
    """
    link = layer._window_link
    if link.owner() is not None:
        return pooled(prepare())
    if link.lost():
        set_flag(link, 0)
        link.optimizer = None
        return parent()
    if executing_eagerly():
        micro_batch = [np.array(v) for v in prepare()[0]]
        link.undo = (np.array(layer.moving_mean.numpy()), np.array(layer.moving_variance.numpy()), micro_batch)
        return parent()
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        # The pool's writes synchronise the replicas: not inside a `cond`.
        # Traced before any link: the parent's step (a link made by this
        # trace's own build refuses, see `follow`).
        link.traced_unlinked = True
        return parent()
    prepared = prepare()
    return tf.cond(tf.greater(link.pooling, 0), lambda: pooled(prepared), parent)


def across_replicas(count: Any, mean: Any, variance: Any) -> tuple:
    """A micro-batch's moments over every replica of the strategy (in its
    replica context, with more than one replica: three all-reduces); else as
    given. Every replica then pools the same micro-batch, the one of the
    global batch, as a single device would."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return count, mean, variance
    return tuple(moments.merge_parts(tf, lambda v: context.all_reduce("sum", v), count, mean, variance))


def all_layers(model: Any) -> list:
    """Every layer of ``model``, nested models' layers included (depth first)."""
    found = []
    for layer in getattr(model, "layers", ()):
        found += [layer, *all_layers(layer)]
    return found


def check_convertible(model: Any, model_class: type, batch_normalization: type, keras_name: str,
                      module: str) -> TypeError:
    """What ``convert_batch_norm`` checks before it copies anything:
    ``TypeError`` unless ``model`` is a ``model_class``, ``ValueError`` if a
    ``batch_normalization`` layer has ``renorm=True``. Returns the
    ``TypeError`` for a subclassed model (Keras' ``clone_model`` refuses
    it)."""
    subclassed = TypeError(
        f"convert_batch_norm takes a {keras_name} Sequential or Functional model; received "
        f"{type(model).__name__}. For a subclassed model, create its layers with "
        f"accum_optimizer.layers.BatchNormalization in place of {module}.layers.BatchNormalization."
    )
    if not isinstance(model, model_class):
        raise subclassed
    for layer in all_layers(model):
        if isinstance(layer, batch_normalization) and layer.renorm:
            raise ValueError(
                f"convert_batch_norm: {layer.name!r} has renorm=True, which "
                f"accum_optimizer.layers.BatchNormalization does not support (batch renormalisation keeps its "
                f"own per-batch statistics); leave that model's BatchNormalization as it is."
            )
    return subclassed


def copy_trainable(old: Any, new: Any) -> None:
    """``trainable`` of every layer of ``old`` onto its copy ``new``, a
    nested model's before its layers' (Keras' clones leave a frozen model's
    own flag True, so that unfreezing the copy would do nothing)."""
    new.trainable = old.trainable
    for old_layer, new_layer in zip(getattr(old, "layers", ()), getattr(new, "layers", ())):
        copy_trainable(old_layer, new_layer)


def _name(optimizer: Any) -> str:
    return str(getattr(optimizer, "name", None) or type(optimizer).__name__)


def follow(optimizer: Any, var_list: Sequence[Any], eager_micro_step: bool = False) -> list:
    """Link the pooling layers whose trainable weights are among
    ``var_list`` to ``optimizer`` (an accumulating wrapper being built);
    return their ``end_window`` methods.

    ``eager_micro_step``: the build is the first micro-step's, run eagerly,
    right after that micro-step's forward pass (which took the parent's
    step, unlinked): that step is undone and its micro-batch pooled instead.
    Any other build (``fit``'s, an explicit one, a traced step's) keeps what
    unlinked forward passes did, as Keras' layer would have.

    Raises:
        ValueError: a layer already follows another live accumulating optimizer,
            or a step was traced without the link under a multi-replica strategy.
        NotImplementedError: a layer would follow it on a backend other than
            TensorFlow.
    """
    ids = {id(v) for v in var_list}
    layers = [layer for layer in list(_POOLING_LAYERS) if any(id(w) in ids for w in layer.trainable_weights)]
    if not layers:
        return []
    for layer in layers:
        if layer._window_link.pooling is None:
            raise NotImplementedError(
                f"accum_optimizer.layers.BatchNormalization follows the window of an AccumulatingOptimizer "
                f"on the TensorFlow backend only (this is {layer._window_link.backend!r}); here use "
                f"keras.layers.BatchNormalization (moving statistics per micro-batch), or "
                f"GroupNormalization/LayerNormalization."
            )
    import tensorflow as tf

    for layer in layers:
        if layer._window_link.traced_unlinked:
            layer._window_link.traced_unlinked = False
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} was traced under a distribution strategy with more "
                f"than one replica before {_name(optimizer)!r} was built, so that step updates its moving "
                f"statistics per micro-batch. Build the optimizer inside the strategy's scope before the "
                f"first step: optimizer.build(model.trainable_variables) (model.fit does), then trace the step."
            )
        current = layer._window_link.owner()
        if current is not None and current is not optimizer:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} already follows the windows of "
                f"{_name(current)!r}; a second accumulating optimizer ({_name(optimizer)!r}) trains it too. "
                f"A layer's moving statistics can follow one optimizer's windows: train it with one "
                f"AccumulatingOptimizer (delete the other), or keep it out of one of the var_lists."
            )
    for layer in layers:
        link = layer._window_link
        link.optimizer = weakref.ref(optimizer)
        set_flag(link, 1)
        undo, link.undo = link.undo, None
        if undo is not None and eager_micro_step:  # this micro-step's forward pass: pooled, not applied
            with tf.init_scope():
                layer.moving_mean.assign(undo[0])
                layer.moving_variance.assign(undo[1])
                layer.add_to_pool(tuple(tf.constant(v) for v in undo[2]))
    return [layer.end_window for layer in layers]
