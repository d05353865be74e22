"""The accumulation window: the whole algorithm, for every family and framework.

One call of :func:`micro_step` is one micro-step:

1. ``acc_grads[i] += c * grads[i]`` for every gradient that is not ``None``
   (a scatter-add for a sparse gradient, never a densification; ``c`` is the
   micro-step's ``weight``, its count; without one, no multiplication),
   ``window_weight += c`` (1 without a weight); where rows are tracked, the
   rows the gradient touched are marked. A variable combined by ``"max"``
   (``WindowState.combine``: float8 scaling state) instead keeps the
   element-wise maximum of its values in the window, unweighted.
2. ``micro_steps += 1``, ``mini_step += 1``, ``grad_received |= mask``.
3. If ``mini_step`` reaches the window's N (:func:`window_length`; decided
   before step 2, from ``mini_step + 1``: below):
   :func:`close_window` calls the inner optimizer once with the window's
   gradient (``Σ cᵢ·gᵢ / Σ cᵢ`` for ``"mean"``, ``Σ cᵢ·gᵢ`` for ``"sum"``),
   gated per variable by ``grad_received`` (a ``"max"`` variable gets its
   window maximum as is), then zeroes the accumulators,
   ``window_weight``, ``mini_step`` and ``grad_received``; then the state's
   ``followers`` end their windows too (BatchNorm's pooled statistics). Otherwise nothing
   else happens: the model weights and every variable of the inner optimizer
   stay bitwise untouched.

:func:`flush` runs step 3 on a partial window (normalised by its own
``Σ cᵢ``, never by N). A window whose counts sum to 0 is discarded instead of
applied. :func:`pass_through` is N = 1 without a window.

Whether step 3 runs is decided before step 2 counts: from ``mini_step + 1``,
``mini_step`` read before any write of the micro-step (:func:`window_closes`),
as Keras' built-in accumulation decides from ``iterations + 1``. Every
write of the micro-step is in the branches of that decision's ``cond``: the
window's last micro-step adds its gradients in step 3 (a dense gradient as
a value, ``acc + c·g``, never written), the others in step 1.

The decision waits for no gradient, as the built-in's does: once
TensorFlow lowers the ``cond`` (XLA off), what its taken branch runs that
reads no gradient (the inner optimizer's scalars, reads, constants) is not
held back until the backward pass begins. Every write waits for a gradient
instead, so that a traced step whose input ends (``OutOfRange`` from a
dataset of unknown length) writes nothing (else: a phantom micro-step per
epoch): each accumulator for its own; the counters, ``window_weight += c``,
the reset and the writes of the inner update that read no gradient (its
step counter, weight decay: through ``Backend.fence`` where the backend
has one) for one, :func:`guard` (the last in build order: the first the
backward pass computes). So each variable's window gradient waits for its
own gradient and the guard (the divisor is ``window_weight`` after
``+= c``), and its update starts while the backward pass computes the
others', as the built-in's does (``docs/performance.md``). (Known
limitation: where the last variable's gradient does not depend on the
input, a variable of a regularisation term alone built last, those writes
wait for no input: ``tests/keras3/test_tracing.py``.)

Non-finite gradients (``Rules.nonfinite``): ``"propagate"`` is the above.
``"skip_micro_step"``: a micro-step whose gradients are not all finite on
every replica adds nothing and is not counted (``skipped_micro_steps += 1``).
``"skip_window"``: it is counted but adds nothing and marks the window,
whose last micro-step then discards it (``skipped_windows += 1``), as the
large batch would skip its step. Under both the micro-step's writes wait
for its finiteness check, and so for all of its gradients.

Accumulators may be wider than their variables (float32 for 16-bit
weights): each gradient is cast to the accumulator's dtype when added, and
the window gradient back to the variable's once, after the division.

Every function takes the family's :class:`~accum_optimizer.core.state.Backend`
first; nothing here imports a framework.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

from accum_optimizer.core.state import ONE_REPLICA, Backend, Replicas, Rules, WindowState

LOCAL_COUNT = object()
"""Divisor of :func:`apply_window`: each replica's own ``window_weight``."""

UNKNOWN_POSITION = -1
"""``mini_step`` meaning "not known yet" (see :func:`resume_position`)."""


def _noop() -> Any:
    return None


# ------------------------------------------------------------ the micro-step
def micro_step(
    b: Backend,
    state: WindowState,
    rules: Rules,
    grads: Sequence[Any],
    *,
    replicas: Replicas = ONE_REPLICA,
    weight: Any = None,
    finite: Any = None,
) -> Any:
    """One micro-step: accumulate, count, and on a window's last micro-step update.

    Args:
        b: the family's backend.
        state: the window's variables.
        rules: N (or its schedule), reduction, non-finite policy, weighting.
        grads: one entry per variable of ``state`` (build order): a dense
            gradient of the variable's shape, a sparse one, or ``None``. Under
            a distribution strategy, in cross-replica context, the
            per-replica values.
        replicas: how to reach the replicas (default: one device).
        weight: the micro-step's count ``c`` (float32 scalar; per replica
            under a strategy), or ``None`` for 1.
        finite: optional boolean scalar, the same on every replica, that
            replaces the finiteness check of ``grads`` (a verdict reached
            elsewhere). The constant ``False`` (with every gradient ``None``)
            records a micro-step an outer loss-scale optimizer skipped;
            nothing of the update is then built. Ignored by ``"propagate"``.

    Returns:
        What ``b.cond`` returns (an op for TF1 graph code).
    """
    check_state(state, rules)
    mask = [0 if g is None else 1 for g in grads]
    sparse = [sparse_window(b, g, state.rows_tracker(i)) for i, g in enumerate(grads)]
    weighted = weight is not None if rules.weighted is None else rules.weighted
    if rules.nonfinite != "propagate" and finite is False:
        with b.after(list(grads) + [weight]):
            return skipped_micro_step(b, state, rules, replicas, sparse, weighted)

    def count(*counters: Callable[[], list]) -> list:
        # The counters wait for the guard, as every write does (waiting for
        # every gradient held each gradient's buffer to the end of the
        # step: 3% of a micro-step, docs/performance.md).
        with b.after(guard(grads) + [weight]):
            return [op for counter in counters for op in counter()]

    def counted() -> Any:  # a finite micro-step: every one under "propagate"
        return b.cond(
            closes,
            lambda: [count(lambda: [increment(b, state.micro_steps)]),
                     close_window(b, state, rules, replicas, sparse, mask, weighted, grads, weight)],
            lambda: [replicas.each(accumulate, b, state, grads, weight),
                     count(lambda: advance(b, state), lambda: mark_received(b, state, mask))],
        )

    if rules.nonfinite == "propagate":
        # The decision, from the position before this micro-step counts,
        # waits for the weight's checks only (every write, all in the
        # branches, waits for a gradient itself).
        with b.after([weight]):
            closes = window_closes(b, state, rules)
        return counted()
    with b.after(list(grads) + [weight]):
        ok = b.cast(finite, "bool") if finite is not None else replicas.all(replicas.each(b.all_finite, grads))
        closes = window_closes(b, state, rules)
        return b.cond(ok, counted, lambda: skipped_micro_step(b, state, rules, replicas, sparse, weighted))


def guard(grads: Sequence[Any]) -> list:
    """The gradient that the writes of a micro-step which read no gradient
    wait for (as a one-item list; empty if all are ``None``): the counters,
    ``window_weight += c``, the reset, the inner update's step counter, a
    restored window's position. The last in build order, which for a
    model's variables in layer order is the first the backward pass
    computes, so that waiting for it holds nothing back. A gradient depends
    on the step's input (the last one does but for a variable of a
    regularisation term alone built last: the module's docstring), so a step
    whose input ends runs no write."""
    present = [g for g in grads if g is not None]
    return present[-1:]


def accumulate(b: Backend, state: WindowState, grads: Sequence[Any], weight: Any = None) -> list:
    """Step 1 (in each replica): ``acc_grads[i] += weight * grads[i]``,
    ``window_weight += weight`` (1 without one), rows marked."""
    return [add_count(b, state, weight, grads), *[op for ops in add_gradients(b, state, grads, weight) for op in ops]]


def add_count(b: Backend, state: WindowState, weight: Any = None, grads: Sequence[Any] = ()) -> Any:
    """``window_weight += weight`` (1 without one), after the weight's checks
    and the :func:`guard` of the micro-step's ``grads``."""
    with b.after(guard(grads) + [weight]):
        dtype = b.dtype(state.window_weight)
        count = b.constant(1.0, dtype) if weight is None else b.cast(weight, dtype)
        return b.assign_add(state.window_weight, count)


def add_gradients(b: Backend, state: WindowState, grads: Sequence[Any], weight: Any = None) -> list:
    """``acc_grads[i] += weight * grads[i]`` and the rows marked: per
    variable, the list of its writes (empty for a ``None`` gradient)."""
    # Each variable's writes wait for its own gradient only, so that they
    # run while the backward pass computes the others' (waiting for all of
    # them cost 4 ms of a 38 ms micro-step: docs/performance.md).
    written: list = []
    received = None
    for i, (acc, grad) in enumerate(zip(state.acc_grads, grads)):
        done: list = []
        written.append(done)
        if grad is None:
            continue
        with b.after([grad, weight]):
            g = b.cast_gradient(grad, b.dtype(acc))
            if state.combined_by_max(i):
                # The window's first value as is, then the element-wise
                # maximum (unweighted: a micro-batch of count 0 still ran its
                # forward pass, as its samples do in the large batch).
                if received is None:
                    received = b.read(state.grad_received)
                first = b.equal(received[i], 0)
                done.append(b.assign(acc, b.where(first, g, b.maximum(b.read(acc), g))))
                continue
            done.append(b.assign_add(acc, contribution(b, acc, grad, weight, g)))
            tracker = state.rows_tracker(i)
            if tracker is None:
                continue
            if b.is_sparse(grad):
                indices = b.sparse_indices(grad)
                done.append(b.scatter_update(tracker, indices, b.fill_rows_like(tracker, indices, 1)))
            else:  # a dense gradient touches every row
                done.append(b.assign(tracker, b.fill_like(tracker, 1)))
    return written


def contribution(b: Backend, acc: Any, grad: Any, weight: Any = None, cast: Any = None) -> Any:
    """What a micro-step adds to an accumulator: ``weight * grad`` in the
    accumulator's dtype (``cast``: ``grad`` already cast)."""
    g = b.cast_gradient(grad, b.dtype(acc)) if cast is None else cast
    return g if weight is None else b.scale(g, weight)


def advance(b: Backend, state: WindowState) -> list:
    """``micro_steps += 1`` and ``mini_step += 1``."""
    return [increment(b, state.micro_steps), increment(b, state.mini_step)]


def mark_received(b: Backend, state: WindowState, mask: Sequence[int]) -> list:
    """``grad_received |= mask``."""
    received = state.grad_received
    if all(mask):
        return [b.assign(received, b.ones_like(received))]
    if any(mask):
        return [b.assign(received, b.maximum(received, b.constant(list(mask), b.dtype(received))))]
    return []


def increment(b: Backend, counter: Any) -> Any:
    """``counter += 1``."""
    return b.assign_add(counter, b.constant(1, b.dtype(counter)))


def window_length(b: Backend, rules: Rules, state: WindowState) -> Any:
    """N of the current window: the int, or the schedule's N for the
    window's first update (a dict: piecewise constant over updates; a
    callable of the int64 update index, asserted >= 1 when the step runs)."""
    length = rules.length
    if isinstance(length, numbers.Integral):
        return int(length)
    update = b.cast(b.read(state.updates), "int64")
    if isinstance(length, dict):
        keys = sorted(length)
        return b.piecewise(update, keys, [length[k] for k in keys])
    return b.checked_positive(
        b.cast(length(update), "int64"), "gradient_accumulation_steps(update_index) must return an int >= 1"
    )


def window_closes(b: Backend, state: WindowState, rules: Rules) -> Any:
    """Boolean scalar: does the micro-step about to be counted close its
    window (``mini_step + 1 >= N``)? Call it before the micro-step counts:
    it reads ``mini_step`` as the previous micro-steps left it (and the
    schedule's N from ``updates``, which only the update moves)."""
    mini_step = b.read(state.mini_step)
    dtype = b.dtype(mini_step)
    return b.greater_equal(b.add(mini_step, b.constant(1, dtype)), b.cast(window_length(b, rules, state), dtype))


# ------------------------------------------------------- the end of a window
def close_window(
    b: Backend,
    state: WindowState,
    rules: Rules,
    replicas: Replicas,
    sparse: Sequence[bool],
    mask: Sequence[int],
    weighted: bool,
    grads: Sequence[Any] | None = None,
    weight: Any = None,
) -> Any:
    """One inner update with the window gradient or, for a window marked
    non-finite (``"skip_window"``) or whose counts sum to 0, a discard.

    ``grads`` and ``weight``: the closing micro-step's, added to the window
    here (:func:`apply_window`), or ``None`` (:func:`flush`, a skipped
    micro-step).

    The normaliser of ``"mean"``: ``weighted`` (counts may differ between
    replicas): ``window_weight`` summed over replicas, divided by their
    number (each replica's gradient is already its mean loss's divided by
    the replica count, Keras' convention), read once per update (one scalar
    reduction under a strategy). Otherwise each replica's own
    ``window_weight``, with no reduction.
    """

    guarded = guard(grads) if grads is not None else []

    def drop() -> Any:
        return discard_window(b, state, sparse, replicas, count_skipped=False)

    def update_or_drop() -> Any:
        counted = None if grads is None else replicas.each(add_count, b, state, weight, grads)
        if not weighted:
            return update(LOCAL_COUNT, counted, power_of_two(rules.length))
        with b.after([counted]):
            total = b.read(state.window_weight)
        divisor = b.divide(total, b.cast(replicas.count, b.dtype(total))) if replicas.count != 1 else total
        return b.cond(b.greater(total, 0), lambda: update(divisor, counted), drop)

    def update(divisor: Any, counted: Any, exact_inverse: bool = False) -> Any:
        applied = replicas.each(
            apply_window, b, state, sparse, mask, divisor, rules.reduction, grads, weight, counted, exact_inverse
        )
        with b.after([applied, *guarded]):
            return restart_window(b, state)

    if rules.nonfinite != "skip_window":
        ended = update_or_drop()
    else:
        poisoned = b.greater(b.read(state.window_poisoned), 0)
        ended = b.cond(poisoned, lambda: discard_window(b, state, sparse, replicas), update_or_drop)
    if not state.followers:
        return ended
    with b.after([ended, *guarded]):  # a discarded window ends too: the large batch's forward pass still ran
        return [ended, *(follow() for follow in state.followers)]


def apply_window(
    b: Backend,
    state: WindowState,
    sparse: Sequence[bool],
    mask: Sequence[int],
    divisor: Any,
    reduction: str,
    grads: Sequence[Any] | None = None,
    weight: Any = None,
    counted: Any = None,
    exact_inverse: bool = False,
) -> list:
    """In each replica: the closing micro-step's ``grads`` added (if
    given), the inner update with the window's gradients (a ``"max"``
    variable's window maximum as is), then the accumulators zeroed (only the
    touched rows of a sparse window).

    Each variable's window is read after its own writes only, and the
    divisor after ``counted`` (this replica's ``window_weight += c``, which
    waits for the :func:`guard` only): each variable's window gradient
    waits for its own gradient and the guard, not for the whole backward
    pass. The writes of the inner update that read no gradient and the
    reset wait for the guard: through ``b.fence`` (a read of each variable
    the inner update may write, after the guard: automatic control
    dependencies order a later write after it, not a later read), else by
    the whole inner update waiting for it.

    ``exact_inverse``: the divisor is known to be a power of two (an
    unweighted window of a power-of-two N: ``Σcᵢ = N``), whose reciprocal is
    exact: the window is multiplied by it, bitwise the division, as
    TensorFlow's graph optimizer and XLA turn Keras' built-in's division by
    the constant N into a multiplication (a division per element costs more,
    most with XLA: ``docs/performance.md``).
    """
    n = len(state.acc_grads)
    grads = [None] * n if grads is None else list(grads)
    # A dense gradient summed into one accumulator joins the window as a
    # value, ``acc + c·g`` (what the write would have stored, bitwise), not
    # written first: one pass over the accumulator fewer, as Keras' built-in
    # (``acc + g``). The others are written first, and read after their own
    # writes only.
    direct = [
        g is not None and not b.is_sparse(g) and state.rows_tracker(i) is None
        and not state.combined_by_max(i) and getattr(b, "read_window", None) is None
        for i, g in enumerate(grads)
    ]
    written = add_gradients(b, state, [None if d else g for g, d in zip(grads, direct)], weight)
    dtypes = state.variable_dtypes or [None] * n
    if divisor is LOCAL_COUNT:
        with b.after([counted]):
            divisor = b.read(state.window_weight)  # this replica's
    inverses: dict = {}

    def inverse(dtype: Any) -> Any:  # 1 / divisor, once per accumulator dtype
        if dtype not in inverses:
            inverses[dtype] = b.divide(b.constant(1.0, dtype), b.cast(divisor, dtype))
        return inverses[dtype]

    rows, window = [], []
    for i, acc in enumerate(state.acc_grads):
        with b.after(written[i]):
            r = b.touched(state.rows_tracker(i)) if sparse[i] else None
            handed = r if r is not None and state.hands_sparse(i) else None
            added = contribution(b, acc, grads[i], weight) if direct[i] else None
            value = (
                read_window(b, acc, "max") if state.combined_by_max(i)
                else window_gradient(b, acc, divisor, reduction, handed, added,
                                     inverse(b.dtype(acc)) if exact_inverse and reduction == "mean" else None)
            )
        rows.append(r)
        window.append(b.cast_gradient(value, dtypes[i]))
    received = b.read(state.grad_received) if not all(mask) else None
    gates = {i: b.greater(received[i], 0) for i, m in enumerate(mask) if not m}
    guarded = guard(grads)
    fence = getattr(b, "fence", None)
    if fence is not None and fence(guarded):
        applied = b.apply_inner(window, gates)
    else:
        with b.after(guarded):
            applied = b.apply_inner(window, gates)
    with b.after([applied, *written, *guarded]):
        return reset(b, state, rows)


def window_gradient(
    b: Backend, acc: Any, divisor: Any, reduction: str, rows: Any = None, added: Any = None, inverse: Any = None
) -> Any:
    """The gradient one update applies, from one accumulator.

    ``"mean"``: ``acc / divisor``, the window's count ``Σ cᵢ``: for a loss
    that is a mean over its micro-batch, exactly the gradient of the mean
    loss over the window's samples (micro-steps where the variable had no
    gradient contribute zero, as the missing samples' terms do in the large
    batch). ``"sum"``: ``acc``. With ``rows``: sparse, over those rows, each
    once (what a lazy sparse optimizer must see to match the large batch
    trained on its own sparse gradient). With ``inverse`` (``1 / divisor``,
    exact: a power of two): ``acc · inverse``, the same value.
    """
    value = read_window(b, acc, "sum") if rows is None else b.gather_rows(acc, rows)
    if added is not None:  # the closing micro-step's dense contribution, not written
        value = b.add(value, added)
    if reduction == "mean":
        value = b.divide(value, b.cast(divisor, b.dtype(value))) if inverse is None else b.scale(value, inverse)
    return value if rows is None else b.sparse(value, rows, acc)


def power_of_two(length: Any) -> bool:
    """Is the window length a fixed power of two (1, 2, 4, ...)? Then the
    count of an unweighted window at its close, ``Σcᵢ = N``, has an exact
    reciprocal (:func:`apply_window`)."""
    return isinstance(length, numbers.Integral) and length > 0 and int(length) & (int(length) - 1) == 0


def read_window(b: Backend, acc: Any, combine: str) -> Any:
    """An accumulator's value for the window's update: ``b.read(acc)``, or,
    where the backend keeps one accumulator per device (``b.read_window``:
    Keras 3 on JAX with :class:`accum_optimizer.OneReductionPerWindow`), the
    devices' values combined (``"sum"``: the one gradient reduction of the
    window; ``"max"``: their element-wise maximum). Only inside the update,
    so accumulate-only micro-steps reduce nothing across devices."""
    read = getattr(b, "read_window", None)
    return b.read(acc) if read is None else read(acc, combine)


def reset(b: Backend, state: WindowState, rows: Sequence[Any]) -> list:
    """Zero ``window_weight`` and the accumulators (only the touched rows
    where ``rows[i]`` is given, and their marks)."""
    zero = b.unfoldable_zero(state.micro_steps)
    done = [b.assign(state.window_weight, b.cast(zero, b.dtype(state.window_weight)))]
    for i, (acc, r) in enumerate(zip(state.acc_grads, rows)):
        tracker = state.rows_tracker(i)
        if r is None:
            done.append(b.assign(acc, b.fill_like(acc, zero)))
            if tracker is not None:
                done.append(b.assign(tracker, b.fill_like(tracker, zero)))
            continue
        done.append(b.scatter_update(acc, r, b.fill_rows_like(acc, r, zero)))
        done.append(b.scatter_update(tracker, r, b.fill_rows_like(tracker, r, zero)))
    return done


def restart_window(b: Backend, state: WindowState) -> list:
    """``grad_received = 0`` and ``mini_step = 0`` (cross-replica counters)."""
    return [
        b.assign(state.grad_received, b.zeros_like(state.grad_received)),
        b.assign(state.mini_step, b.zeros_like(state.mini_step)),
    ]


def discard_window(
    b: Backend, state: WindowState, sparse: Sequence[bool], replicas: Replicas, count_skipped: bool = True
) -> Any:
    """End a window without an update: zero the accumulators (in each
    replica), ``grad_received`` and ``mini_step``; with ``count_skipped``
    (``"skip_window"``) also clear the mark and ``skipped_windows += 1``.
    The inner optimizer is not called, so the weights, its slots,
    ``iterations``, schedules and EMA do not move."""
    dropped = replicas.each(zero_accumulators, b, state, sparse)
    with b.after(dropped):
        done = restart_window(b, state)
        if count_skipped:
            done += [
                b.assign(state.window_poisoned, b.zeros_like(state.window_poisoned)),
                increment(b, state.skipped_windows),
            ]
        return done


def zero_accumulators(b: Backend, state: WindowState, sparse: Sequence[bool]) -> list:
    """Zero the accumulators (the touched rows only where ``sparse[i]``)."""
    return reset(b, state, [b.touched(state.rows_tracker(i)) if s else None for i, s in enumerate(sparse)])


def skipped_micro_step(
    b: Backend, state: WindowState, rules: Rules, replicas: Replicas, sparse: Sequence[bool], weighted: bool
) -> Any:
    """A micro-step that is not finite: ``"skip_micro_step"``:
    ``skipped_micro_steps += 1``. ``"skip_window"``: also ``micro_steps`` and
    ``mini_step`` += 1 and the window is marked; if that closes the window,
    it is discarded (:func:`close_window`: its followers end their windows
    too)."""
    if rules.nonfinite == "skip_micro_step":
        return [increment(b, state.skipped_micro_steps)]
    closes = window_closes(b, state, rules)
    with b.after([closes]):
        skipped = [increment(b, state.skipped_micro_steps),
                   b.assign(state.window_poisoned, b.ones_like(state.window_poisoned))] + advance(b, state)
    with b.after(skipped):
        mask = [0] * len(state.acc_grads)
        return b.cond(closes, lambda: close_window(b, state, rules, replicas, sparse, mask, weighted), _noop)


def sparse_window(b: Backend, grad: Any, tracker: Any) -> bool:
    """Does the update hand the inner optimizer this variable's window over
    its touched rows (a trace-time decision)? Only for a variable with a row
    tracker, and then when its gradient on the closing micro-step is sparse
    or ``None`` (a variable that got its sparse gradients from another train
    op, in TF1 graph code, must still get the sparse window)."""
    return tracker is not None and (grad is None or b.is_sparse(grad))


# ---------------------------------------------------- outside a micro-step
def flush(b: Backend, state: WindowState, rules: Rules, *, replicas: Replicas = ONE_REPLICA) -> Any:
    """Apply the current, partial window now, if it holds a micro-step.

    What the closing micro-step does (:func:`close_window`), without a
    micro-step: normalised by what the window holds (``window_weight``,
    never N), every variable gated by ``grad_received``; then the window
    restarts. ``micro_steps`` does not move; the inner ``iterations`` does,
    by one. A no-op on an empty window (``mini_step == 0``). Called in
    cross-replica context under a strategy. ``rules.weighted`` ``None``
    counts as weighted.
    """
    check_state(state, rules)
    mask = [0] * len(state.acc_grads)
    sparse = [sparse_window(b, None, state.rows_tracker(i)) for i in range(len(state.acc_grads))]
    weighted = True if rules.weighted is None else rules.weighted
    return b.cond(
        b.greater(b.read(state.mini_step), 0),
        lambda: close_window(b, state, rules, replicas, sparse, mask, weighted),
        _noop,
    )


def pass_through(
    b: Backend, micro_steps: Any, grads: Sequence[Any], update: Callable[[list], Any], reduction: str,
    weight: Any = None,
) -> list:
    """N = 1 without a window: ``update(grads)`` (the inner optimizer's
    update with this micro-step's gradients) and ``micro_steps += 1``, both
    after the gradients. With a ``weight``, a window of one micro-step:
    ``c·g/c = g`` (``"mean"``) or ``c·g`` (``"sum"``), and a count of 0
    applies nothing."""
    with b.after(list(grads) + [weight]):
        if weight is None:
            applied = update(list(grads))
        else:
            if reduction == "sum":
                grads = [None if g is None else b.scale(g, weight) for g in grads]
            applied = b.cond(b.greater(weight, 0), lambda: update(list(grads)), _noop)
        return [applied, increment(b, micro_steps)]


def resume_position(
    b: Backend, state: WindowState, rules: Rules, *, replicas: Replicas = ONE_REPLICA, after: Sequence[Any] = ()
) -> Any:
    """If the window's position is unknown: ``mini_step = micro_steps % N``
    (0 under a schedule: no such checkpoint has one) and, in each replica,
    ``window_weight = mini_step`` (every micro-step of such a window counted
    1): what the window's position was before it had its own counter, so
    that a checkpoint saved without it resumes exactly. One scalar ``cond``;
    families whose checkpoints restore lazily or by name call it before
    every micro-step and flush.

    Unknown: ``mini_step`` is negative (:data:`UNKNOWN_POSITION`, the
    initial value of a family whose state may be restored after the first
    read), or 0 while ``grad_received`` marks a variable: no state the
    algorithm writes has that (every micro-step counts and marks together,
    closing a window zeroes both), but a checkpoint saved before
    ``mini_step`` existed, restored mid-window into a fresh state whose
    ``mini_step`` starts at 0 (TF1's ``Saver`` after the initializer), has.

    ``after``: what its writes wait for (a micro-step's :func:`guard`); its
    predicate waits for nothing, so where the position is known (every
    micro-step but the first after such a restore) the micro-step's own
    decision is not held back."""
    mini_step = state.mini_step

    def derive() -> Any:
        dtype = b.dtype(mini_step)
        if isinstance(rules.length, numbers.Integral):
            position = b.cast(b.floormod(b.read(state.micro_steps), int(rules.length)), dtype)
        else:
            position = b.constant(0, dtype)
        counted = replicas.each(_set_count, b, state.window_weight, position, list(after))
        with b.after(list(after)):
            return [b.assign(mini_step, position), counted]

    # Unknown iff mini_step < 1 where a variable is marked, < 0 otherwise.
    threshold = b.constant(0, b.dtype(mini_step))
    if state.grad_received is not None:
        threshold = b.cast(b.greater(b.reduce_max(b.read(state.grad_received)), 0), b.dtype(mini_step))
    return b.cond(b.less(b.read(mini_step), threshold), derive, _noop)


def _set_count(b: Backend, window_weight: Any, position: Any, after: Sequence[Any] = ()) -> Any:
    with b.after(list(after)):  # (here: a strategy's replicas do not inherit the caller's dependencies)
        return b.assign(window_weight, b.cast(position, b.dtype(window_weight)))


def check_state(state: WindowState, rules: Rules) -> None:
    """Raise ``ValueError`` if ``state`` lacks a variable ``rules`` need."""
    missing = [name for name in rules.needs() if getattr(state, name) is None]
    if missing:
        raise ValueError(f"{rules} need WindowState fields {missing}; the family did not supply them.")
