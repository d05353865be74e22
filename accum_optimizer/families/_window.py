"""The window object: what a wrapper holds beside its variables, in one place.

Every family's ``AccumulatingOptimizer`` keeps one :class:`Window` in one
attribute (``_window``) that neither Keras nor TensorFlow tracks (a
framework's ``__setattr__`` would wrap the lists of model variables in it
and save them as the optimizer's dependencies). The variables themselves
(counters, accumulators, row trackers) are the wrapper's own, tracked and
saved by the framework; the window holds:

* the build order: the trainable variables in the order of the
  accumulators, and each one's position by the key the family gives it;
* per variable, its row tracker (or ``None``) and whether a sparse gradient
  reached it (a trace-time fact, remembered across traces);
* the trace-time flags of the window's normaliser (:meth:`weighted`);
* the gating of the inner update (:meth:`gated`, one lock for all replicas);
* the layers whose windows end with this one (``followers``);
* the optional blocks of the saved layout (:attr:`blocks`), and state kept
  aside until :meth:`build` (``deferred``);
* the family's untracked context (``context``: the ``tf.distribute``
  strategy it was made under, a traced flush function, ...).

A family gives it :class:`Hooks` once, at construction: the family contract
as a signature (how a variable is keyed, how the inner optimizer updates,
how gating is installed). Nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Sequence

from accum_optimizer import core

_GATE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What the shared route calls on a family (bound at construction).

    Attributes:
        key_of: ``variable -> key``, hashable: how the family's inner
            optimizer keys a variable (Keras' ``_var_key``, a ``ref()``).
        update_inner: ``(grads, variables) -> op or None``: the one call of
            the inner optimizer at an update (grads in build order, ``None``
            where a variable has no gradient).
        install_gates: ``{index: gate} -> remove``: make the inner
            optimizer's per-variable writes of the variables at ``index``
            (build order) run under a ``cond`` on their boolean ``gate``;
            returns the function that removes the gates.
    """

    key_of: Callable[[Any], Any]
    update_inner: Callable[[list, list], Any]
    install_gates: Callable[[dict], Callable[[], None]]


class Window:
    """One wrapper's window bookkeeping (see the module)."""

    def __init__(self) -> None:
        self.hooks: Hooks | None = None
        # N as given (an int or a schedule); set once by the constructor.
        self.steps: Any = None
        self.constructed = False
        # The inner optimizer's settings assigned before it exists (the
        # framework base class' __init__ sets its defaults on the wrapper).
        self.before_inner: dict = {}
        # Build order (None until built) and each variable's position.
        self.build_order: list | None = None
        self.index: dict = {}
        self.row_trackers: list = []
        self.sparse_seen: set = set()
        self.followers: tuple = ()
        self.eager_build = False  # is the build a micro-step's, run eagerly?
        # Trace-time flags of the normaliser (see `weighted`).
        self.weights_seen = False
        self.unweighted_close_traced = False
        # Gating: how many replicas are inside `gated`, and the remover.
        self.gate_depth = 0
        self.remove_gates: Callable[[], None] | None = None
        # The saved layout's optional blocks, by name, each a list of the
        # wrapper's variables (see `accum_optimizer.core.layout`).
        self.blocks: dict[str, list] = {}
        # The framework base class' own variables, which the wrapper's
        # `variables` (and so its saved state) leaves out.
        self.left_out: tuple = ()
        # State restored before build, kept until build (own, and a
        # LossScaleOptimizer's outside).
        self.deferred: Any = None
        self.deferred_outer: Any = None
        # The family's untracked context, by name: the `tf.distribute`
        # strategy it was made under ("strategy"), its traced flush
        # ("flush_function"), the outer LossScaleOptimizer ("outer", a weak
        # reference), per-device accumulators ("device_accumulators"), the
        # inner update's extra arguments ("inner_kwargs"), ...
        self.context: dict[str, Any] = {}

    # ----------------------------------------------------------- build order
    @property
    def built(self) -> bool:
        return self.build_order is not None

    def set_build_order(self, variables: Sequence[Any]) -> None:
        self.build_order = list(variables)
        self.index = {self.hooks.key_of(v): i for i, v in enumerate(self.build_order)}

    def index_of(self, variable: Any) -> int:
        """``variable``'s position in build order."""
        return self.index[self.hooks.key_of(variable)]

    def unknown(self, variables: Sequence[Any]) -> list:
        """Those of ``variables`` the window was not built with."""
        return [v for v in variables if self.hooks.key_of(v) not in self.index]

    def in_build_order(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """The gradients placed in build order; variables absent from this
        call get ``None`` (no contribution this micro-step)."""
        full = [None] * len(self.build_order)
        for g, v in zip(grads, variables):
            full[self.index_of(v)] = g
        return full

    def note_sparse(self, grads: Sequence[Any], is_sparse: Callable[[Any], bool]) -> None:
        """Remember (across traces) the variables with a row tracker whose
        gradient is sparse on this micro-step."""
        for i, g in enumerate(grads):
            if i < len(self.row_trackers) and self.row_trackers[i] is not None and g is not None and is_sparse(g):
                self.sparse_seen.add(i)

    def seen_trackers(self) -> list | None:
        """Per variable, its row tracker if a sparse gradient reached it, else
        ``None``; ``None`` without trackers."""
        rows = [t if i in self.sparse_seen else None for i, t in enumerate(self.row_trackers)]
        return rows if rows else None

    # ------------------------------------------------------------ normaliser
    def weighted(self, weight: Any, replicas: int) -> bool:
        """Trace-time: may this window's counts differ between replicas?

        Once any micro-step is traced with a weight, every window closed
        afterwards sums the counts over replicas (one scalar reduction per
        update); before, each replica divides by its own micro-step count,
        with no reduction. A traced close of the second kind that later meets
        weighted micro-steps would divide wrongly under a multi-replica
        strategy, so that order raises.

        Raises:
            ValueError: a weighted micro-step after an unweighted close was
                traced under a multi-replica strategy.
        """
        if weight is not None and not self.weights_seen:
            if replicas > 1 and self.unweighted_close_traced:
                raise ValueError(
                    "AccumulatingOptimizer got a weighted micro-step (weight= or a "
                    "CountedLoss) after a train step without weights was traced "
                    f"under a {replicas}-replica strategy; that step's update would "
                    "normalise by the micro-step count. Use weights in every train "
                    "step of this optimizer (weight=1 counts like none)."
                )
            self.weights_seen = True
        if not self.weights_seen:
            self.unweighted_close_traced = True
        return self.weights_seen

    # ------------------------------------------------------------- the route
    @staticmethod
    def micro_step(b: Any, state: core.WindowState, rules: core.Rules, grads: list,
                   replicas: core.Replicas = core.ONE_REPLICA, weight: Any = None, finite: Any = None,
                   resumes: bool = True) -> list:
        """One micro-step of ``grads`` (build order): the window's position
        derived first where it may be unknown (``resumes``: state restored
        without it, :func:`accum_optimizer.core.resume_position`), then
        :func:`accum_optimizer.core.micro_step`, ordered after it (explicit
        in a ``tf.compat.v1`` graph, automatic in a ``tf.function``).
        Returns the ops and outputs made (what a graph groups into the
        micro-step's op)."""
        resumed = None
        if resumes:
            # (its writes after the gradient that guards the micro-step's, its
            # decision after none: the micro-step's must not wait)
            resumed = core.resume_position(b, state, rules, replicas=replicas, after=core.guard(grads))
        with b.after(resumed):
            out = core.micro_step(b, state, rules, grads, replicas=replicas, weight=weight, finite=finite)
        return [*getattr(b, "made", ()), resumed, out]

    @staticmethod
    def flush(b: Any, state: core.WindowState, rules: core.Rules,
              replicas: core.Replicas = core.ONE_REPLICA, resumes: bool = True) -> list:
        """The partial window applied now (:func:`accum_optimizer.core.flush`),
        after the position is derived as in :meth:`micro_step`."""
        resumed = core.resume_position(b, state, rules, replicas=replicas) if resumes else None
        with b.after(resumed):
            out = core.flush(b, state, rules, replicas=replicas)
        return [*getattr(b, "made", ()), resumed, out]

    # ---------------------------------------------------------------- gating
    @contextlib.contextmanager
    def gated(self, gates: dict):
        """Skip, per variable, the inner update of variables that had no
        gradient in the window.

        ``gates`` (from :func:`accum_optimizer.core.micro_step`) holds, for
        each variable without a gradient on this micro-step, a boolean that
        is true iff it had one earlier in the window. The family's
        ``install_gates`` hook makes the inner optimizer's per-variable
        mutations of those variables run under a ``cond`` on it; global
        state (``iterations``, EMA over all variables) moves once per
        update, as in the large-batch reference.

        Under ``MirroredStrategy`` every replica runs this at once (in its
        own thread) around the same inner optimizer: the first replica to
        enter installs the gates, the last to leave removes them (the gates
        are equal in every replica: ``grad_received`` is mirrored).
        """
        if not gates:
            yield
            return
        with _GATE_LOCK:
            if self.gate_depth == 0:
                self.remove_gates = self.hooks.install_gates(gates)
            self.gate_depth += 1
        try:
            yield
        finally:
            with _GATE_LOCK:
                self.gate_depth -= 1
                if self.gate_depth == 0:
                    remove, self.remove_gates = self.remove_gates, None
                    remove()

    # ---------------------------------------------------------------- layout
    def block_variables(self) -> list:
        """Every variable of the optional blocks (``blocks``), in their order."""
        return [v for block in self.blocks.values() for v in block]

    def take_deferred(self) -> Any:
        """The state kept for :meth:`build`, once (then ``None``)."""
        state, self.deferred = self.deferred, None
        return state

    def take_deferred_outer(self) -> Any:
        """The outer ``LossScaleOptimizer``'s kept state, once."""
        state, self.deferred_outer = self.deferred_outer, None
        return state
