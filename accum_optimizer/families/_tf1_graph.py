"""TF1 graph plumbing for the TF1 family (:mod:`~accum_optimizer.families.tf1`).

* :class:`GraphWindow`: one wrapper's window in one graph (a wrapper used
  in several graphs, or eagerly, has one per graph): the shared
  :class:`~accum_optimizer.families._window.Window` (build order, gating)
  with the graph's state record.
* :func:`train_op`: a micro-step's or flush's ops grouped into the op to
  run, the ``TRAIN_OP`` collection kept as the plain optimizer leaves it.
* The checks of ``apply_gradients``' input.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import tensorflow as tf

from accum_optimizer import core
from accum_optimizer.core import layout
from accum_optimizer._compat import tf as compat
from accum_optimizer.families import _window
from accum_optimizer.families._tf_backend import TF1Backend, check_gradient_shapes, control_inputs

tf1 = tf.compat.v1


class GraphWindow(_window.Window):
    """The window of one wrapper in one graph (or eagerly): the shared
    window keyed by ``variable.ref()``, gated by the inner optimizer's
    per-variable methods, plus this graph's state record."""

    def __init__(self, inner: Any, variables: list, state: core.WindowState | None, micro_steps: Any) -> None:
        super().__init__()
        self.hooks = _window.Hooks(
            key_of=lambda v: v.ref(), update_inner=None,
            install_gates=lambda gates: install_gates(inner, gates, self.build_order),
        )
        self.set_build_order(variables)
        self.state = state  # None for gradient_accumulation_steps == 1
        self.micro_steps = micro_steps
        self.global_step: Any = None  # of the first apply_gradients in this graph (for flush)

    @property
    def variables(self) -> list:
        return self.build_order

    def own_variables(self) -> list:
        if self.state is None:
            return [self.micro_steps]
        rows = [t for t in (self.state.touched_rows or []) if t is not None]
        return [self.micro_steps, self.state.grad_received, *self.state.acc_grads, *rows,
                self.state.mini_step, self.state.window_weight, *self.extra_variables().values()]

    def children(self) -> dict:
        """The variables a ``tf.train.Checkpoint`` saves, by name: what
        the TF1 wrapper's ``_build`` restores them by (``acc_grad_{i}``,
        ``touched_rows_{i}``: by position in build order)."""
        children = {"micro_steps": self.micro_steps}
        if self.state is None:
            return children
        children["grad_received"] = self.state.grad_received
        for i, acc in enumerate(self.state.acc_grads):
            children[f"acc_grad_{i}"] = acc
            tracker = self.state.rows_tracker(i)
            if tracker is not None:
                children[f"touched_rows_{i}"] = tracker
        children["mini_step"] = self.state.mini_step
        children["window_weight"] = self.state.window_weight
        return {**children, **self.extra_variables()}

    def extra_variables(self) -> dict:
        """The state of a skipping policy and of a schedule, by name (empty
        under ``"propagate"`` with an int N)."""
        if self.state is None:
            return {}
        names = ("skipped_micro_steps", "skipped_windows", "window_poisoned", "updates")
        return {n: getattr(self.state, n) for n in names if getattr(self.state, n) is not None}


def make_state(make: Callable[..., Any], name: str, var_list: list, sparse_refs: set,
               counters: Sequence[str] | None, accumulator_dtype: Callable[[Any], Any]) -> tuple:
    """``(micro_steps, state)``: the window's variables in this graph, in the
    order of :data:`accum_optimizer.core.layout.BUILDS` ``["tf1"]``, each made
    by ``make(name, initial_value, colocate_with, slot=None)``: the counters
    and the window's count in the wrapper's name scope, beside the first
    variable by name; each accumulator (and, for a sparse variable, its row
    tracker: ``ref()`` in ``sparse_refs``) in the variable's, beside it.
    ``state`` is the :class:`~accum_optimizer.core.WindowState`, or ``None``
    where the wrapper does not accumulate (``counters`` is ``None``). The
    window's position starts at 0, a fresh state's; state restored from a
    checkpoint saved without it resumes at ``micro_steps % N``
    (:func:`accum_optimizer.core.resume_position`)."""
    first = min(var_list, key=lambda v: v.name)
    sparse = frozenset(i for i, v in enumerate(var_list) if v.ref() in sparse_refs)
    specs = layout.window_specs(layout.BUILDS["tf1"], [tuple(v.shape) for v in var_list], counters or (),
                                counters is not None, sparse)

    def made(spec: layout.Spec) -> Any:
        if spec.index is None:
            with tf.name_scope(f"{name}/"):
                return make(spec.name, tf.fill(list(spec.shape), tf.constant(spec.initial, spec.dtype)), first)
        v = var_list[spec.index]
        dtype = accumulator_dtype(v) if spec.dtype is None else spec.dtype
        with tf.name_scope(f"{op_name(v)}/{name}/"):
            return make(spec.name, tf.zeros(spec.shape, dtype), v, slot=(spec.name, spec.index))

    state = layout.collect(specs, [made(spec) for spec in specs], len(var_list))
    if counters is None:
        return state["micro_steps"], None
    trackers = state["touched_rows"]
    return state["micro_steps"], core.WindowState(
        state["acc_grad"], state["micro_steps"], state["grad_received"], state["mini_step"], state["window_weight"],
        touched_rows=trackers if any(t is not None for t in trackers) else None,
        variable_dtypes=[v.dtype.base_dtype for v in var_list], **{n: state[n] for n in counters},
    )


def install_gates(inner: Any, gates: dict, variables: list) -> Callable[[], None]:
    """Skip, per variable, the ``inner`` optimizer's update of variables
    without a gradient in the window; returns the remover.

    ``gates`` (from :func:`accum_optimizer.core.micro_step`) maps each
    variable without a gradient on this micro-step to a boolean that is
    true iff it had one earlier in the window (another train op gave it
    one). For those, the inner optimizer's per-variable update methods and
    the variable's constraint run under a ``tf.cond`` on it; ``_finish``
    (Adam's beta powers) and ``global_step`` move once per update, as in
    the large-batch reference.
    """
    return compat.gate_constraints(
        variables, gates, [compat.tf1_install_gates(inner, {id(variables[i]): g for i, g in gates.items()})]
    )


class TrainOp:
    """The op of one micro-step or flush, built in :func:`train_op`:
    ``backend`` makes the ops; ``parts`` (set by the caller) are the
    outputs to group with them. ``op`` is ``None`` eagerly."""

    def __init__(self, apply_inner: Any = None) -> None:
        self.backend = TF1Backend(apply_inner)
        self.parts: Any = ()
        self.op: Any = None


@contextlib.contextmanager
def train_op(name: str | None, default_name: str, apply_inner: Any = None, register: bool = True):
    """Build one micro-step's (or flush's) op: yields a :class:`TrainOp`
    whose ``backend`` the core runs with, in a name scope; then (in a graph)
    groups what it made into ``op``. The inner ``apply_gradients``
    registers its update op, inside the update branch, in ``TRAIN_OP``
    (control flow v1 builds branches in this graph); the collection is put
    back as it was, plus ``op`` where ``register`` (a train op; a flush is
    not one)."""
    graph_mode = not tf.executing_eagerly()
    before = collection_snapshot() if graph_mode else None
    step = TrainOp(apply_inner)
    with tf1.name_scope(name, default_name) as scope:
        yield step
        if graph_mode:
            step.op = tf.group(*step.backend.made, *control_inputs(step.parts), name=scope)
    if graph_mode:
        tf1.get_collection_ref(tf1.GraphKeys.TRAIN_OP)[:] = before
        if register:
            collection_restore(before, step.op)


def unknown_message(name: str, unknown: list, window: GraphWindow) -> str:
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
        window = self._graph_window()
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


def check_build_arguments(var_list: Any, sparse_var_list: Any) -> tuple[list, list]:
    """``build``'s arguments as lists, checked.

    Raises:
        TypeError: an element is not a ``tf.Variable``.
        ValueError: ``var_list`` is empty or has a variable twice, or
            ``sparse_var_list`` is not a subset of it.
    """
    var_list = check_variables(var_list, "var_list")
    sparse = check_variables(sparse_var_list, "sparse_var_list")
    if not var_list:
        raise ValueError("`var_list` must not be empty. Received: var_list=[].")
    refs = {v.ref() for v in var_list}
    if len(refs) != len(var_list):
        raise ValueError(f"`var_list` lists a variable more than once: {[v.name for v in var_list]}.")
    outside = [v.name for v in sparse if v.ref() not in refs]
    if outside:
        raise ValueError(f"`sparse_var_list` must be a subset of `var_list`; not in var_list: {outside}.")
    return var_list, sparse


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
