"""What a traced train step's window ``cond`` waits for, read from its
graph (``tf.function``, XLA off): the ops its predicate and control inputs
wait for, and, in its update branch (a ``FunctionDef`` of the graph's
library), what each window gradient waits for; and the ops one micro-step
of each kind runs (:func:`micro_step_ops`)."""

from __future__ import annotations

import tensorflow as tf

WRITES = ("Assign", "Scatter")  # op types that write a variable contain these


def ancestors(op) -> set:
    """Every op ``op`` waits for in its graph: data and control inputs, transitively."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


class Traced:
    """A traced train step's ``graph`` and its window ``cond`` (the one
    top-level ``cond`` that takes gradients: the one that picks update
    micro-steps; Keras 2 and legacy wrappers run another before it, which
    derives a restored window's position), for a ``model`` whose gradients
    are that cond's inputs computed from the step's inputs."""

    def __init__(self, graph, model) -> None:
        self.model, self.graph = model, graph
        inputs = {t.op for t in self.graph.inputs if t.dtype != tf.resource}
        self.from_inputs = {op for op in self.graph.get_operations() if ancestors(op) & inputs}
        conds = [op for op in self.graph.get_operations() if op.type in ("If", "StatelessIf")]
        # A cond's inputs computed from the step's inputs: the gradients.
        taking = {c: [i for i, t in enumerate(c.inputs[1:]) if t.op in self.from_inputs] for c in conds}
        [self.cond] = [c for c in conds if taking[c]]
        self.gradient_inputs = taking[self.cond]

    def cond_waits_for(self) -> tuple:
        """(op types that write a variable, and the gradients among the
        cond's inputs) that the cond waits for: its predicate's and its
        control inputs' ancestors."""
        waited = [self.cond.inputs[0].op, *self.cond.control_inputs]
        found = set(waited).union(*(ancestors(op) for op in waited))
        writes = sorted({a.type for a in found if any(w in a.type for w in WRITES)})
        gradients = [i for i in self.gradient_inputs if self.cond.inputs[1 + i].op in found]
        return writes, gradients

    def window_gradients_wait_for(self, accumulators) -> list:
        """For each accumulator, the gradients (indices among the cond's
        inputs) that its window gradient in the update branch waits for: the
        first ``RealDiv`` or ``Mul`` downstream of its reads (``acc / Σcᵢ``,
        or ``acc · (1/N)`` for a power-of-two N), read from the branch's
        ``FunctionDef``."""
        library = {f.signature.name: f for f in self.graph.as_graph_def().library.function}
        branch = library[self.cond.get_attr("then_branch").name]
        args = [a.name for a in branch.signature.input_arg]
        nodes = {n.name: n for n in branch.node_def}
        parents = {name: [i.lstrip("^").split(":")[0] for i in n.input] for name, n in nodes.items()}
        children: dict = {}
        for name, ps in parents.items():
            for p in ps:
                children.setdefault(p, []).append(name)

        def closure(start: list, edges: dict) -> set:
            seen, todo = set(), list(start)
            while todo:
                for p in edges.get(todo.pop(), []):
                    if p not in seen:
                        seen.add(p)
                        todo.append(p)
            return seen

        internal = {id(ext): internal for ext, internal in self.graph.captures}
        gradients = {args[i]: i for i in self.gradient_inputs}
        waits = []
        for acc in accumulators:
            handle = internal[id(acc.handle)]
            arg = args[[t is handle for t in self.cond.inputs[1:]].index(True)]
            reads = [n for n, node in nodes.items() if node.op == "ReadVariableOp" and parents[n] == [arg]]
            divisions = [d for d in closure(reads, children) if nodes[d].op in ("RealDiv", "Mul")]
            assert divisions, acc.path
            first = min(divisions, key=lambda d: len(closure([d], parents)))
            waits.append(sorted(gradients[a] for a in closure([first], parents) if a in gradients))
        return waits


def micro_step_ops(graph, branch: str = "else_branch") -> list:
    """The ops one micro-step of a traced step runs: those at the top level
    of its ``graph``, plus, for each top-level ``cond`` (the window's), those
    of its ``branch``: ``"else_branch"``, an accumulate-only micro-step;
    ``"then_branch"``, an update (read from the graph's function library)."""
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

    ops = list(graph.get_operations())
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    for op in list(ops):
        if op.type in ("If", "StatelessIf"):
            ops += function_def_to_graph(library[op.get_attr(branch).name]).get_operations()
    return ops
