"""The accumulation window, once, for every optimizer family and framework.

* :mod:`~accum_optimizer.core.state`: the records: :class:`WindowState` (the
  window's variables), :class:`Rules` (N or its schedule, reduction,
  non-finite policy, weighting), :class:`Replicas` (how replicas are
  reached), and the :class:`Backend` protocol a family supplies.
* :mod:`~accum_optimizer.core.window`: the algorithm: :func:`micro_step`,
  :func:`close_window`, :func:`flush`, :func:`pass_through`,
  :func:`resume_position`, :func:`window_length`.
* :mod:`~accum_optimizer.core.layout`: the window's variables as data: each
  family's saved order and build order.

Nothing here imports a framework: a new family or backend supplies a
:class:`Backend` (``accum_optimizer/families/_tf_backend.py`` is TensorFlow's).
"""

from accum_optimizer.core.state import (
    COMBINES,
    NONFINITE_POLICIES,
    ONE_REPLICA,
    REDUCTIONS,
    Backend,
    Replicas,
    Rules,
    WindowState,
    skip_counters,
)
from accum_optimizer.core.window import (
    UNKNOWN_POSITION,
    close_window,
    flush,
    guard,
    micro_step,
    pass_through,
    resume_position,
    window_length,
)

__all__ = [
    "COMBINES",
    "NONFINITE_POLICIES",
    "ONE_REPLICA",
    "REDUCTIONS",
    "UNKNOWN_POSITION",
    "Backend",
    "Replicas",
    "Rules",
    "WindowState",
    "close_window",
    "skip_counters",
    "flush",
    "guard",
    "micro_step",
    "pass_through",
    "resume_position",
    "window_length",
]
