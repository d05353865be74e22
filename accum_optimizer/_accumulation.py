"""The accumulation algorithm, in one place, for every optimizer family.

Each family (Keras 3 in :mod:`accum_optimizer.keras3`; Keras 2, legacy
``OptimizerV2`` / tensorflow-addons and TF1 graph code beside it) is a thin
adapter: it owns the variables, supplies a :class:`Backend` (how to assign,
assign-add, scatter-update and branch in its world) and a function that calls
its inner optimizer once, and calls :func:`micro_step`. The whole algorithm is
:func:`micro_step`; one call is one micro-step:

1. ``acc_grads[i] += c * grads[i]`` for every gradient that is not ``None``
   (a scatter-add for ``tf.IndexedSlices``, never a densification; ``c`` is
   the micro-step's ``weight``, its count, and without one there is no
   multiplication), ``window_weight += c`` (1 without a weight), and
   ``grad_received[i] = 1`` for those variables. Where the family tracks
   touched rows, ``touched_rows[i][indices] = 1``.
2. ``micro_steps += 1`` and ``mini_step += 1`` (the window's position).
3. If ``mini_step`` reaches the window's N (an int, or the schedule's N for
   the window's first update, :func:`window_length`): :func:`close_window`
   calls the inner optimizer once with the window's gradient
   (:func:`window_gradient`: ``Σ cᵢ·gᵢ / Σ cᵢ`` for ``"mean"``, which is the
   sum divided by N when no weights are given; the sum for ``"sum"``), gated
   per variable by ``grad_received``, then zeroes the accumulators,
   ``window_weight``, ``mini_step`` and ``grad_received``. Otherwise nothing
   else happens: the model weights and every variable of the inner
   optimizer stay bitwise untouched.

:func:`flush` runs step 3 on a partial window (normalised by its own
``Σ cᵢ``, never by N). A window whose counts sum to 0 is discarded instead of
applied (the inner optimizer is not called).

Every write of a micro-step (steps 1-3) waits for that micro-step's gradients
(a control dependency on them). Without it, a traced step whose input
pipeline ends (``OutOfRange`` from a dataset of unknown length, which Keras
hits once per epoch) would still run the counter writes, which have no data
dependency on the gradients: a phantom micro-step per epoch.

Non-finite gradients (``nonfinite=``, :data:`NONFINITE_POLICIES`): with
``"propagate"`` (the default) the steps above are all there is. With
``"skip_micro_step"`` or ``"skip_window"`` one boolean scalar, "every
gradient of this micro-step is finite on every replica", gates them (one
``is_finite`` reduction per gradient, combined in the graph, plus one scalar
all-reduce under a multi-replica strategy; no host sync). ``"skip_micro_step"``: a non-finite
micro-step adds nothing and is not counted (``skipped_micro_steps += 1``), so
the window takes one more micro-batch. ``"skip_window"``: it is counted but
adds nothing and marks the window; the window's last micro-step then discards
the window instead of updating (accumulators zeroed, the inner optimizer not
called, ``skipped_windows += 1``), as the large batch would skip its step.

Mixed precision: accumulators may have a wider dtype than their variables
(float32 for 16-bit weights): each gradient is cast to the accumulator's
dtype when it is added, and the window gradient is cast to the variable's
dtype once, after the division by N (:attr:`WindowState.variable_dtypes`).

State names follow optax's ``MultiSteps``: ``acc_grads`` are the accumulator
slots, ``mini_step`` is the window's position, ``micro_steps`` counts all
micro-steps, and the inner optimizer's ``iterations`` counts updates
(optax's ``gradient_step``). A family that does not keep ``mini_step`` and
``window_weight`` (``None`` in its :class:`WindowState`) gets the unweighted
window of ``micro_steps % N`` and no flush.

All families run on TensorFlow, so the arithmetic here is ``tf``; what
"assign" and "cond" mean (Keras 3 variables in a ``tf.function``, TF1 graph
ops that must be ordered by hand, replica-local variables under
``tf.distribute``) is the adapter's business.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Protocol, Sequence

import tensorflow as tf

REDUCTIONS = ("mean", "sum")
LOCAL_COUNT = object()
"""``apply_window``'s divisor: this replica's ``window_weight``."""
NONFINITE_POLICIES = ("propagate", "skip_micro_step", "skip_window")


class Backend(Protocol):
    """What the algorithm needs from a family's adapter.

    Each method may return the op or tensor it created (TF1 graph code needs
    them to order the steps; the returned values are used only as control
    dependencies) or ``None`` (eager and ``tf.function`` code is ordered by
    TensorFlow's automatic control dependencies).
    """

    def assign(self, variable: Any, value: Any) -> Any:
        """``variable = value``."""

    def assign_add(self, variable: Any, value: Any) -> Any:
        """``variable += value``; a ``tf.IndexedSlices`` value must become a
        scatter-add on the variable (that keeps sparse accumulation sparse)."""

    def scatter_update(self, variable: Any, indices: Any, updates: Any) -> Any:
        """``variable[indices] = updates`` along the first axis (only called
        when the family tracks touched rows)."""

    def cond(self, pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        """Run ``true_fn`` if the boolean scalar ``pred`` holds, else
        ``false_fn``. Both return ``None`` (or ops, for TF1)."""


@dataclasses.dataclass
class WindowState:
    """The variables of one accumulation window, owned by the adapter.

    Attributes:
        acc_grads: one accumulator per trainable variable (in build order),
            its shape and dtype.
        micro_steps: int64 scalar, micro-steps taken (units: micro-steps).
        grad_received: int64 vector ``(num_variables,)``, 1 where a variable
            has had a gradient in the current window.
        touched_rows: per variable, a vector ``(shape[0],)`` marking (> 0) the
            rows a sparse gradient touched in this window, or ``None`` where
            the family hands the inner optimizer a dense window gradient. Any
            numeric dtype: int8 costs ``shape[0]`` bytes (1/(4·row width) of a
            float32 accumulator); an adapter whose trackers are summed
            ``ON_READ`` variables under ``tf.distribute`` uses a float dtype,
            because restoring a summed int divides it by the replica count
            and truncates a mark of 1 to 0.
        skipped_micro_steps: int64 scalar, non-finite micro-steps whose
            gradients were dropped (both skipping policies; units:
            micro-steps). Needed for ``nonfinite != "propagate"``.
        skipped_windows: int64 scalar, windows discarded by
            ``"skip_window"`` (units: windows). Needed for ``"skip_window"``.
        window_poisoned: int64 scalar, 1 while the current window has had a
            non-finite micro-step (``"skip_window"``). Needed for
            ``"skip_window"``.
        variable_dtypes: per variable, the dtype its window gradient is cast
            to (the variable's, where the accumulator is wider), or ``None``:
            the accumulator's dtype, no cast.
        mini_step: int64 scalar, the micro-steps in the current window (its
            position; optax's ``mini_step``; units: micro-steps). Zeroed by
            every update, discard and :func:`flush`. With it, a window closes
            when ``mini_step`` reaches N (the schedule's N for the window),
            not when ``micro_steps % N == 0``: after a flush, or under a
            schedule, the two differ. ``None``: a family that keeps neither
            (no flush, no weights, no schedule): ``micro_steps % N``.
        window_weight: float32 scalar, the window's count ``Σᵢ cᵢ`` (each
            micro-step adds its ``weight``, 1 without one). Replica-local
            under ``tf.distribute`` (``ON_READ`` summed, like the
            accumulators): read in cross-replica context it is the sum over
            replicas. Needs ``mini_step``.
        updates: the inner optimizer's ``iterations`` (int64 scalar, units:
            updates), read by a schedule to pick the window's N. Needed for
            a schedule only.
        sparse_update: per variable, what a sparse window (a tracked
            variable whose closing gradient is ``tf.IndexedSlices`` or
            ``None``, :func:`sparse_window`) hands the inner optimizer:
            ``True``, ``tf.IndexedSlices`` over the touched rows (for inner
            optimizers that keep them sparse); ``False``, the dense window
            gradient (for inner optimizers that would densify the slices
            themselves), the touched rows only being zeroed afterwards either
            way. ``None`` (default): ``True`` for every variable.
    """

    acc_grads: Sequence[Any]
    micro_steps: Any
    grad_received: Any
    touched_rows: Sequence[Any] | None = None
    skipped_micro_steps: Any = None
    skipped_windows: Any = None
    window_poisoned: Any = None
    variable_dtypes: Sequence[Any] | None = None
    mini_step: Any = None
    window_weight: Any = None
    updates: Any = None
    sparse_update: Sequence[bool] | None = None

    def rows_tracker(self, i: int) -> Any:
        return None if self.touched_rows is None else self.touched_rows[i]

    def hands_sparse(self, i: int) -> bool:
        """Does a sparse window of variable ``i`` reach the inner optimizer
        as ``tf.IndexedSlices`` (else: dense, see :attr:`sparse_update`)?"""
        return True if self.sparse_update is None else bool(self.sparse_update[i])


# ------------------------------------------------------------------ checks
class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()
"""Default of the wrappers' required arguments, so that a missing one gets
:func:`check_arguments`' message rather than Python's."""

ARGUMENTS = ("inner_optimizer", "gradient_accumulation_steps", "reduction", "name")
NUMERICS_ARGUMENTS = ("nonfinite", "accumulator_dtype")
"""Arguments of the families that supply the state of :data:`NONFINITE_POLICIES`
and wider accumulators (Keras 3 today)."""


def check_arguments(
    inner_optimizer: Any, gradient_accumulation_steps: Any, unknown: dict, accepted: Sequence[str] = ARGUMENTS
) -> None:
    """Raise ``TypeError`` for unknown keyword arguments (naming the close
    match, e.g. ``steps`` -> ``gradient_accumulation_steps``) and for a
    missing ``inner_optimizer`` or ``gradient_accumulation_steps``.
    ``accepted``: the family's arguments, for the message."""
    if unknown:
        import difflib

        received = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        hints = []
        for key in sorted(unknown):
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.3)
            close = close or [a for a in accepted if key in a]
            if close:
                hints.append(f"`{key}` -> `{close[0]}`")
        hint = f" Did you mean {', '.join(hints)}?" if hints else ""
        raise TypeError(
            "AccumulatingOptimizer got unexpected keyword argument(s): "
            f"{received}. Accepted: {', '.join(accepted)}.{hint}"
        )
    for arg, value in (("inner_optimizer", inner_optimizer),
                       ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if value is REQUIRED:
            raise TypeError(
                f"AccumulatingOptimizer is missing the required argument `{arg}`: "
                "AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps, "
                "reduction='mean', name=None), e.g. AccumulatingOptimizer("
                "keras.optimizers.Adam(1e-3), gradient_accumulation_steps=4)."
            )

def validate_gradient_accumulation_steps(value: Any) -> int:
    """Return ``value`` as an ``int`` >= 1 or raise.

    Raises:
        TypeError: if ``value`` is not an integer (``bool`` and ``float`` are
            rejected even when integral, since ``True`` or ``4.0`` is almost
            always a mistake).
        ValueError: if ``value`` < 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "`gradient_accumulation_steps` must be a positive int (the number "
            "of micro-steps per update). Received: gradient_accumulation_steps="
            f"{value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(
            "`gradient_accumulation_steps` must be an int >= 1 (1 means no "
            "accumulation). Received: gradient_accumulation_steps="
            f"{value!r}."
        )
    return int(value)


def validate_reduction(value: Any) -> str:
    """Return ``value`` if it is one of :data:`REDUCTIONS`, else raise ValueError."""
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}: 'mean' applies the "
            "average of the window's micro-batch gradients (equivalent to one "
            "batch of N*B samples when the loss is a mean over the batch), "
            "'sum' applies their sum. Received: reduction="
            f"{value!r}."
        )
    return value


def validate_accumulation_schedule(value: Any) -> Any:
    """Return ``gradient_accumulation_steps`` in one of its accepted forms.

    Accepted: an ``int >= 1`` (returned as ``int``); a dict
    ``{first_update: N, ...}`` (piecewise constant over updates; int keys
    strictly ascending from 0, int values >= 1; returned as a new dict with
    ``int`` keys and values; string keys of digits, as JSON turns them, are
    accepted); a callable ``update_index -> N`` (returned as is; it receives
    the window's first update index as an int64 scalar tensor and returns an
    int or an integer scalar tensor >= 1, checked when the step runs).

    Raises:
        TypeError: not an int, dict or callable; a dict key or value that is
            not an int (``bool`` and ``float`` are rejected).
        ValueError: N < 1; keys not starting at 0 or not strictly ascending
            (in the order given: ``{0: 1, 30: 2, 20: 4}`` is rejected, not
            sorted); an empty dict.
    """
    if callable(value) and not isinstance(value, dict):
        return value
    if not isinstance(value, dict):
        return validate_gradient_accumulation_steps(value)
    if not value:
        raise ValueError(
            "`gradient_accumulation_steps` as a schedule must map the first "
            "update of each phase to its N, starting at update 0, e.g. "
            "{0: 1, 1000: 4}. Received an empty dict."
        )
    schedule: dict[int, int] = {}
    previous = None
    for key, steps in value.items():
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral):
            raise TypeError(
                "`gradient_accumulation_steps` schedule keys must be ints (the "
                f"first update of each phase). Received key {key!r} of type "
                f"{type(key).__name__} (value {steps!r})."
            )
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
            raise TypeError(
                "`gradient_accumulation_steps` schedule values must be ints >= 1 "
                f"(micro-steps per update). Received {{{key!r}: {steps!r}}}: "
                f"a value of type {type(steps).__name__}."
            )
        if steps < 1:
            raise ValueError(
                "`gradient_accumulation_steps` schedule values must be >= 1. "
                f"Received {{{key!r}: {steps!r}}}."
            )
        if previous is None and key != 0:
            raise ValueError(
                "`gradient_accumulation_steps` schedule must start at update 0 "
                f"(the N of the first window). Received first key {key!r} "
                f"(value {steps!r})."
            )
        if previous is not None and key <= previous:
            raise ValueError(
                "`gradient_accumulation_steps` schedule keys must be strictly "
                f"ascending, in the order given. Received key {key!r} (value "
                f"{steps!r}) after key {previous!r}."
            )
        schedule[int(key)] = int(steps)
        previous = key
    return schedule


def window_length(schedule: Any) -> Callable[[Any], Any] | int:
    """From a validated ``gradient_accumulation_steps``: the int itself, or
    ``n(update_index)`` returning the window's N as an int64 scalar tensor
    (a dict: piecewise constant, one ``searchsorted`` over its keys; a
    callable: its result, asserted >= 1 when the step runs)."""
    if isinstance(schedule, numbers.Integral):
        return int(schedule)
    if isinstance(schedule, dict):
        keys = sorted(schedule)
        values = [schedule[k] for k in keys]

        def n(update_index: Any) -> Any:
            update_index = tf.cast(update_index, tf.int64)
            position = tf.reduce_sum(tf.cast(tf.constant(keys, tf.int64) <= update_index, tf.int32)) - 1
            return tf.gather(tf.constant(values, tf.int64), position)

        return n

    def n(update_index: Any) -> Any:
        value = tf.cast(schedule(tf.cast(update_index, tf.int64)), tf.int64)
        check = tf.debugging.assert_positive(
            value, message="gradient_accumulation_steps(update_index) must return an int >= 1"
        )
        with tf.control_dependencies([check]):
            return tf.identity(value)

    return n


def check_weight(weight: Any) -> Any:
    """Check a micro-step's ``weight`` (its count ``c``); return it as a
    float32 scalar tensor, or ``None`` for ``None``.

    Python numbers and eager tensors are checked at once; a symbolic tensor
    (inside ``tf.function``) is checked when the step runs: the micro-step's
    writes wait for an assertion, so a negative or non-finite weight stops
    the step with ``InvalidArgumentError`` before any state changes.

    Raises:
        TypeError: not a real number or numeric tensor.
        ValueError: not a scalar; negative, NaN or infinite.
    """
    if weight is None:
        return None
    try:
        if isinstance(weight, (bool, str, bytes)):
            raise TypeError
        value = tf.convert_to_tensor(weight)
        if not (value.dtype.is_floating or value.dtype.is_integer) or value.dtype == tf.bool:
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(
            "`weight` must be a scalar >= 0 (the micro-batch's count: samples, "
            f"sum of sample weights or unmasked tokens). Received weight={weight!r} "
            f"of type {type(weight).__name__}."
        ) from None
    value = tf.cast(value, tf.float32)
    if value.shape.rank is not None and value.shape.rank != 0:
        raise ValueError(
            "`weight` must be a scalar (one count per micro-step). Received a "
            f"value of shape {tuple(value.shape)}."
        )
    if tf.executing_eagerly() or tf.get_static_value(value) is not None:
        number = float(tf.get_static_value(value))
        if not (number >= 0 and number < float("inf")):
            raise ValueError(
                "`weight` must be finite and >= 0 (the micro-batch's count). "
                f"Received weight={number!r}."
            )
        return value
    check = tf.debugging.assert_all_finite(value, "`weight` must be finite")
    with tf.control_dependencies([check, tf.debugging.assert_non_negative(value, message="`weight` must be >= 0")]):
        return tf.identity(value)


def validate_nonfinite(value: Any, supported: Sequence[str] = NONFINITE_POLICIES) -> str:
    """Return ``value`` if it is one of ``supported`` (a family passes the
    policies it supplies the state for), else raise ValueError."""
    if not isinstance(value, str) or value not in NONFINITE_POLICIES:
        raise ValueError(
            f"`nonfinite` must be one of {NONFINITE_POLICIES}: 'propagate' applies "
            "every micro-batch gradient as it is (a NaN or Inf reaches the "
            "weights, as in large-batch training), 'skip_micro_step' drops a "
            "micro-step whose gradients are not all finite (the window takes "
            "one more micro-batch), 'skip_window' discards the whole window "
            f"that contains one. Received: nonfinite={value!r}."
        )
    if value not in supported:
        raise ValueError(
            f"nonfinite={value!r} is not supported by this optimizer family yet "
            f"(supported: {tuple(supported)}); its wrapper does not keep the "
            "counters the skipping policies need."
        )
    return value


def check_window_state(state: WindowState, nonfinite: str) -> None:
    """Raise ValueError if ``state`` lacks a variable ``nonfinite`` needs."""
    needed = {
        "propagate": (),
        "skip_micro_step": ("skipped_micro_steps",),
        "skip_window": ("skipped_micro_steps", "skipped_windows", "window_poisoned"),
    }[validate_nonfinite(nonfinite)]
    missing = [name for name in needed if getattr(state, name) is None]
    if missing:
        raise ValueError(
            f"nonfinite={nonfinite!r} needs WindowState fields {missing}; the "
            "adapter did not supply them."
        )


def validate_gradient_shapes(grads: Sequence[Any], variables: Sequence[Any], name_of: Callable[[Any], str]) -> None:
    """Raise ValueError if a gradient's static shape differs from its variable's.

    ``grads[i]`` is a tensor, a ``tf.IndexedSlices`` (its static
    ``dense_shape`` is checked) or ``None`` (skipped); dimensions unknown at
    trace time are skipped here (the adapter checks them when the step runs).
    ``name_of(variable)`` names the variable in the message.
    """
    for g, v in zip(grads, variables):
        if g is None:
            continue
        g_shape, v_shape = _gradient_shape(g), tuple(v.shape)
        if g_shape is None:
            continue
        if len(g_shape) != len(v_shape) or any(
            a is not None and b is not None and a != b for a, b in zip(g_shape, v_shape)
        ):
            raise ValueError(
                f"Gradient shape {g_shape} does not match the shape {v_shape} "
                f"of variable {name_of(v)!r}; each gradient must have "
                "its variable's shape."
            )


def _gradient_shape(value: Any) -> tuple | None:
    """Static shape of a gradient (``dense_shape`` of a ``tf.IndexedSlices``),
    ``None`` where unknown (unknown rank, or a dense_shape known only at run time)."""
    if isinstance(value, tf.IndexedSlices):
        if value.dense_shape is None:
            return None
        static = tf.get_static_value(value.dense_shape)
        return None if static is None else tuple(int(d) for d in static)
    shape = getattr(value, "shape", None)
    if shape is None or shape.rank is None:
        return None
    return tuple(None if d is None else int(d) for d in shape)


# ------------------------------------------------------------ the algorithm
def micro_step(
    backend: Backend,
    state: WindowState,
    grads: Sequence[Any],
    apply_inner: Callable[[list, dict], Any],
    gradient_accumulation_steps: int,
    reduction: str,
    each_replica: Callable[..., Any] | None = None,
    *,
    nonfinite: str = "propagate",
    all_replicas: Callable[[Any], Any] | None = None,
    finite: Any = None,
    weight: Any = None,
    replicas: int = 1,
    weighted: bool | None = None,
) -> Any:
    """One micro-step: accumulate, count, and on a window's last micro-step update.

    Args:
        backend: the family's :class:`Backend`.
        state: the window's variables.
        grads: one entry per variable of ``state`` (build order): a dense
            tensor of the variable's shape, a ``tf.IndexedSlices``, or
            ``None``. Under ``tf.distribute`` in cross-replica context, the
            per-replica values.
        apply_inner: ``apply_inner(window_grads, gates)`` calls the inner
            optimizer once with one window gradient per variable (dense, or
            ``tf.IndexedSlices`` over the touched rows). ``gates`` maps the
            index of each variable without a gradient on *this* micro-step to
            a boolean scalar, true iff it had one earlier in the window; the
            adapter must skip every update of a variable whose gate is false
            (its weight, slots, weight decay and constraint).
        gradient_accumulation_steps: N (>= 1), micro-steps per window, or
            (with ``state.mini_step``) a schedule ``n(update_index)`` from
            :func:`window_length`.
        reduction: ``"mean"`` or ``"sum"``.
        each_replica: ``each_replica(fn, *args)`` runs ``fn`` in every replica
            (``call_for_each_replica``); default: call it here.
        nonfinite: one of :data:`NONFINITE_POLICIES` (see the module
            docstring); the skipping policies need the matching
            :class:`WindowState` fields (:func:`check_window_state`).
        all_replicas: ``all_replicas(flag)`` turns this micro-step's
            finiteness flag (a boolean scalar in each replica: the
            per-replica value that ``each_replica`` returns) into one boolean
            scalar, true iff the flag holds on every replica, so that every
            replica skips together: one scalar all-reduce
            (``distribution.reduce``). Default: the flag itself (one
            replica). Called once per micro-step by the skipping policies
            only; ``"propagate"`` adds no reduction.
        finite: optional boolean scalar (the same on every replica) that
            replaces the finiteness check of ``grads``: the verdict of a check
            done elsewhere. The Python constant ``False`` (with every gradient
            ``None``) records a micro-step that an outer loss-scale optimizer
            skipped (it never reached this optimizer); nothing of the update
            is then built. Ignored by ``"propagate"``.
        weight: the micro-step's count ``c`` (float32 scalar from
            :func:`check_weight`; per replica under ``tf.distribute``), or
            ``None`` for 1. The accumulators add ``c * grad`` and
            ``window_weight`` adds ``c``; ``"mean"`` divides the window by
            the window's ``Σ c`` (see :func:`close_window`), ``"sum"`` does
            not divide. Needs ``state.window_weight``.
        replicas: the number of replicas in sync (the normaliser's divisor,
            see :func:`close_window`).
        weighted: whether the window's counts may differ between replicas
            (the adapter has seen a weight: see :func:`close_window`);
            default: ``weight is not None``.

    Returns:
        What ``backend.cond`` returns (an op for TF1 graph code).
    """
    each_replica = each_replica or _call
    check_window_state(state, nonfinite)
    if weight is not None and state.window_weight is None:
        raise ValueError("`weight` needs a WindowState with `window_weight`; the adapter did not supply it.")
    mask = received_mask(grads)
    sparse = [sparse_window(g, state.rows_tracker(i)) for i, g in enumerate(grads)]
    weight_tensors = [] if weight is None else gradient_tensors([weight])
    with tf.control_dependencies(gradient_tensors(grads) + weight_tensors):
        if nonfinite == "propagate":
            ok = None
            accumulated = each_replica(accumulate, backend, state, grads, weight)
        elif finite is False:
            return skipped_micro_step(backend, state, gradient_accumulation_steps, nonfinite, each_replica)
        else:
            if finite is not None:
                ok = tf.convert_to_tensor(finite, tf.bool)
            else:
                ok = (all_replicas or _identity)(each_replica(all_finite, grads))
            accumulated = backend.cond(ok, lambda: each_replica(accumulate, backend, state, grads, weight), _noop)
        with tf.control_dependencies(_ops(accumulated)):
            counted = count(backend, state, mask, nonfinite, ok)
        with tf.control_dependencies(_ops(counted)):
            closes = window_closes(state, gradient_accumulation_steps)
            if nonfinite == "skip_micro_step":
                # A skipped micro-step is not counted: the counters still
                # hold what closed the previous window.
                closes = tf.logical_and(ok, closes)
            return backend.cond(
                closes,
                lambda: close_window(backend, state, sparse, mask, apply_inner, gradient_accumulation_steps,
                                     reduction, each_replica, nonfinite, replicas,
                                     weight is not None if weighted is None else weighted),
                _noop,
            )


def flush(
    backend: Backend,
    state: WindowState,
    apply_inner: Callable[[list, dict], Any],
    reduction: str,
    each_replica: Callable[..., Any] | None = None,
    *,
    nonfinite: str = "propagate",
    replicas: int = 1,
    weighted: bool = True,
) -> Any:
    """Apply the current, partial window now, if it holds a micro-step.

    What the closing micro-step of a window does (:func:`close_window`),
    without a micro-step: the window gradient is normalised by what the
    window holds (``window_weight``: its micro-steps, or its counts when
    weighted; never by N), every variable is gated by ``grad_received``,
    and the window restarts (``mini_step = 0``). ``micro_steps`` does not
    move; the inner ``iterations`` does, by one. A no-op on an empty window
    (``mini_step == 0``). Needs ``state.mini_step`` and
    ``state.window_weight``; called in cross-replica context under
    ``tf.distribute`` (``each_replica`` as for :func:`micro_step`).
    """
    each_replica = each_replica or _call
    check_window_state(state, nonfinite)
    if state.mini_step is None or state.window_weight is None:
        raise ValueError("flush() needs a WindowState with `mini_step` and `window_weight`.")
    mask = [0] * len(state.acc_grads)
    sparse = [sparse_window(None, state.rows_tracker(i)) for i in range(len(state.acc_grads))]
    holds = tf.greater(tf.convert_to_tensor(state.mini_step), 0)
    return backend.cond(
        holds,
        lambda: close_window(backend, state, sparse, mask, apply_inner, None, reduction, each_replica,
                             nonfinite, replicas, weighted),
        _noop,
    )


def close_window(
    backend: Backend,
    state: WindowState,
    sparse: Sequence[bool],
    mask: Sequence[int],
    apply_inner: Callable[[list, dict], Any],
    gradient_accumulation_steps: Any,
    reduction: str,
    each_replica: Callable[..., Any],
    nonfinite: str,
    replicas: int,
    weighted: bool = True,
) -> Any:
    """The end of a window: one inner update with the window gradient, or,
    for a window marked non-finite (``"skip_window"``) or whose counts sum to
    0, a discard (accumulators zeroed, the inner optimizer not called).

    The normaliser of ``"mean"``, ``weighted`` (counts may differ between
    replicas): ``window_weight`` summed over replicas, divided by
    ``replicas`` (each replica's gradient is already its mean loss's divided
    by the replica count, Keras' convention), read once per update: one
    scalar reduction under a multi-replica strategy. Not ``weighted`` (every
    micro-step counted 1 on every replica): each replica's own
    ``window_weight``, the window's micro-steps, with no reduction. Without
    ``window_weight``: N (``gradient_accumulation_steps``, an int).
    """
    if state.window_weight is None:
        divisor, total = gradient_accumulation_steps, None
    elif not weighted:
        divisor, total = LOCAL_COUNT, None
    else:
        total = tf.convert_to_tensor(state.window_weight)
        divisor = total / tf.cast(replicas, total.dtype) if replicas != 1 else total

    def update() -> Any:
        applied = each_replica(apply_window, backend, state, sparse, mask, apply_inner, divisor, reduction)
        with tf.control_dependencies(_ops(applied)):
            return restart_window(backend, state)

    def drop() -> Any:
        return discard_window(backend, state, sparse, each_replica, count_skipped=False)

    def weighted_update() -> Any:
        if total is None:
            return update()
        return backend.cond(tf.greater(total, 0), update, drop)

    if nonfinite != "skip_window":
        return weighted_update()
    poisoned = tf.greater(tf.convert_to_tensor(state.window_poisoned), 0)
    return backend.cond(
        poisoned, lambda: discard_window(backend, state, sparse, each_replica), weighted_update
    )


UNKNOWN_POSITION = -1
"""``mini_step`` of an adapter that creates it with this value ("not known
yet", see :func:`resume_position`)."""


def resume_position(
    backend: Backend, state: WindowState, gradient_accumulation_steps: Any, each_replica: Callable[..., Any] | None = None
) -> Any:
    """If ``mini_step`` is :data:`UNKNOWN_POSITION` (a fresh optimizer, or
    state restored from a checkpoint saved before ``mini_step`` existed):
    ``mini_step = micro_steps % N`` (0 under a schedule: no such checkpoint
    has one) and, in each replica, ``window_weight = mini_step`` (every
    micro-step of such a window counted 1). What the window's position was
    before it had its own counter, so that such a checkpoint resumes exactly.
    One scalar ``cond``. For adapters whose checkpoints restore lazily and
    by name (``tf.train.Checkpoint``, TF1 ``Saver`` with a ``var_list``),
    where a missing variable keeps its initial value: they create
    ``mini_step`` with :data:`UNKNOWN_POSITION` and call this before every
    :func:`micro_step` and :func:`flush`."""
    each_replica = each_replica or _call
    mini_step = state.mini_step

    def derive() -> Any:
        if isinstance(gradient_accumulation_steps, numbers.Integral):
            position = tf.math.floormod(tf.convert_to_tensor(state.micro_steps), int(gradient_accumulation_steps))
        else:
            position = tf.zeros([], mini_step.dtype)
        position = tf.cast(position, mini_step.dtype)
        counted = each_replica(_set_count, backend, state.window_weight, position)
        return [backend.assign(mini_step, position), counted]

    return backend.cond(tf.less(tf.convert_to_tensor(mini_step), 0), derive, _noop)


def _set_count(backend: Backend, window_weight: Any, position: Any) -> Any:
    return backend.assign(window_weight, tf.cast(position, window_weight.dtype))


def restart_window(backend: Backend, state: WindowState) -> list:
    """``grad_received = 0`` and ``mini_step = 0`` (cross-replica counters)."""
    done = [backend.assign(state.grad_received, tf.zeros_like(state.grad_received))]
    if state.mini_step is not None:
        done.append(backend.assign(state.mini_step, tf.zeros_like(state.mini_step)))
    return done


def window_closes(state: WindowState, gradient_accumulation_steps: Any) -> Any:
    """Boolean scalar: does the micro-step just counted close its window?

    With ``state.mini_step``: ``mini_step >= N``, N the int, or the
    schedule's N for the window (``gradient_accumulation_steps(updates)``,
    :func:`window_length`). Without: ``micro_steps % N == 0``.
    """
    if state.mini_step is None:
        return is_update_step(state.micro_steps, gradient_accumulation_steps)
    if callable(gradient_accumulation_steps):
        length = gradient_accumulation_steps(tf.convert_to_tensor(state.updates))
    else:
        length = gradient_accumulation_steps
    mini_step = tf.convert_to_tensor(state.mini_step)
    return tf.greater_equal(mini_step, tf.cast(length, mini_step.dtype))


def skipped_micro_step(
    backend: Backend, state: WindowState, gradient_accumulation_steps: int, nonfinite: str, each_replica: Callable
) -> Any:
    """A micro-step known to be non-finite when it is built (one that an
    outer loss-scale optimizer skipped): what :func:`micro_step` does with a
    false finiteness flag, without building the accumulation or the update.
    ``"skip_micro_step"``: ``skipped_micro_steps += 1``. ``"skip_window"``:
    also ``micro_steps += 1`` and the window is marked; if that closes the
    window, it is discarded (:func:`discard_window`)."""
    sparse = [False] * len(state.acc_grads)
    skipped = [increment(backend, state.skipped_micro_steps)]
    if nonfinite == "skip_micro_step":
        return skipped
    skipped += [
        backend.assign(state.window_poisoned, tf.ones_like(state.window_poisoned)),
        increment(backend, state.micro_steps),
    ]
    if state.mini_step is not None:
        skipped.append(increment(backend, state.mini_step))
    with tf.control_dependencies(_ops(skipped)):
        closes = window_closes(state, gradient_accumulation_steps)
        return backend.cond(closes, lambda: discard_window(backend, state, sparse, each_replica), _noop)


def all_finite(grads: Sequence[Any]) -> Any:
    """Boolean scalar: every element of every gradient is finite (``None``
    gradients are ignored). One ``is_finite`` reduction per gradient, combined
    into one scalar in the graph: no host sync."""
    flags = [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags)) if len(flags) > 1 else flags[0]


def sparse_window(grad: Any, tracker: Any) -> bool:
    """Does the update hand the inner optimizer this variable's window as
    ``tf.IndexedSlices`` over its touched rows (a trace-time decision)?

    Only for a variable with a row tracker, and then when its gradient on the
    closing micro-step is a ``tf.IndexedSlices``, or is ``None``: a variable
    that got its sparse gradients from another train op (TF1 graph code with
    several train ops sharing one window) must still get the sparse window
    the large batch would give it. (Rows a dense gradient touched are all
    marked, so an all-rows window stands for a dense one; a variable without
    a gradient in the whole window has no touched rows and a false gate.)
    """
    if tracker is None:
        return False
    return grad is None or isinstance(_local(grad), tf.IndexedSlices)


def accumulate(backend: Backend, state: WindowState, grads: Sequence[Any], weight: Any = None) -> list:
    """Step 1: ``acc_grads[i] += weight * grads[i]`` for each gradient that is
    not None (cast to the accumulator's dtype first: a float32 accumulator
    sums 16-bit gradients exactly; no multiplication without a weight),
    ``window_weight += weight`` (1 without one), and mark the rows each
    gradient touched where rows are tracked."""
    # The writes wait for this replica's gradients here too: under
    # tf.distribute this runs in each replica's thread, outside the caller's
    # control-dependency scope, and the count has no data dependency on them.
    with tf.control_dependencies(gradient_tensors(list(grads) + [weight])):
        return _accumulate(backend, state, grads, weight)


def _accumulate(backend: Backend, state: WindowState, grads: Sequence[Any], weight: Any) -> list:
    done = []
    if state.window_weight is not None:
        count = tf.constant(1.0, state.window_weight.dtype) if weight is None else tf.cast(weight, state.window_weight.dtype)
        done.append(backend.assign_add(state.window_weight, count))
    for i, (acc, grad) in enumerate(zip(state.acc_grads, grads)):
        if grad is None:
            continue
        done.append(backend.assign_add(acc, scaled(cast_to(grad, acc.dtype), weight)))
        rows = state.rows_tracker(i)
        if rows is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            done.append(backend.scatter_update(rows, grad.indices, tf.ones_like(grad.indices, rows.dtype)))
        else:  # a dense gradient touches every row
            done.append(backend.assign(rows, tf.fill(tf.shape(rows), tf.constant(1, rows.dtype))))
    return done


def scaled(grad: Any, weight: Any) -> Any:
    """``weight * grad`` (dense or ``tf.IndexedSlices``); ``grad`` itself
    without a weight."""
    if weight is None:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(weight, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(weight, grad.dtype)


def received_mask(grads: Sequence[Any]) -> list[int]:
    """Which variables got a gradient this micro-step (a trace-time constant)."""
    return [0 if g is None else 1 for g in grads]


def count_micro_step(backend: Backend, state: WindowState, mask: Sequence[int]) -> list:
    """Step 2: ``micro_steps += 1``, ``mini_step += 1`` and
    ``grad_received |= mask``."""
    return advance(backend, state) + mark_received(backend, state, mask)


def advance(backend: Backend, state: WindowState) -> list:
    """``micro_steps += 1`` and (where kept) ``mini_step += 1``."""
    done = [increment(backend, state.micro_steps)]
    if state.mini_step is not None:
        done.append(increment(backend, state.mini_step))
    return done


def mark_received(backend: Backend, state: WindowState, mask: Sequence[int]) -> list:
    """``grad_received |= mask``."""
    received = state.grad_received
    if all(mask):
        return [backend.assign(received, tf.ones_like(received))]
    if any(mask):
        return [backend.assign(received, tf.maximum(received, tf.constant(mask, received.dtype)))]
    return []


def increment(backend: Backend, counter: Any) -> Any:
    """``counter += 1``."""
    return backend.assign_add(counter, tf.constant(1, counter.dtype))


def count(backend: Backend, state: WindowState, mask: Sequence[int], nonfinite: str, ok: Any) -> Any:
    """Step 2 under each policy (``ok``: the finiteness flag, or ``None``).

    * ``"propagate"``: :func:`count_micro_step`.
    * ``"skip_micro_step"``: finite: :func:`count_micro_step`; otherwise only
      ``skipped_micro_steps += 1`` (the micro-step is not counted).
    * ``"skip_window"``: ``micro_steps += 1`` either way (the non-finite
      micro-batch is one of the window's N, as its samples are part of the
      large batch); finite: ``grad_received |= mask``; otherwise
      ``skipped_micro_steps += 1`` and the window is marked.
    """
    if nonfinite == "propagate":
        return count_micro_step(backend, state, mask)

    def skipped() -> list:
        done = [increment(backend, state.skipped_micro_steps)]
        if nonfinite == "skip_window":
            done.append(backend.assign(state.window_poisoned, tf.ones_like(state.window_poisoned)))
        return done

    if nonfinite == "skip_micro_step":
        return backend.cond(ok, lambda: count_micro_step(backend, state, mask), skipped)
    counted = advance(backend, state)
    with tf.control_dependencies(_ops(counted)):
        return [counted, backend.cond(ok, lambda: mark_received(backend, state, mask), skipped)]


def discard_window(
    backend: Backend, state: WindowState, sparse: Sequence[bool], each_replica: Callable, count_skipped: bool = True
) -> Any:
    """End a window without an update: zero the accumulators (in each
    replica), ``grad_received`` and ``mini_step``. ``count_skipped``
    (``"skip_window"`` at the end of a marked window): also clear the mark
    and ``skipped_windows += 1``; otherwise (a window whose counts sum to 0)
    nothing else. The inner optimizer is not called, so the weights, its
    slots, ``iterations``, schedules and EMA do not move."""
    dropped = each_replica(zero_accumulators, backend, state, sparse)
    with tf.control_dependencies(_ops(dropped)):
        done = restart_window(backend, state)
        if count_skipped:
            done += [
                backend.assign(state.window_poisoned, tf.zeros_like(state.window_poisoned)),
                increment(backend, state.skipped_windows),
            ]
        return done


def zero_accumulators(backend: Backend, state: WindowState, sparse: Sequence[bool]) -> list:
    """Zero the accumulators (the touched rows only where ``sparse[i]``)."""
    rows = [touched_rows(state.rows_tracker(i)) if s else None for i, s in enumerate(sparse)]
    return reset(backend, state, rows, runtime_zero(state.micro_steps))


def is_update_step(micro_steps: Any, gradient_accumulation_steps: int) -> Any:
    """Boolean scalar: does the micro-step just counted close a window?
    ``micro_steps`` is the count *after* incrementing."""
    return tf.equal(tf.math.floormod(tf.convert_to_tensor(micro_steps), gradient_accumulation_steps), 0)


def apply_window(
    backend: Backend,
    state: WindowState,
    sparse: Sequence[bool],
    mask: Sequence[int],
    apply_inner: Callable[[list, dict], Any],
    divisor: Any,
    reduction: str,
) -> list:
    """Step 3 (in each replica): the inner update with the window's
    gradients (``"mean"``: the sums divided by ``divisor``, an int N or a
    float scalar tensor), then the accumulators zeroed (only the touched rows
    of a sparse window, whether it reached the inner optimizer as
    ``tf.IndexedSlices`` or, where :meth:`WindowState.hands_sparse` is false,
    dense)."""
    rows = [touched_rows(state.rows_tracker(i)) if s else None for i, s in enumerate(sparse)]
    handed = [r if r is not None and state.hands_sparse(i) else None for i, r in enumerate(rows)]
    dtypes = state.variable_dtypes or [None] * len(state.acc_grads)
    if divisor is LOCAL_COUNT:
        divisor = tf.convert_to_tensor(state.window_weight)  # this replica's
    window = [
        cast_to(window_gradient(acc, divisor, reduction, r), dtype)
        for acc, r, dtype in zip(state.acc_grads, handed, dtypes)
    ]
    gates = {i: tf.greater(state.grad_received[i], 0) for i, m in enumerate(mask) if not m}
    applied = apply_inner(window, gates)
    with tf.control_dependencies(_ops(applied)):
        return reset(backend, state, rows, runtime_zero(state.micro_steps))


def touched_rows(tracker: Any) -> Any:
    """int64 vector: the rows marked in ``tracker``, ascending, each once."""
    return tf.reshape(tf.where(tf.convert_to_tensor(tracker) > 0), [-1])


def window_gradient(acc: Any, divisor: Any, reduction: str, rows: Any = None) -> Any:
    """The gradient one update applies, from one accumulator slot.

    ``mean``: ``acc / divisor``, ``divisor`` being N (an int) or the window's
    count ``Σ cᵢ`` (a float scalar tensor). For a loss that is a mean over
    its micro-batch this is exactly the gradient of the mean loss over the
    window's samples (``acc = Σ cᵢ·gᵢ``; micro-steps where the variable had
    no gradient contribute zero, as the missing samples' terms do in the
    large batch). ``sum``: ``acc``, the recipe of summing micro-batch
    gradients.

    With ``rows`` (int64 vector of touched rows), a ``tf.IndexedSlices`` over
    those rows, each once: what a lazy sparse optimizer must see to match the
    large batch trained on its own sparse gradient.
    """
    if rows is None:
        value = tf.convert_to_tensor(acc)
    else:
        value = tf.gather(_resource_variable(acc), rows)
    if reduction == "mean" and not (isinstance(divisor, numbers.Integral) and divisor == 1):
        value = value / tf.cast(divisor, value.dtype)
    if rows is None:
        return value
    return tf.IndexedSlices(value, rows, dense_shape=tf.constant(_static_shape(acc), tf.int64))


def runtime_zero(micro_steps: Any) -> Any:
    """A scalar 0 that graph optimizers cannot fold into a constant.

    ``assign(acc, zeros(shape))`` with a constant 0 gets constant-folded by
    TensorFlow's graph optimizer into a constant as large as the accumulator,
    which the traced function then keeps alive: one more copy of the
    parameters, resident for good (measured on a 244 MiB embedding table).
    ``max(min(micro_steps, 0), 0)`` is 0 for every integer but is only known
    when the step runs.
    """
    micro_steps = tf.convert_to_tensor(micro_steps)
    return tf.maximum(tf.minimum(micro_steps, 0), 0)


def reset(backend: Backend, state: WindowState, rows: Sequence[Any], zero: Any) -> list:
    """Zero the accumulators (only the touched rows where ``rows[i]`` is
    given, and their marks), with ``zero`` from :func:`runtime_zero`."""
    done = []
    if state.window_weight is not None:
        done.append(backend.assign(state.window_weight, tf.cast(zero, state.window_weight.dtype)))
    for i, (acc, r) in enumerate(zip(state.acc_grads, rows)):
        if r is None:
            done.append(backend.assign(acc, tf.fill(tf.shape(acc), tf.cast(zero, acc.dtype))))
            tracker = state.rows_tracker(i)
            if tracker is not None:
                done.append(backend.assign(tracker, tf.fill(tf.shape(tracker), tf.cast(zero, tracker.dtype))))
            continue
        n_rows = tf.shape(r)[:1]
        row_shape = tf.constant(_static_shape(acc)[1:], tf.int32)
        zeros = tf.fill(tf.concat([n_rows, row_shape], 0), tf.cast(zero, acc.dtype))
        done.append(backend.scatter_update(acc, r, zeros))
        tracker = state.rows_tracker(i)
        done.append(backend.scatter_update(tracker, r, tf.fill(n_rows, tf.cast(zero, tracker.dtype))))
    return done


# ------------------------------------------------------------------ helpers
def _resource_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable (else ``variable``), so
    that ``tf.gather`` on it is a ``ResourceGather`` of the rows: on the Keras
    variable it reads the whole accumulator first (``ReadVariableOp``), a
    table-sized copy when the variable is in copy-on-read mode, and an alias
    that makes the next scatter into it copy the buffer."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def _static_shape(variable: Any) -> list[int]:
    """A variable's shape as ints (variables always have a static shape)."""
    return [int(d) for d in variable.shape]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _identity(value: Any) -> Any:
    return value


def _values(grad: Any) -> Any:
    """A gradient's values (``tf.IndexedSlices``: its slices)."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def cast_to(grad: Any, dtype: Any) -> Any:
    """``grad`` (dense or ``tf.IndexedSlices``) in ``dtype``; unchanged when
    ``dtype`` is ``None`` or already its dtype."""
    if dtype is None:
        return grad
    dtype = tf.as_dtype(dtype).base_dtype  # a TF1 RefVariable's dtype is `float32_ref`
    if grad.dtype.base_dtype == dtype:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def _local(value: Any) -> Any:
    """One replica's value of a per-replica value (the value itself otherwise)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _noop() -> Any:
    return None


def _ops(values: Any) -> list:
    """The ops and tensors among ``values`` (nested; what a TF1 backend
    returns), for control dependencies. ``None`` and anything else is left
    out: eager and ``tf.function`` code needs no explicit ordering."""
    found = []
    for v in tf.nest.flatten(values):
        if isinstance(v, (tf.Operation, tf.Tensor)):
            found.append(v)
        elif isinstance(getattr(v, "op", None), tf.Operation):
            found.append(v.op)
    return found


def gradient_tensors(grads: Sequence[Any]) -> list:
    """Every tensor behind ``grads`` (IndexedSlices and per-replica values
    expanded), for the control dependency that orders each write of the
    micro-step after its gradients exist. Empty in eager mode."""
    if tf.executing_eagerly():
        return []
    flat = tf.nest.flatten([g for g in grads if g is not None], expand_composites=True)
    return [t for t in flat if isinstance(t, tf.Tensor)]
