"""TensorFlow's private symbols used by the families, each declared once.

TF2 (``tf.function`` families) and the ``tf.compat.v1.train.Optimizer``
internals of the TF1 family. Checked on TF 2.15.1, 2.16.2 and 2.21.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer._compat import attributes, private, require

CHECKED = "TensorFlow 2.15.1, 2.16.2, 2.21"

# ----------------------------------------------------------------- TF2
XLA_CONTEXT = private(
    "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
    "tensorflow",
    "DisableCopyOnRead has no XLA kernel: it is left out of graphs compiled by XLA "
    "(jit_compile=True), and no public API says whether a graph is",
    CHECKED,
    lambda t: __import__(
        "tensorflow.python.ops.control_flow_util", fromlist=["GraphOrParentsInXlaContext"]
    ).GraphOrParentsInXlaContext,
)


def in_xla_context() -> bool:
    """Is the graph being traced compiled by XLA (``jit_compile=True``)?"""
    if tf.executing_eagerly():
        return False
    return bool(require(XLA_CONTEXT, tf)(tf.compat.v1.get_default_graph()))


def disable_copy_on_read(variable: Any) -> None:
    """Switch a variable that a scatter op just wrote back to TensorFlow's
    normal access mode (``tf.raw_ops.DisableCopyOnRead``, a public op).

    A scatter op puts a resource variable in *copy-on-read* mode
    (``EnsureSparseVariableAccess`` in
    ``tensorflow/core/kernels/resource_variable_ops.h``), and from then on
    every dense read copies the whole buffer: for an embedding table that the
    sparse window scatter-updates, a table-sized copy per forward pass (30 ms
    at 10^6 x 64 on 2 CPU cores). Back in normal mode a dense read aliases the
    buffer, and the next scatter copies it only if such a read is still
    alive (TensorFlow's own check), so this is always safe. A no-op where the
    op does not exist, under XLA, or where the variable has no handle
    (cross-replica context).
    """
    op = getattr(tf.raw_ops, "DisableCopyOnRead", None)
    if op is None or in_xla_context():
        return
    inner = getattr(variable, "value", None)  # a Keras 3 variable's tf.Variable
    variable = inner if isinstance(inner, tf.Variable) else variable
    try:
        handle = variable.handle
    except (AttributeError, ValueError):
        return
    op(resource=handle)


MAYBE_MERGE_CALL = private(
    "tf.__internal__.distribute.interim.maybe_merge_call",
    "tensorflow",
    "the Keras 2 family gates weight decay where Keras 2 runs it: in a merge_call of its own "
    "(what Keras 2's own _apply_weight_decay calls), or directly where the strategy needs none",
    CHECKED,
    lambda t: t.__internal__.distribute.interim.maybe_merge_call,
)


def maybe_merge_call(fn: Callable[..., Any], strategy: Any, *args: Any) -> Any:
    return require(MAYBE_MERGE_CALL, tf)(fn, strategy, *args)


CONSTRAINT = private(
    "tf.Variable._constraint (of a variable, the primary of a distributed variable, the "
    "variable inside an AutoCastVariable)",
    "tensorflow",
    "tf.Variable.constraint is read-only; a variable without a gradient in the window must not "
    "be constrained at the update, which Keras 2, OptimizerV2 and TF1 optimizers do by reading "
    "it: it is replaced for the one traced update",
    CHECKED,
    lambda t: _constraint_of_a_fresh_variable(t),
)


def _constraint_of_a_fresh_variable(t: Any) -> Any:
    with t.Graph().as_default():  # a throwaway graph: no state in the user's
        return t.compat.v1.Variable(0.0, constraint=abs, use_resource=True)._constraint


def gate_constraints(variables: Sequence[Any], gates: dict, undo: list) -> Callable[[], None]:
    """:func:`gate_constraint` for each variable in ``gates`` (index in
    ``variables`` -> gate), appending each undo to ``undo``; returns the
    function that runs ``undo`` in reverse."""
    for i, gate in gates.items():
        restore = gate_constraint(variables[i], gate)
        if restore is not None:
            undo.append(restore)

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return remove


def gate_constraint(variable: Any, gate: Any) -> Callable[[], None] | None:
    """Make ``variable``'s constraint (if any) apply only where ``gate``
    holds; return the function that undoes it, or ``None``."""
    require(CONSTRAINT, tf)
    holders = []
    for component in getattr(variable, "values", None) or [variable]:
        holder = component
        for _ in range(3):
            if isinstance(holder, tf.distribute.DistributedValues):
                holder = holder._primary
            elif hasattr(holder, "_variable") and not hasattr(holder, "_constraint"):
                holder = holder._variable  # AutoCastVariable
            else:
                break
        if getattr(holder, "_constraint", None) is not None and all(h is not holder for h in holders):
            holders.append(holder)
    if not holders:
        return None
    originals = [h._constraint for h in holders]
    for h, c in zip(holders, originals):
        h._constraint = lambda x, c=c: tf.cond(gate, lambda: c(x), lambda: tf.identity(x))

    def undo() -> None:
        for h, c in zip(holders, originals):
            h._constraint = c

    return undo


# ----------------------------------------------------------------- TF1
TF1_PER_VARIABLE = private(
    "tf.compat.v1.train.Optimizer._apply_dense, _resource_apply_dense, "
    "_apply_sparse_duplicate_indices, _resource_apply_sparse_duplicate_indices, _create_slots",
    "tensorflow",
    "the per-variable updates apply_gradients makes (gated per variable, replaced on the inner "
    "instance during one update), and the slot creation apply_gradients does under init_scope "
    "(done once at build, outside the update's cond, so that slot names do not depend on where "
    "they are first made)",
    CHECKED,
    lambda t: attributes(t.compat.v1.train.Optimizer, *_TF1_UPDATES, "_create_slots"),
)

_TF1_UPDATES = (
    "_apply_dense",
    "_resource_apply_dense",
    "_apply_sparse_duplicate_indices",
    "_resource_apply_sparse_duplicate_indices",
)


def tf1_create_slots(inner: Any, variables: Sequence[Any]) -> None:
    """The slots ``inner.apply_gradients`` would create for ``variables``."""
    require(TF1_PER_VARIABLE, tf)
    inner._create_slots(list(variables))


def tf1_install_gates(inner: Any, gates_by_id: dict) -> Callable[[], None]:
    """Run ``inner``'s per-variable updates of the variables in
    ``gates_by_id`` (``id(variable)`` -> boolean scalar) under ``tf.cond``;
    return the function that undoes it."""
    require(TF1_PER_VARIABLE, tf)
    return patch_per_variable([inner], _TF1_UPDATES, gates_by_id, id)


def patch_per_variable(
    optimizers: Sequence[Any], methods: Sequence[str], gates: dict, key: Callable[[Any], Any]
) -> Callable[[], None]:
    """Replace, on each optimizer instance, each per-variable update method
    ``method(grad, var, ...)`` by one that runs it under ``tf.cond`` on the
    gate of ``key(var)`` (unchanged for variables without a gate). Returns
    the function that removes the replacements."""
    for opt in optimizers:
        for method in methods:
            object.__setattr__(opt, method, _gated(getattr(opt, method), gates, key))

    def undo() -> None:
        for opt in optimizers:
            for method in methods:
                object.__delattr__(opt, method)

    return undo


def _gated(method: Any, gates: dict, key: Callable[[Any], Any]) -> Callable:
    def update(grad: Any, var: Any, *args: Any, **kwargs: Any) -> Any:
        gate = gates.get(key(var))
        if gate is None:
            return method(grad, var, *args, **kwargs)
        return tf.cond(gate, lambda: tf.group(method(grad, var, *args, **kwargs)), tf.no_op)

    return update


TRACKABLE = private(
    "tf.__internal__.tracking.Trackable._trackable_children / _lookup_dependency / "
    "_handle_deferred_dependencies",
    "tensorflow",
    "tf.train.Checkpoint saves and restores an object's dependencies through these: the wrappers "
    "list their per-graph window variables (TF1) and Keras 2's iterations (restored by name into "
    "a RestoredOptimizer) there, and restore variables created after the restore was requested",
    CHECKED,
    lambda t: attributes(t.__internal__.tracking.Trackable, "_trackable_children", "_lookup_dependency",
                         "_handle_deferred_dependencies"),
)


SLOT_OWNERS = private(
    "tensorflow.python.checkpoint.util.serialize_slot_variables and async_checkpoint_helper "
    "(a trackable owns slot variables iff \"get_slot_names\" in dir(trackable))",
    "tensorflow",
    "the legacy and TF1 wrappers answer get_slot/get_slot_names with their inner optimizer's slots; "
    "tf.train.Checkpoint saves, as slots of an object, what get_slot returns for every name "
    "get_slot_names lists, but only for objects whose dir() lists get_slot_names: the wrappers leave "
    "it out of dir(), so each slot stays saved once, by the inner optimizer (the layout of earlier "
    "versions; listed twice, the save fails: 'A slot variable was re-used as a dependency')",
    CHECKED,
    lambda t: _slot_owners_found_by_dir(),
)


def _slot_owners_found_by_dir() -> Any:
    import inspect

    from tensorflow.python.checkpoint import async_checkpoint_helper, util

    try:
        sources = [inspect.getsource(util.serialize_slot_variables), inspect.getsource(async_checkpoint_helper)]
    except OSError as e:
        raise AttributeError(f"no source to check: {e}") from None
    if not all('"get_slot_names" in dir(' in source for source in sources):
        raise AttributeError('tf.train.Checkpoint no longer finds slot owners by `"get_slot_names" in dir(obj)`')
    return util.serialize_slot_variables


class InnerSlots:
    """``get_slot(var, name)`` and ``get_slot_names()`` of a wrapper answer
    with its ``inner_optimizer``'s slots (read-only: the wrapper makes none),
    what code written for the inner optimizer reads; ``dir()`` leaves
    ``get_slot_names`` out, so that ``tf.train.Checkpoint`` does not save
    those slots a second time as the wrapper's (:data:`SLOT_OWNERS`)."""

    def get_slot_names(self) -> list:
        """The inner optimizer's slot names (``["m", "v"]`` for Adam)."""
        require(SLOT_OWNERS, tf)
        return list(self.inner_optimizer.get_slot_names())

    def get_slot(self, var: Any, slot_name: str) -> Any:
        """The inner optimizer's slot ``slot_name`` of ``var`` (as its
        ``get_slot``, errors included)."""
        return self.inner_optimizer.get_slot(var, slot_name)

    def __dir__(self) -> list:
        return [name for name in super().__dir__() if name != "get_slot_names"]


class TF1Trackable:
    """The TF1 wrapper's override of ``Trackable._trackable_children``: what
    ``tf.train.Checkpoint`` saves of it is what its
    ``_checkpoint_children(children)`` returns (its per-graph state)."""

    def _trackable_children(self, *args: Any, **kwargs: Any) -> dict:
        require(TRACKABLE, tf)
        return self._checkpoint_children(super()._trackable_children(*args, **kwargs))


def restore_deferred(owner: Any, name: str, trackable: Any) -> None:
    """Restore ``trackable`` as ``owner``'s dependency ``name`` if a
    checkpoint restore of ``owner`` is pending (``tf.train.Checkpoint``'s
    deferred restoration)."""
    require(TRACKABLE, tf)
    owner._handle_deferred_dependencies(name=name, trackable=trackable)
