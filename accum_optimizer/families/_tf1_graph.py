"""TF1 graph plumbing for the TF1 family (:mod:`~accum_optimizer.families.tf1`).

* :class:`TF1Backend`: the core's backend for graphs built by hand, whose
  assignments return the ops the algorithm orders explicitly.
* :class:`Window`: one wrapper's accumulation state in one graph (a wrapper
  used in several graphs, or eagerly, has one per graph).
* The checks of ``apply_gradients``' input and the ``TRAIN_OP`` collection
  kept as the plain optimizer leaves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from accum_optimizer import core
from accum_optimizer._compat import tf as compat
from accum_optimizer.families._tf import TFBackend, check_gradient_shapes, control_inputs

tf1 = tf.compat.v1


@dataclasses.dataclass
class Window:
    """The accumulation state of one wrapper in one graph (or eagerly)."""

    variables: list  # build order
    index: dict  # variable.ref() -> position in `variables`
    state: core.WindowState | None  # None for gradient_accumulation_steps == 1
    micro_steps: Any
    global_step: Any = None  # of the first apply_gradients in this graph (for flush)

    def own_variables(self) -> list:
        if self.state is None:
            return [self.micro_steps]
        rows = [t for t in (self.state.touched_rows or []) if t is not None]
        return [self.micro_steps, self.state.grad_received, *self.state.acc_grads, *rows,
                self.state.mini_step, self.state.window_weight, *self.extra_variables().values()]

    def extra_variables(self) -> dict:
        """The state of a skipping policy and of a schedule, by name (empty
        under ``"propagate"`` with an int N)."""
        if self.state is None:
            return {}
        names = ("skipped_micro_steps", "skipped_windows", "window_poisoned", "updates")
        return {n: getattr(self.state, n) for n in names if getattr(self.state, n) is not None}


class TF1Backend(TFBackend):
    """The core's backend for TF1: every assignment returns its op (``None``
    eagerly) so that the algorithm can order them with control
    dependencies; ``cond`` is ``tf.cond`` with branches returning grouped
    ops. ``made`` collects the ops made outside any ``cond`` (grouped into
    the train op)."""

    def __init__(self, apply_inner: Any = None) -> None:
        super().__init__(apply_inner)
        self.made: list = []
        self._depth = 0

    def _record(self, op: Any) -> Any:
        if tf.executing_eagerly():
            return None
        op = op.op if not isinstance(op, tf.Operation) else op
        if self._depth == 0:
            self.made.append(op)
        return op

    def assign(self, variable: Any, value: Any) -> Any:
        return self._record(variable.assign(value, read_value=False))

    def assign_add(self, variable: Any, value: Any) -> Any:
        if isinstance(value, tf.IndexedSlices):
            return self._record(tf1.scatter_add(variable, value.indices, value.values))
        return self._record(variable.assign_add(value, read_value=False))

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> Any:
        return self._record(tf1.scatter_update(variable, indices, updates))

    def cond(self, pred: Any, true_fn: Any, false_fn: Any) -> Any:
        def branch(fn):
            def run():
                self._depth += 1
                try:
                    return tf.group(*control_inputs(fn()))
                finally:
                    self._depth -= 1

            return run

        return tf.cond(pred, branch(true_fn), branch(false_fn))


@contextlib.contextmanager
def gated(inner: Any, gates: dict, variables: list):
    """Skip, per variable, the ``inner`` optimizer's update of variables
    without a gradient in the window.

    ``gates`` (from :func:`accum_optimizer.core.micro_step`) maps each
    variable without a gradient on this micro-step to a boolean that is
    true iff it had one earlier in the window (another train op gave it
    one). For those, the inner optimizer's per-variable update methods and
    the variable's constraint run under a ``tf.cond`` on it; ``_finish``
    (Adam's beta powers) and ``global_step`` move once per update, as in
    the large-batch reference.
    """
    if not gates:
        yield
        return
    remove = compat.gate_constraints(
        variables, gates, [compat.tf1_install_gates(inner, {id(variables[i]): g for i, g in gates.items()})]
    )
    try:
        yield
    finally:
        remove()


def unknown_message(name: str, unknown: list, window: Window) -> str:
    return (
        f"AccumulatingOptimizer '{name}' was built for "
        f"{len(window.variables)} variables ({[v.name for v in window.variables]}) "
        f"and got gradients for others: {unknown}. All train ops of one "
        "AccumulatingOptimizer share one window, so its update must know "
        "every variable: call opt.build(<union of the var_lists>) before "
        "the first minimize/apply_gradients, or use one "
        "AccumulatingOptimizer per train op (separate windows)."
    )


def state_property(name: str, what: str) -> property:
    """A wrapper's property: its window's ``name`` variable in the current
    graph (``None`` before it is built there, or where the window has none)."""

    def fget(self: Any) -> Any:
        window = self._window()
        return None if window is None or window.state is None else getattr(window.state, name)

    return property(fget, doc=f"int64 scalar variable, {what}; ``None`` where not kept "
                              "(skip counters: skipping policies only; ``updates``: schedules only).")


# ------------------------------------------------------------------ helpers
def graph_key() -> Any:
    """The graph whose variables are current (``None`` eagerly, also while a
    ``tf.function`` is traced)."""
    with tf.init_scope():
        return None if tf.executing_eagerly() else tf1.get_default_graph()


def op_name(variable: Any) -> str:
    return variable.name.split(":")[0]


def global_variables_except(excluded: Sequence[Any]) -> list:
    refs = {v.ref() for v in excluded}
    return [v for v in tf1.global_variables() if v.ref() not in refs]


def collection_snapshot() -> list:
    return list(tf1.get_collection(tf1.GraphKeys.TRAIN_OP))


def collection_restore(before: list, train_op: Any) -> None:
    ref = tf1.get_collection_ref(tf1.GraphKeys.TRAIN_OP)
    ref[:] = before + ([train_op] if train_op not in before else [])


def is_variable(value: Any) -> bool:
    return isinstance(value, tf.Variable)


def check_variables(values: Any, arg: str) -> list:
    values = list(values)
    for v in values:
        if not is_variable(v):
            raise TypeError(
                f"`{arg}` must hold tf.Variable objects. Received an element "
                f"{v!r} of type {type(v).__module__}.{type(v).__qualname__}."
            )
    return values


def check_grads_and_vars(grads_and_vars: Any) -> list:
    """``(gradient, variable)`` pairs as TF1's ``apply_gradients`` accepts
    them, converted (gradients to tensors or ``IndexedSlices``) and checked."""
    pairs = []
    for pair in grads_and_vars:
        try:
            g, v = pair
        except (TypeError, ValueError):
            raise TypeError(
                "`grads_and_vars` must be (gradient, variable) pairs. Received "
                f"an element {pair!r}."
            ) from None
        if not is_variable(v):
            raise TypeError(
                "`grads_and_vars` must pair each gradient with a tf.Variable. "
                f"Received {v!r} of type {type(v).__module__}.{type(v).__qualname__}."
            )
        if g is not None:
            try:
                g = tf.convert_to_tensor(g, dtype_hint=v.dtype.base_dtype) if not isinstance(
                    g, tf.IndexedSlices) else g
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"The gradient of {v.name!r} must be a tensor, a "
                    f"tf.IndexedSlices or None. Received {g!r} ({e})."
                ) from None
            check_gradient_shapes([g], [v], op_name)
        pairs.append((g, v))
    if not pairs:
        raise ValueError("No variables provided: `grads_and_vars` is empty.")
    refs = [v.ref() for _, v in pairs]
    if len(set(refs)) != len(refs):
        raise ValueError(
            "`grads_and_vars` lists a variable more than once: "
            f"{[v.name for _, v in pairs]}. Sum its gradients first."
        )
    return pairs
