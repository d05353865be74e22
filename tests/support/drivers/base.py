"""Per-family drivers of the contract tests (``tests/contract/``).

A contract test states one property every family must have and is written
once; a driver tells it how a family does each step it needs:

* the family's optimizers (:class:`Case` lists: every optimizer class, the
  clipping / weight-decay options, learning-rate schedules, EMA, ...) with the
  setting its tests have always used (``N``, ``B``, updates, model, how far
  training must move the weights);
* :meth:`Driver.pair`: the batch-N·B reference and the accumulating run of a
  case, with the weights and every variable of the inner optimizer after
  every update (a :class:`Run`);
* :meth:`Driver.trainer`: one seeded model with an inner optimizer, plain or
  wrapped, and a micro-step on a batch (``weight=`` optional), ``flush``,
  the model's weights, the inner optimizer's state, the counters, save and
  restore in the family's own formats;
* :meth:`Driver.vectors`: hand-computed checks on a few variables with given
  gradients.

One driver class per family, each in its own module of this package:
:class:`~support.drivers.keras3.Keras3Driver` (Keras 3 on TensorFlow),
:class:`~support.drivers.keras2.Keras2Driver` (Keras 2's new optimizer API),
:class:`~support.drivers.legacy.LegacyDriver` (Keras 2's legacy
``OptimizerV2``) and its subclass
:class:`~support.drivers.legacy.TfaDriver` (tensorflow-addons, ``"tfa"``), all
on :class:`~support.drivers.keras.KerasDriver` (what the Keras families share:
the runs, trainers and hand-computed checks); and
:class:`~support.drivers.tf1.TF1Driver` (``tf.compat.v1.train.Optimizer``,
graph code run in a ``tf.compat.v1.Session``). A family's differences are its
class's attributes and overridden methods. This module holds what every
driver shares: :class:`Case`, :class:`Run`, :class:`Inner`,
:class:`Driver`, :func:`driver`, :func:`params` and
:func:`assert_matches_large_batch`.

:func:`params` turns a per-family list of cases into ``pytest.param``\\ s,
one skipped parameter (with the reason) for a family this leg lacks, or
whose framework has no such thing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import pytest
import tensorflow as tf

from support import families
from support.arrays import max_abs_diff, trajectory_diff

#: The families of the contract tests; "tfa" (tensorflow-addons on the legacy
#: family) joins where its optimizers have the property.
FAMILIES = ("keras3", "keras2", "legacy", "tf1")
TOL = 1e-5
#: The counters of the non-finite skipping policies (where the wrapper keeps them).
SKIP_COUNTERS = ("skipped_micro_steps", "skipped_windows")

# The missing-gradient pattern: which micro-steps of each window (N = 4) use
# branch b of ``y = a(x) + b(x)``. Window 0: never (b must not move: no
# update, no weight decay, no constraint, no EMA); window 1: only the first
# micro-step; window 2: all but the last (a wrapper that drops the window when
# the last gradient is None loses this sum); window 3: all; window 4: never
# again, now that b, its slots and its EMA shadow are away from their initial
# values (slot decay, weight decay and an EMA step would all show).
PATTERN = [[False] * 4, [True, False, False, False], [True, True, True, False], [True] * 4, [False] * 4]
MISSING_N, MISSING_MB = 4, 2


# ------------------------------------------------------------- parameters
@dataclasses.dataclass(frozen=True)
class Case:
    """One optimizer setting of a family. ``make_inner`` takes the model
    (Keras families: tfa's MultiOptimizer needs its layers) or the graph's
    global step (TF1: AdagradDA and schedules need it)."""

    name: str
    make_inner: Callable[[Any], Any]
    mode: str | None = None  # the driver's default
    dtype: str = "float32"
    reduction: str = "mean"
    updates: int | None = None  # the driver's default
    tol: float = TOL
    expected_lr: float | None = None  # hand-derived current learning rate after the run
    variant: str | None = None

    def __str__(self) -> str:
        return self.name


class NotApplicable(str):
    """A driver's answer for a property its framework does not have: the reason."""


def params(families_, cases: Callable[["Driver"], Any] | None = None) -> list:
    """``pytest.param(family, case)`` for each family and each of its cases
    (``cases(driver)``: a list, or a :class:`NotApplicable` reason); a family
    this leg lacks, or one without the property, is one skipped parameter
    with the reason. Each parameter carries its family's marker (``-m tf1``,
    ``--leave-out tf1``)."""
    out = []
    for family in families_:
        marks = [getattr(pytest.mark, family)]
        reason = families.skip_reason(family)
        if reason is None and cases is not None:
            found = cases(driver(family))
            if isinstance(found, NotApplicable):
                reason = f"{family}: {found}"
        if reason is not None:
            out.append(pytest.param(family, None, id=family, marks=marks + [pytest.mark.skip(reason=reason)]))
        elif cases is None:
            out.append(pytest.param(family, None, id=family, marks=marks))
        else:
            out.extend(pytest.param(family, c, id=family if c is None else f"{family}-{c}", marks=marks)
                       for c in found)
    return out


#: The module and class of each family's driver.
_DRIVERS = {"keras3": ("keras3", "Keras3Driver"), "keras2": ("keras2", "Keras2Driver"),
            "legacy": ("legacy", "LegacyDriver"), "tfa": ("legacy", "TfaDriver"), "tf1": ("tf1", "TF1Driver")}


@functools.cache
def driver(family: str) -> "Driver":
    """The family's driver (one instance per family); its module is imported
    on first use, so a leg without the framework never imports it."""
    module, name = _DRIVERS[family]
    return getattr(importlib.import_module(f"support.drivers.{module}"), name)()


# ------------------------------------------------------------------ runs
@dataclasses.dataclass
class Run:
    """One training run: ``trajectory`` holds, after every update, the
    model's weights (the first ``n_weights`` arrays) followed by every
    variable of the inner optimizer (``state_names``); counters and, where the
    inner keeps them, the current learning rate and the EMA shadows."""

    trajectory: list
    initial: list
    n_weights: int
    state_names: list
    iterations: int
    micro_steps: int | None
    learning_rate: float | None = None
    ema: list | None = None
    objects: dict = dataclasses.field(default_factory=dict)

    @property
    def weights(self) -> list:
        return self.trajectory[-1][: self.n_weights]

    @property
    def state(self) -> list:
        return self.trajectory[-1][self.n_weights:]


@dataclasses.dataclass(frozen=True)
class Inner:
    """An inner optimizer by kind, for the trainers: ``"sgd"`` (``momentum``),
    ``"adam"``, ``"adam_ema"`` (Keras' ``use_ema``), ``"rmsprop"``
    (``momentum``, ``centered``), ``"adamw_ema"`` (the "rich" inner: AdamW, a
    cosine schedule with warmup and EMA). ``str()`` is the test id."""

    kind: str
    lr: float = 0.1
    momentum: float = 0.0
    centered: bool = False

    def __str__(self) -> str:
        extra = f",momentum={self.momentum}" if self.momentum else ""
        return f"{self.kind}({self.lr}{extra})"


class Driver:
    """What a contract test may ask of a family (see the module docstring);
    each family's subclass answers."""

    family: str
    #: The keyword arguments of the family's AccumulatingOptimizer (its public
    #: API: one signature for every family; a family without the non-finite
    #: policies or wider accumulators takes their defaults only).
    ARGUMENTS = ("inner_optimizer", "gradient_accumulation_steps", "reduction", "name", "nonfinite",
                 "accumulator_dtype")
    N: int
    B: int
    UPDATES: int
    MOVED: float  # how far the reference must move the weights in an equivalence run
    MODE: str  # the default way the steps run
    #: The inner optimizer of the between-updates check: one with a lot of state.
    RICH_INNER: "Inner"
    #: Whether an update moves every variable of RICH_INNER (TF1's Adam: every
    #: slot, both beta powers and global_step).
    ALL_STATE_MOVES_ON_UPDATE = False
    #: Arguments of the framework's optimizer base class refused on the wrapper
    #: (Keras 3 and Keras 2's new API); ``None``: the wrapper takes only its own.
    BASE_ARGUMENTS: tuple | None = None

    def between_updates_modes(self) -> list:
        return [self.MODE]


def assert_matches_large_batch(family, case, ref, acc):
    """What every large-batch comparison of the contract tests asserts: the
    counters, that training moved the weights, the trajectory (weights and
    inner state after every update), the EMA shadows and the current
    learning rate where the family has them."""
    d = driver(family)
    updates = case.updates or d.UPDATES
    assert acc.iterations == ref.iterations == updates
    assert acc.micro_steps == d.N * updates
    # Training moved the weights, so the comparison is not vacuous.
    assert max_abs_diff(ref.weights, ref.initial) > d.MOVED
    assert [a.shape for a in ref.trajectory[-1]] == [a.shape for a in acc.trajectory[-1]]
    worst = trajectory_diff(ref.trajectory, acc.trajectory)
    # The README's figures (run with -s).
    print(f"[{family} TF {tf.__version__}] {case} {case.mode or d.MODE} {case.dtype} {case.reduction}: "
          f"max|dw| {max_abs_diff(ref.weights, acc.weights):.2e}, max|dstate| {max_abs_diff(ref.state, acc.state):.2e}, "
          f"max over the trajectory {worst:.2e}")
    assert worst <= case.tol
    if ref.ema is not None or acc.ema is not None:
        # The EMA shadows are part of the state compared above; by name too,
        # so a missing shadow cannot pass.
        assert len(acc.ema) == len(ref.ema) == len(acc.objects["model"].trainable_variables)
        assert max_abs_diff(ref.ema, acc.ema) <= case.tol
    if ref.learning_rate is not None:
        # The same current rate as the reference: the schedule saw the updates.
        assert acc.learning_rate == pytest.approx(ref.learning_rate, rel=1e-6)
    if case.expected_lr is not None:
        assert acc.learning_rate == pytest.approx(case.expected_lr, rel=1e-6)
