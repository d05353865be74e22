"""The saved layout: in which order each family saves the window's state.

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
blocks). The TF1 family saves by name (``tf.train.Saver``,
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
