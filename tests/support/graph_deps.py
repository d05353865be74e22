"""What a traced train step's window ``cond`` waits for, read from its
graph (``tf.function``, XLA off): the ops its predicate and control inputs
wait for, and, in its update branch (a ``FunctionDef`` of the graph's
library), what each window gradient waits for; and the ops one micro-step
of each kind runs (:func:`micro_step_ops`)."""

from __future__ import annotations

import tensorflow as tf

WRITES = ("Assign", "Scatter")  # op types that write a variable contain these


def closure(start, edges) -> set:
    """Every op reached from ``start`` by ``edges(op)``, transitively."""
    seen, todo = set(), list(start)
    while todo:
        for nxt in edges(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def parents(op) -> list:
    """What ``op`` waits for: its data and control inputs."""
    return [t.op for t in op.inputs] + list(op.control_inputs)


def consumers(op) -> list:
    """The ops that read ``op``'s outputs."""
    return [c for t in op.outputs for c in t.consumers()]


def ancestors(op) -> set:
    """Every op ``op`` waits for in its graph, transitively."""
    return closure([op], parents)


def branch_graph(graph, cond, branch: str, library: dict | None = None):
    """The ``branch`` (``"then_branch"``, ``"else_branch"``) of a ``cond``
    as a graph, read from the function library of the top-level ``graph``
    (or ``library``, ``{name: FunctionDef}``: a nested ``cond``'s); its
    ``inputs`` are the cond's inputs after the predicate, in order."""
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

    if library is None:
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    return function_def_to_graph(library[cond.get_attr(branch).name])


class Traced:
    """A traced train step's ``graph`` and its window ``cond`` (the
    top-level ``cond`` that takes the gradients: the one that picks update
    micro-steps; Keras 2 and legacy wrappers run another before it, which
    derives a restored window's position and takes one gradient, the
    guard), for a ``model`` whose gradients are that cond's inputs computed
    from the step's inputs."""

    def __init__(self, graph, model) -> None:
        self.model, self.graph = model, graph
        inputs = {t.op for t in self.graph.inputs if t.dtype != tf.resource}
        self.from_inputs = {op for op in self.graph.get_operations() if ancestors(op) & inputs}
        conds = [op for op in self.graph.get_operations() if op.type in ("If", "StatelessIf")]
        # A cond's inputs computed from the step's inputs: the gradients.
        taking = {c: [i for i, t in enumerate(c.inputs[1:]) if t.op in self.from_inputs] for c in conds}
        # (Keras 2's and legacy's restored-position check takes one: the guard.)
        self.cond = max((c for c in conds if taking[c]), key=lambda c: len(taking[c]))
        self.gradient_inputs = taking[self.cond]

    def cond_waits_for(self) -> tuple:
        """(op types that write a variable, and the gradients among the
        cond's inputs) that the cond waits for: its predicate's and its
        control inputs' ancestors, read as TensorFlow runs a lowered
        ``cond`` (XLA off): an earlier ``cond`` among them (Keras 2's and
        legacy's restored-position check) is waited for through its
        predicate and control inputs only (its result is ready when its
        taken branch ends; what only its other branch uses is not waited
        for)."""
        def lowered(op) -> list:
            if op.type in ("If", "StatelessIf"):
                return [op.inputs[0].op, *op.control_inputs]
            return parents(op)

        waited = [self.cond.inputs[0].op, *self.cond.control_inputs]
        found = set(waited) | closure(waited, lowered)
        writes = sorted({a.type for a in found if any(w in a.type for w in WRITES)})
        gradients = [i for i in self.gradient_inputs if self.cond.inputs[1 + i].op in found]
        return writes, gradients

    def unguarded_writes(self) -> list:
        """The ops that write a variable in the branches of the step's
        top-level ``cond``s (and of the ``cond``s nested in them) and wait
        for no value computed from the step's inputs: the writes a step whose
        input ends (``OutOfRange``) could still run. Read as TensorFlow runs
        a lowered ``cond`` (XLA off): an op of a branch waits for the
        predicate and the ``cond``'s control inputs, and for the inputs it
        uses (a ``cond`` waiting for such a value guards all it holds)."""
        library = {f.signature.name: f for f in self.graph.as_graph_def().library.function}
        found: list = []

        def waits(ops, sources) -> bool:
            return any(op in sources or ancestors(op) & sources for op in ops)

        def scan(graph, sources, where):
            for op in graph.get_operations():
                if op.type in ("If", "StatelessIf"):
                    if waits([op.inputs[0].op, *op.control_inputs], sources):
                        continue
                    taken = [i for i, t in enumerate(op.inputs[1:]) if waits([t.op], sources)]
                    for branch in ("then_branch", "else_branch"):
                        inner = branch_graph(graph, op, branch, library)
                        scan(inner, {inner.inputs[i].op for i in taken}, f"{where}{op.name}.{branch}/")
                elif where and any(w in op.type for w in WRITES) and not waits([op], sources):
                    found.append(f"{where}{op.name}")

        scan(self.graph, self.from_inputs, "")
        return found

    def window_gradients_wait_for(self, accumulators) -> list:
        """For each accumulator, the gradients (indices among the cond's
        inputs) that its window gradient in the update branch waits for: the
        first ``RealDiv`` or ``Mul`` downstream of its reads (``acc / Σcᵢ``,
        or ``acc · (1/N)`` for a power-of-two N)."""
        args = branch_graph(self.graph, self.cond, "then_branch").inputs
        gradients = {args[i].op: i for i in self.gradient_inputs}
        internal = {id(ext): internal for ext, internal in self.graph.captures}
        waits = []
        for acc in accumulators:
            handle = internal[id(acc.handle)]
            arg = args[[t is handle for t in self.cond.inputs[1:]].index(True)]
            reads = [op for op in arg.consumers() if op.type == "ReadVariableOp"]
            divisions = [op for op in closure(reads, consumers) if op.type in ("RealDiv", "Mul")]
            assert divisions, acc.path
            first = min(divisions, key=lambda op: len(ancestors(op)))
            waits.append(sorted(gradients[a] for a in ancestors(first) if a in gradients))
        return waits


def own_and_guard(waits: list) -> tuple | None:
    """``(guard, own)`` where the gradients each window gradient waits for
    (``waits``, :meth:`Traced.window_gradients_wait_for`) are its own and
    one guard, the same for all, which is the last window's own gradient
    (``own``: each window's own, all distinct); else ``None``."""
    if not waits or len(waits[-1]) != 1:
        return None
    [guard] = waits[-1]
    own = [sorted(set(w) - {guard}) for w in waits[:-1]]
    if any(guard not in w or len(o) != 1 for w, o in zip(waits, own)):
        return None
    own = [o[0] for o in own] + [guard]
    return (guard, own) if len(set(own)) == len(own) else None


def micro_step_ops(graph, branch: str = "else_branch") -> list:
    """The ops one micro-step of a traced step runs: those at the top level
    of its ``graph``, plus, for each top-level ``cond`` (the window's), those
    of its ``branch``: ``"else_branch"``, an accumulate-only micro-step;
    ``"then_branch"``, an update (read from the graph's function library)."""
    ops = list(graph.get_operations())
    for op in list(ops):
        if op.type in ("If", "StatelessIf"):
            ops += branch_graph(graph, op, branch).get_operations()
    return ops
