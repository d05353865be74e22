"""The window's variables as data: which a family makes, in which order,
and in which order it saves them.

What users' checkpoints depend on. A family's optimizer saves its variables
as one list (Keras' ``save_own_variables``/``get_weights``, an ``.h5``
file), in blocks:

* ``"own"``: the wrapper's own variables that every version saved
  (``micro_steps``, ``grad_received``, the accumulators, and for some
  families their row trackers and skip counters);
* ``"inner"``: the inner optimizer's variables, in its order;
* the *optional trailing* blocks, which later versions or other settings
  added at the end, so that state saved without them is a prefix:
  ``"nonfinite"`` (the skip counters of a skipping policy), ``"window"``
  (``mini_step`` and ``window_weight``, the window's position and count),
  ``"trackers"`` (the row trackers).

:data:`LAYOUTS` is each family's order, once; :func:`ordered` lists a
wrapper's variables by it and :func:`fitting` finds which layout saved
arrays were written in (today's, or an older one without some optional
blocks). :data:`BUILDS` says how each family makes the window's variables
(its history, as data) and :func:`window_specs` lists them, in the order
every family's ``build`` makes them through its own variable factory. The TF1 family saves by name (``tf.train.Saver``,
``tf.train.Checkpoint``), not by position, so it has no entry. Nothing here
imports a framework: a "variable" is anything with ``shape`` and ``dtype``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Layout:
    """One family's saved order: ``blocks`` by name, first to last; the
    ``optional`` ones (a suffix of ``blocks``) may be absent from a save."""

    blocks: tuple
    optional: tuple

    def __post_init__(self) -> None:
        if self.blocks[len(self.blocks) - len(self.optional):] != self.optional:
            raise ValueError(f"optional blocks {self.optional} must be the trailing blocks of {self.blocks}")


LAYOUTS: Mapping[str, Layout] = {
    # Keras 3: skip counters, window and trackers each came after the inner
    # optimizer's variables (0.1.0 saved own + inner).
    "keras3": Layout(("own", "inner", "nonfinite", "window", "trackers"), ("nonfinite", "window", "trackers")),
    # Keras 2 new API: skip counters among its own; the window came later.
    "keras2": Layout(("own", "inner", "window"), ("window",)),
    # Legacy OptimizerV2: row trackers and skip counters among its own.
    "legacy": Layout(("own", "inner", "window"), ("window",)),
}
"""Each family's saved order (the TF1 family saves by name)."""


def ordered(layout: Layout, blocks: Mapping[str, Sequence[Any]]) -> list:
    """The variables of ``blocks`` (``{name: variables}``, every block of
    ``layout``) in ``layout``'s order."""
    return [v for name in layout.blocks for v in blocks[name]]


def fitting(layout: Layout, blocks: Mapping[str, Sequence[Any]], saved: Sequence[Any]) -> list:
    """The variables that the ``saved`` arrays fill, in order: all of
    ``blocks`` in ``layout``'s order, or the layout of a save by an older
    version or another configuration, without some of the optional blocks.

    Of the layouts of the right length, the first (keeping the most blocks
    first) whose variables match the arrays in shape and in dtype kind
    (integer counters, float values); the first of the right length if none
    matches (the caller's shape check then names the culprit); all of
    ``blocks`` if none has the right length (the caller raises)."""
    import numpy as np

    required = [v for name in layout.blocks if name not in layout.optional for v in blocks[name]]
    layouts = []
    for keep in itertools.product((True, False), repeat=len(layout.optional)):
        candidate = required + [v for k, name in zip(keep, layout.optional) if k for v in blocks[name]]
        if len(candidate) == len(saved):
            layouts.append(candidate)

    def fits(candidate: list) -> bool:
        for v, value in zip(candidate, saved):
            value = np.asarray(value)
            if tuple(v.shape) != value.shape or _is_float(v.dtype) != _is_float(value.dtype):
                return False
        return True

    matching = [candidate for candidate in layouts if fits(candidate)]
    return matching[0] if matching else (layouts[0] if layouts else ordered(layout, blocks))


def _is_float(dtype: Any) -> bool:
    """A float dtype (TF's ``DType``, Keras' name, NumPy's, bfloat16 too)?"""
    return "float" in (getattr(dtype, "name", None) or str(dtype))


# ------------------------------------------------------------------ build
@dataclasses.dataclass(frozen=True)
class Spec:
    """One variable of the window, as a family's ``build`` makes it.

    Attributes:
        name: ``"micro_steps"``, ``"grad_received"``, ``"acc_grad"``,
            ``"touched_rows"``, a skip counter, ``"updates"``, ``"mini_step"``
            or ``"window_weight"``.
        shape: ``()`` for scalars; ``(n,)`` for ``grad_received`` (n
            trainable variables); the variable's shape for ``acc_grad``, its
            first axis for ``touched_rows``.
        dtype: ``"int64"``, ``"float32"``, the tracker dtype, or ``None``: the
            accumulator dtype of the variable at ``index``.
        replica_local: one value per replica, summed on read (``ON_READ``:
            accumulators, trackers, ``window_weight``); else one value for
            all replicas (the counters).
        block: the block of :data:`LAYOUTS` it is saved in.
        index: the trainable variable's position in build order
            (``acc_grad``, ``touched_rows``), else ``None``.
        initial: a counter's initial value.
    """

    name: str
    shape: tuple
    dtype: str | None
    replica_local: bool
    block: str
    index: int | None = None
    initial: int = 0


@dataclasses.dataclass(frozen=True)
class Build:
    """How a family makes the window's variables.

    Attributes:
        micro_steps: ``build`` makes ``micro_steps`` (Keras 3 makes it at
            construction, as Keras makes ``iterations``).
        trackers: which variables get a row tracker: ``"rank"`` (every
            variable of rank >= 1), ``"sparse"`` (those the caller names:
            TF1's ``sparse_var_list``) or ``"none"``.
        tracker_dtype: the trackers' dtype.
        tracker_block: the block the trackers are saved in.
        counters_block: the block the skip counters are saved in.
        counters_last: the counters are made after the window's position
            (else before it).
        unknown_start: ``mini_step`` starts at ``UNKNOWN_POSITION`` (a family
            whose state may be restored after the first read: the core
            derives the position, :func:`accum_optimizer.core.resume_position`).
    """

    micro_steps: bool = True
    trackers: str = "rank"
    tracker_dtype: str = "float16"
    tracker_block: str = "own"
    counters_block: str = "own"
    counters_last: bool = False
    unknown_start: bool = False


BUILDS: Mapping[str, Build] = {
    "keras3": Build(micro_steps=False, tracker_block="trackers", counters_block="nonfinite"),
    "keras2": Build(trackers="none", unknown_start=True),
    "legacy": Build(unknown_start=True),
    # Saved by name; its trackers are int8 (TF1 graphs restore no ON_READ sums).
    "tf1": Build(trackers="sparse", tracker_dtype="int8", counters_last=True),
}
"""How each family makes the window's variables."""


def window_specs(build: Build, shapes: Sequence[tuple], counters: Sequence[str], accumulates: bool = True,
                 sparse: frozenset = frozenset()) -> list:
    """The :class:`Spec` of every variable of the window, in the order the
    family makes them: ``micro_steps`` (where ``build`` makes it); then,
    accumulating, ``grad_received``, one accumulator per variable (``shapes``,
    build order), the row trackers, the skip ``counters`` and the window's
    position and count (the counters after those where
    ``build.counters_last``). ``sparse``: the positions of the variables
    with a tracker under ``trackers="sparse"``."""
    from accum_optimizer.core.window import UNKNOWN_POSITION

    specs = [Spec("micro_steps", (), "int64", False, "own")] if build.micro_steps else []
    if not accumulates:
        return specs
    specs.append(Spec("grad_received", (len(shapes),), "int64", False, "own"))
    specs += [Spec("acc_grad", tuple(shape), None, True, "own", i) for i, shape in enumerate(shapes)]
    tracked = {
        "rank": [i for i, shape in enumerate(shapes) if len(shape)],
        "sparse": [i for i in sorted(sparse) if len(shapes[i])],
        "none": [],
    }[build.trackers]
    specs += [Spec("touched_rows", tuple(shapes[i][:1]), build.tracker_dtype, True, build.tracker_block, i)
              for i in tracked]
    counter_specs = [Spec(name, (), "int64", False, build.counters_block) for name in counters]
    window = [
        Spec("mini_step", (), "int64", False, "window", initial=UNKNOWN_POSITION if build.unknown_start else 0),
        Spec("window_weight", (), "float32", True, "window"),
    ]
    return specs + (window + counter_specs if build.counters_last else counter_specs + window)


def collect(specs: Sequence[Spec], made: Sequence[Any], count: int) -> dict:
    """What a family's ``build`` made (``made[i]`` for ``specs[i]``), by
    name: ``acc_grad`` and ``touched_rows`` as lists over the ``count``
    variables in build order (``None`` where a variable has no tracker),
    the others as the variable; and ``"blocks"``: the variables of each
    block, in the order made."""
    state: dict = {"acc_grad": [None] * count, "touched_rows": [None] * count, "blocks": {}}
    for spec, variable in zip(specs, made):
        if spec.index is not None:
            state[spec.name][spec.index] = variable
        else:
            state[spec.name] = variable
        state["blocks"].setdefault(spec.block, []).append(variable)
    return state
