"""The records the window algorithm works on, and what it needs from a framework.

* :class:`WindowState`: the variables of one accumulation window (the
  family creates, owns and saves them).
* :class:`Rules`: what a window is, fixed when a step is traced: its length
  N (or a schedule of N over updates), how the window gradient is reduced,
  what a non-finite micro-step does, and whether counts may differ between
  replicas.
* :class:`Replicas`: how the algorithm reaches the replicas of a
  ``tf.distribute`` strategy (a single device: one replica, called here).
* :class:`Backend`: the operations the algorithm performs, in a framework's
  terms. A family supplies one (``accum_optimizer/families/_tf_backend.py`` has
  TensorFlow's; each family adapts how it writes variables and calls its
  inner optimizer).

Nothing here imports a framework.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Protocol, Sequence


@dataclasses.dataclass
class WindowState:
    """The variables of one accumulation window, owned by the family.

    Names follow optax's ``MultiSteps``: ``acc_grads`` are the accumulator
    slots, ``mini_step`` the window's position, ``micro_steps`` counts every
    micro-step, and the inner optimizer's ``iterations`` (``updates`` here)
    counts updates (optax's ``gradient_step``).

    Attributes:
        acc_grads: one accumulator per trainable variable (in build order),
            of its shape, in the accumulator dtype.
        micro_steps: int64 scalar, micro-steps taken (units: micro-steps).
        grad_received: int64 vector ``(num_variables,)``, 1 where a variable
            has had a gradient in the current window.
        mini_step: int64 scalar, the micro-steps in the current window (its
            position; units: micro-steps). Zeroed by every update, discard and
            :func:`~accum_optimizer.core.window.flush`. A window closes when it
            reaches N (the schedule's N for the window). A negative value
            means "not known yet" (see
            :func:`~accum_optimizer.core.window.resume_position`).
        window_weight: float32 scalar, the window's count ``Σᵢ cᵢ`` (each
            micro-step adds its ``weight``, 1 without one). Replica-local
            under ``tf.distribute`` (summed on read, like the accumulators).
        updates: the inner optimizer's ``iterations`` (int64 scalar, units:
            updates), read by a schedule to pick the window's N. Needed for a
            schedule only.
        touched_rows: per variable, a vector ``(shape[0],)`` marking (> 0)
            the rows a sparse gradient touched in this window, or ``None``
            where the family hands the inner optimizer a dense window
            gradient (``touched_rows`` itself ``None``: no variable is
            tracked).
        sparse_update: per variable, what a sparse window hands the inner
            optimizer: ``True``, sparse slices over the touched rows (for
            inner optimizers that keep them sparse); ``False``, the dense
            window gradient, only the touched rows being zeroed afterwards.
            ``None``: ``True`` for every variable.
        variable_dtypes: per variable, the dtype its window gradient is cast
            to (the variable's, where the accumulator is wider), or ``None``:
            no cast.
        skipped_micro_steps: int64 scalar, non-finite micro-steps whose
            gradients were dropped (units: micro-steps). Needed by both
            skipping policies.
        skipped_windows: int64 scalar, windows discarded by
            ``"skip_window"`` (units: windows).
        window_poisoned: int64 scalar, 1 while the current window has had a
            non-finite micro-step (``"skip_window"``).
        followers: what else ends with the window: each is called once
            whenever a window ends (its update, a discard, a flush), after
            the update, inside the branch that ends it (the pooled statistics
            of ``accum_optimizer.layers.BatchNormalization``).
        combine: per variable, how its micro-step values make the window's
            (one of :data:`COMBINES`): ``"reduction"``, the window gradient
            of ``Rules.reduction`` (weighted, summed, divided); ``"max"``,
            the element-wise maximum of the values the variable received in
            the window, handed to the inner optimizer as is (no weight, no
            division): state that the large batch overwrites with a value
            computed over all its samples, not a gradient (Keras 3's
            ``overwrite_with_gradient`` variables: float8 scales and amax
            histories). ``None``: ``"reduction"`` for every variable.
    """

    acc_grads: Sequence[Any]
    micro_steps: Any
    grad_received: Any
    mini_step: Any
    window_weight: Any
    updates: Any = None
    touched_rows: Sequence[Any] | None = None
    sparse_update: Sequence[bool] | None = None
    variable_dtypes: Sequence[Any] | None = None
    skipped_micro_steps: Any = None
    skipped_windows: Any = None
    window_poisoned: Any = None
    followers: Sequence[Callable[[], Any]] = ()
    combine: Sequence[str] | None = None

    def combined_by_max(self, i: int) -> bool:
        """Is variable ``i``'s window the element-wise maximum of its
        micro-step values (see :attr:`combine`)?"""
        return self.combine is not None and self.combine[i] == "max"

    def rows_tracker(self, i: int) -> Any:
        """Variable ``i``'s row tracker, or ``None``."""
        return None if self.touched_rows is None else self.touched_rows[i]

    def hands_sparse(self, i: int) -> bool:
        """Does a sparse window of variable ``i`` reach the inner optimizer
        as sparse slices (else: dense, see :attr:`sparse_update`)?"""
        return True if self.sparse_update is None else bool(self.sparse_update[i])


NONFINITE_POLICIES = ("propagate", "skip_micro_step", "skip_window")
REDUCTIONS = ("mean", "sum")
COMBINES = ("reduction", "max")
"""The per-variable rules of :attr:`WindowState.combine`."""


def skip_counters(nonfinite: str) -> tuple[str, ...]:
    """The :class:`WindowState` counters a family keeps under a non-finite
    policy, in the order it keeps them: none for ``"propagate"``; both skip
    counters for either skipping policy (``skipped_windows`` stays 0 under
    ``"skip_micro_step"``); and ``window_poisoned`` for ``"skip_window"``."""
    if nonfinite == "propagate":
        return ()
    counters = ("skipped_micro_steps", "skipped_windows")
    return counters + ("window_poisoned",) if nonfinite == "skip_window" else counters


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a window is (fixed when a step is traced).

    Attributes:
        length: N, micro-steps per window: an int >= 1, a dict
            ``{first_update: N}`` (piecewise constant over updates) or a
            callable ``update_index -> N``, validated by
            :func:`accum_optimizer._args.validate_accumulation_schedule`.
        reduction: ``"mean"``: the window applies ``Σ cᵢ·gᵢ / Σ cᵢ`` (the
            sum over N without weights); ``"sum"``: ``Σ cᵢ·gᵢ``.
        nonfinite: one of :data:`NONFINITE_POLICIES` (see
            :func:`~accum_optimizer.core.window.micro_step`).
        weighted: whether the window's counts may differ between replicas
            (the family has seen a ``weight``): the normaliser is then the
            count summed over replicas, one scalar reduction per update;
            otherwise each replica divides by its own count, with no
            reduction. ``None``: whether this micro-step has a weight.
    """

    length: Any
    reduction: str = "mean"
    nonfinite: str = "propagate"
    weighted: bool | None = None

    def needs(self) -> tuple[str, ...]:
        """The optional :class:`WindowState` fields these rules need."""
        fields = {
            "propagate": (),
            "skip_micro_step": ("skipped_micro_steps",),
            "skip_window": ("skipped_micro_steps", "skipped_windows", "window_poisoned"),
        }[self.nonfinite]
        if callable(self.length) or isinstance(self.length, dict):
            fields += ("updates",)
        return fields


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _identity(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class Replicas:
    """How the algorithm reaches the replicas of a distribution strategy.

    Attributes:
        count: replicas in sync (1 on a single device).
        each: ``each(fn, *args)`` runs ``fn(*args)`` in every replica (with
            that replica's values of per-replica arguments) and returns the
            per-replica results; on a single device, ``fn(*args)``.
        all: ``all(flag)`` turns a per-replica boolean scalar (what ``each``
            returns) into one boolean scalar, true iff the flag holds on
            every replica (one scalar all-reduce); on a single device, the
            flag itself. Used by the non-finite skipping policies only.
    """

    count: int = 1
    each: Callable[..., Any] = _call
    all: Callable[[Any], Any] = _identity


ONE_REPLICA = Replicas()


class Backend(Protocol):
    """What the window algorithm needs from a framework and a family.

    State writes return the op they made where the framework needs explicit
    ordering (TF1 graphs), else ``None``; the algorithm only hands such
    values to :meth:`after`. ``cond`` branches return the same kind.
    """

    # -- the family's variables and inner optimizer
    def assign(self, variable: Any, value: Any) -> Any:
        """``variable = value``."""

    def assign_add(self, variable: Any, value: Any) -> Any:
        """``variable += value``; a sparse ``value`` becomes a scatter-add
        (sparse accumulation stays sparse)."""

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> Any:
        """``variable[indices] = updates`` along the first axis."""

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """Run ``true_fn`` if the boolean scalar ``pred`` holds, else ``false_fn``."""

    def apply_inner(self, window_grads: list, gates: dict) -> Any:
        """Call the inner optimizer once with one window gradient per
        variable (dense, or sparse over the touched rows). ``gates`` maps
        the index of each variable without a gradient on the closing
        micro-step to a boolean scalar, true iff it had one earlier in the
        window: every update of a variable whose gate is false (its weight,
        slots, weight decay, constraint) must be skipped."""

    def after(self, values: Any) -> ContextManager[Any]:
        """A context in which every op made runs after the ops and tensors
        among ``values`` (nested; ``None`` and others ignored).

        A backend may also have ``fence(values) -> bool``: make every later
        write of the variables the inner update may write run after
        ``values``, and none of its reads; ``False`` where it cannot (then
        the whole inner update runs in ``after(values)``). See
        :func:`accum_optimizer.core.window.apply_window`."""

    # -- values
    def read(self, variable: Any) -> Any:
        """The variable's current value (replica-local under a strategy).

        A backend whose accumulators hold one slice per device also has
        ``read_window(acc, combine)``: the value the update uses, the
        slices combined (``"sum"`` or ``"max"``); see
        :func:`accum_optimizer.core.window.read_window`."""

    def cast(self, value: Any, dtype: Any) -> Any: ...
    def dtype(self, value: Any) -> Any:
        """``value``'s dtype (a variable's value dtype)."""

    def constant(self, value: Any, dtype: Any) -> Any: ...
    def add(self, x: Any, y: Any) -> Any: ...
    def equal(self, x: Any, y: Any) -> Any: ...
    def greater(self, x: Any, y: Any) -> Any: ...
    def greater_equal(self, x: Any, y: Any) -> Any: ...
    def less(self, x: Any, y: Any) -> Any: ...
    def logical_and(self, x: Any, y: Any) -> Any: ...
    def maximum(self, x: Any, y: Any) -> Any: ...
    def where(self, pred: Any, x: Any, y: Any) -> Any:
        """``x`` where the boolean ``pred`` holds, else ``y`` (element-wise,
        ``pred`` broadcast)."""

    def reduce_max(self, x: Any) -> Any:
        """The largest element of ``x`` (a scalar)."""

    def floormod(self, x: Any, y: Any) -> Any: ...
    def divide(self, x: Any, y: Any) -> Any: ...
    def ones_like(self, variable: Any) -> Any: ...
    def zeros_like(self, variable: Any) -> Any: ...
    def fill_like(self, variable: Any, value: Any) -> Any:
        """A tensor of ``variable``'s shape and dtype filled with the scalar
        ``value`` (without reading the variable)."""

    def unfoldable_zero(self, counter: Any) -> Any:
        """A scalar 0 computed from ``counter`` when the step runs, which a
        graph optimizer cannot fold into a constant (a constant zero the size
        of an accumulator would stay resident in a traced graph)."""

    def piecewise(self, x: Any, boundaries: Sequence[int], values: Sequence[int]) -> Any:
        """``values[i]`` for the last ``boundaries[i] <= x`` (int64)."""

    def checked_positive(self, value: Any, message: str) -> Any:
        """``value`` (int64 scalar), asserted >= 1 when the step runs."""

    # -- gradients
    def all_finite(self, grads: Sequence[Any]) -> Any:
        """Boolean scalar: every element of every non-``None`` gradient is finite."""

    def scale(self, grad: Any, weight: Any) -> Any:
        """``weight * grad`` (dense or sparse)."""

    def cast_gradient(self, grad: Any, dtype: Any) -> Any:
        """``grad`` (dense or sparse) in ``dtype`` (unchanged for ``None``)."""

    def is_sparse(self, grad: Any) -> bool:
        """Is ``grad`` (or one replica's value of it) a sparse gradient?
        A trace-time answer."""

    def sparse_indices(self, grad: Any) -> Any:
        """The row indices of a sparse gradient."""

    def touched(self, tracker: Any) -> Any:
        """int64 vector: the rows marked in a row tracker, ascending, each once."""

    def gather_rows(self, variable: Any, rows: Any) -> Any:
        """``variable[rows]``, read row by row (not the whole variable)."""

    def sparse(self, values: Any, rows: Any, like: Any) -> Any:
        """The sparse gradient of ``like``'s shape with ``values`` at ``rows``."""

    def fill_rows_like(self, variable: Any, rows: Any, value: Any) -> Any:
        """A tensor of shape ``(len(rows),) + variable.shape[1:]`` in
        ``variable``'s dtype filled with the scalar ``value``."""
