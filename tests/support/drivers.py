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

Keras 3 on TensorFlow, Keras 2's new optimizer API and Keras 2's legacy
``OptimizerV2`` (with tensorflow-addons, ``"tfa"``) share :class:`KerasDriver`;
the TF1 family (``tf.compat.v1.train.Optimizer``, graph code run in a
``tf.compat.v1.Session``) has :class:`TF1Driver`.

:func:`params` turns a per-family list of cases into ``pytest.param``\\ s,
one skipped parameter (with the reason) for a family this leg lacks, or
whose framework has no such thing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import numpy as np
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


@functools.cache
def driver(family: str) -> "Driver":
    return TF1Driver() if family == "tf1" else KerasDriver(family)


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
    :class:`KerasDriver` and :class:`TF1Driver` answer."""

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


# ===================================================================== Keras
class KerasDriver(Driver):
    """Keras 3 on TF (``keras3``), Keras 2's new API (``keras2``), Keras 2's
    legacy ``OptimizerV2`` (``legacy``) and tensorflow-addons (``tfa``)."""

    MODE = "graph"

    def __init__(self, family: str):
        from support import reference as R

        self.family = family
        # Legacy: centered RMSprop with momentum (three slots, hyperparameter
        # variables); Keras: AdamW, a cosine schedule with warmup and EMA.
        self.RICH_INNER = (Inner("rmsprop", 0.01, momentum=0.5, centered=True) if family in ("legacy", "tfa")
                           else Inner("adamw_ema", 1e-2))
        self.R = R
        self.keras = R.keras
        self.legacy = family in ("legacy", "tfa")
        if family == "keras3":
            self.N, self.B, self.UPDATES, self.MOVED = 4, 3, 4, 1e-4
        elif family == "keras2":
            self.N, self.B, self.UPDATES, self.MOVED = 3, 4, 4, 1e-3
        else:  # legacy and tfa: the dense model of support.reference (5 -> 4 tanh -> 3)
            self.N, self.B, self.UPDATES, self.MOVED = 3, 2, 3, 1e-3

    @property
    def optimizers(self):
        """The family's optimizer classes: ``keras.optimizers`` (Keras 3),
        ``tf.keras.optimizers`` (Keras 2) or ``tf.keras.optimizers.legacy``."""
        o = self.keras.optimizers
        return o.legacy if self.legacy else o

    # ----------------------------------------------------------- cases
    def equivalence_cases(self) -> list:
        """Every optimizer class of the family, and clipping and weight decay
        (the schedules and EMA have their own tests)."""
        o = self.optimizers
        if self.family == "keras3":
            cases = {
                "sgd": lambda m: o.SGD(0.1),
                "sgd_momentum": lambda m: o.SGD(0.1, momentum=0.9),
                "sgd_nesterov": lambda m: o.SGD(0.1, momentum=0.9, nesterov=True),
                "adam": lambda m: o.Adam(1e-2),
                "adam_amsgrad": lambda m: o.Adam(1e-2, amsgrad=True),
                "adamw": lambda m: o.AdamW(1e-2, weight_decay=0.05),
                "adamax": lambda m: o.Adamax(1e-2),
                "adagrad": lambda m: o.Adagrad(5e-2),
                "adadelta": lambda m: o.Adadelta(1.0),
                "rmsprop": lambda m: o.RMSprop(1e-2),
                "rmsprop_centered": lambda m: o.RMSprop(1e-2, centered=True, momentum=0.5),
                "nadam": lambda m: o.Nadam(1e-2),
                "ftrl": lambda m: o.Ftrl(5e-2, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
                "lion": lambda m: o.Lion(1e-3),
                "lamb": lambda m: o.Lamb(1e-2),
                "adafactor": lambda m: o.Adafactor(1e-2),
                "schedule_free_adamw": lambda m: o.ScheduleFreeAdamW(1e-2),
                "multi_optimizer": lambda m: o.MultiOptimizer(
                    lambda v: o.Adam(1e-2) if "kernel" in v.path else o.SGD(0.1, momentum=0.9)
                ),
                # options
                "clipnorm": lambda m: o.Adam(1e-2, clipnorm=0.05),
                "global_clipnorm": lambda m: o.Adam(1e-2, global_clipnorm=0.05),
                "clipvalue": lambda m: o.SGD(0.1, clipvalue=0.01),
                "weight_decay_sgd": lambda m: o.SGD(0.1, momentum=0.9, weight_decay=0.1),
                "weight_decay_adam": lambda m: o.Adam(1e-2, weight_decay=0.1),
            }
            if hasattr(o, "Muon"):
                cases["muon"] = lambda m: o.Muon(1e-2)
        elif self.family == "keras2":
            cases = {name: (lambda f: lambda m: f())(f) for name, f in self.R.optimizer_cases().items()}
            cases.update({
                "clipnorm": lambda m: o.Adam(1e-2, clipnorm=0.05),
                "global_clipnorm": lambda m: o.Adam(1e-2, global_clipnorm=0.05),
                "clipvalue": lambda m: o.SGD(0.1, clipvalue=0.01),
                "weight_decay_sgd": lambda m: o.SGD(0.1, momentum=0.9, weight_decay=0.1),
            })
        elif self.family == "legacy":
            cases = dict(self._legacy_classes())
            cases.update({
                "clipnorm": lambda m: o.Adam(0.05, clipnorm=0.05),
                "global_clipnorm": lambda m: o.Adam(0.05, global_clipnorm=0.05),
                "clipvalue": lambda m: o.Adam(0.05, clipvalue=0.01),
            })
        else:  # tfa
            T = _tfa().optimizers

            def multi(model):  # one optimizer per layer: Adam on the first, momentum SGD on the second
                return T.MultiOptimizer([(o.Adam(0.05), model.layers[0]), (o.SGD(0.1, momentum=0.9), model.layers[1])])

            cases = {
                "AdamW": lambda m: T.AdamW(weight_decay=0.05, learning_rate=0.05),
                "SGDW": lambda m: T.SGDW(weight_decay=0.05, learning_rate=0.1, momentum=0.9),
                "LAMB": lambda m: T.LAMB(0.05, weight_decay=0.01),
                "LazyAdam": lambda m: T.LazyAdam(0.05),
                "NovoGrad": lambda m: T.NovoGrad(0.05, weight_decay=0.01),
                "Yogi": lambda m: T.Yogi(0.05),
                "AdaBelief": lambda m: T.AdaBelief(0.05),
                "ProximalAdagrad": lambda m: T.ProximalAdagrad(0.1, l1_regularization_strength=0.01,
                                                               l2_regularization_strength=0.01),
                "ConditionalGradient": lambda m: T.ConditionalGradient(0.1, lambda_=0.1),
                "COCOB": lambda m: T.COCOB(),
                "Lookahead": lambda m: T.Lookahead(o.Adam(0.05), sync_period=2, slow_step_size=0.5),
                "MultiOptimizer": multi,
                "AdamW(clipnorm)": lambda m: T.AdamW(weight_decay=0.05, learning_rate=0.05, clipnorm=0.05),
            }
        return [Case(name, make) for name, make in sorted(cases.items())]

    def _legacy_classes(self) -> dict:
        """Every legacy ``OptimizerV2`` class, with the variants the legacy
        issue names."""
        L = self.optimizers
        return {
            "SGD": lambda m: L.SGD(0.1),
            "SGD(momentum)": lambda m: L.SGD(0.1, momentum=0.9),
            "SGD(nesterov)": lambda m: L.SGD(0.1, momentum=0.9, nesterov=True),
            "Adam": lambda m: L.Adam(0.05),
            "Adam(amsgrad)": lambda m: L.Adam(0.05, amsgrad=True),
            "Adamax": lambda m: L.Adamax(0.05),
            "Adagrad": lambda m: L.Adagrad(0.1),
            "Adadelta": lambda m: L.Adadelta(1.0),
            "RMSprop": lambda m: L.RMSprop(0.01),
            "RMSprop(centered,momentum)": lambda m: L.RMSprop(0.01, momentum=0.5, centered=True),
            "Nadam": lambda m: L.Nadam(0.05),
            "Ftrl": lambda m: L.Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
        }

    def mode_cases(self):
        """Eagerly (both runs): the optimizers whose eager and traced
        arithmetic differ the most (fused kernels vs composite ops, Nadam's
        Python-side momentum cache), and one plain case."""
        if self.family == "keras3":
            return NotApplicable("Keras 3 runs the same code eagerly; keras3/test_equivalence_property.py's "
                                 "test trains eagerly and keras3/test_xla.py compiles with XLA")
        if self.family == "tfa":
            return NotApplicable("tensorflow-addons optimizers are traced only, as before the reshape")
        if self.family == "keras2":
            names = ["sgd_momentum", "adam", "nadam", "adafactor"]
        else:
            names = ["SGD(momentum)", "Adam(amsgrad)", "Nadam", "Ftrl"]
        by_name = {c.name: c for c in self.equivalence_cases()}
        return [dataclasses.replace(by_name[n], name=f"{n}-eager", mode="eager") for n in names]

    def float64_cases(self):
        o = self.optimizers
        if self.family == "keras3":
            by_name = {c.name: c for c in self.equivalence_cases()}
            names = ["sgd_momentum", "adam", "adamw", "rmsprop_centered", "nadam", "lamb", "adafactor"]
            return [dataclasses.replace(by_name[n], dtype="float64", updates=3, tol=1e-12) for n in names]
        if self.family == "keras2":
            by_name = {c.name: c for c in self.equivalence_cases()}
            return [dataclasses.replace(by_name[n], dtype="float64", tol=1e-12) for n in ("adam", "adafactor")]
        if self.family == "legacy":
            return [Case("RMSprop(centered,momentum)", lambda m: o.RMSprop(0.01, momentum=0.5, centered=True),
                         dtype="float64", tol=1e-12)]
        return NotApplicable("tensorflow-addons optimizers are compared in float32 only, as before the reshape")

    def sum_cases(self):
        o = self.optimizers
        if self.family == "keras3":
            return [Case("sgd_momentum", lambda m: o.SGD(0.02, momentum=0.9), reduction="sum", updates=3)]
        if self.family == "keras2":
            return [Case("adam", lambda m: o.Adam(1e-2), reduction="sum")]
        if self.family == "legacy":
            return [Case("Adam", lambda m: o.Adam(0.05), reduction="sum")]
        return NotApplicable("tensorflow-addons: the legacy cell proves reduction='sum' for OptimizerV2")

    def schedule_cases(self):
        """Learning-rate schedules, whose boundaries and decay lengths are in
        updates: the windows trained cross them, so a schedule fed
        micro-steps gives other rates."""
        o = self.optimizers
        schedules = self.keras.optimizers.schedules
        if self.family == "keras3":
            cases = [
                Case("piecewise_constant", lambda m: o.Adam(schedules.PiecewiseConstantDecay([1, 2], [1e-2, 3e-2, 1e-3]))),
                Case("exponential_decay", lambda m: o.SGD(
                    schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True))),
                Case("cosine_warmup", lambda m: o.AdamW(
                    schedules.CosineDecay(0.0, decay_steps=3, warmup_target=2e-2, warmup_steps=2),
                    weight_decay=0.05, use_ema=True)),
            ]
        elif self.family == "keras2":
            cases = [
                Case("piecewise_constant", lambda m: o.Adam(schedules.PiecewiseConstantDecay([1, 2], [1e-2, 3e-2, 1e-3]))),
                Case("cosine_warmup_adamw_ema", lambda m: o.AdamW(
                    schedules.CosineDecay(0.0, decay_steps=3, warmup_target=2e-2, warmup_steps=2),
                    weight_decay=0.05, use_ema=True)),
                # Hand-derived: ExponentialDecay(0.2, 1, 0.3, staircase) at update k is
                # 0.2 * 0.3**k; the current learning rate the inner optimizer holds after
                # the last update was computed at iterations = UPDATES - 1. Fed
                # micro-steps, it would be 0.2 * 0.3**(N * UPDATES - 1).
                Case("exponential_decay-eager", lambda m: o.SGD(
                    schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True)),
                    mode="eager", expected_lr=0.2 * 0.3 ** (self.UPDATES - 1)),
            ]
        elif self.family == "legacy":
            cases = [
                Case("ExponentialDecay", lambda m: o.Adam(schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))),
                Case("PiecewiseConstantDecay", lambda m: o.SGD(schedules.PiecewiseConstantDecay([1, 2], [0.3, 0.03, 0.003]))),
                Case("CosineDecay(warmup)", lambda m: o.SGD(
                    schedules.CosineDecay(0.0, decay_steps=2, warmup_target=0.2, warmup_steps=2), momentum=0.9)),
                Case("decay=", lambda m: o.SGD(0.2, decay=1.0)),  # lr / (1 + decay * iterations)
            ]
        else:  # tfa
            T = _tfa().optimizers
            cases = [
                Case("CyclicalLearningRate", lambda m: o.SGD(
                    T.CyclicalLearningRate(0.01, 0.3, step_size=1, scale_fn=lambda x: 1.0))),
                # RAdam's rectified branch starts once the SMA length exceeds 4
                # (update 5 with beta_2=0.999), and its warmup counts iterations.
                Case("RectifiedAdam(warmup, 6 updates)", lambda m: T.RectifiedAdam(
                    0.05, total_steps=6, warmup_proportion=0.5, min_lr=0.01), updates=6),
            ]
        return cases

    def fast_schedule_pair(self):
        """A schedule and the same schedule stepped N times faster (what a
        wrapper that fed it micro-steps would apply)."""
        o, s = self.optimizers, self.keras.optimizers.schedules
        if self.family == "keras3":
            # Keras 3's ExponentialDecay takes a float number of steps too.
            return (Case("exponential_decay", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))),
                    Case("fast", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1 / self.N, decay_rate=0.5))))
        if self.family in ("keras2", "legacy"):
            return (Case("ExponentialDecay", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))),
                    Case("fast", lambda m: o.Adam(s.ExponentialDecay(0.1, decay_steps=1 / self.N, decay_rate=0.5))))
        # tfa's wrappers count iterations too: Lookahead syncing every update
        # stands in for one that synced at micro-step counts.
        T = _tfa().optimizers
        return (Case("Lookahead", lambda m: T.Lookahead(o.Adam(0.05), sync_period=2, slow_step_size=0.5)),
                Case("fast", lambda m: T.Lookahead(o.Adam(0.05), sync_period=1, slow_step_size=0.5)))

    def ema_cases(self):
        o = self.optimizers
        if self.family == "keras3":
            return [
                Case("ema", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.9)),
                Case("ema_overwrite", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)),
            ]
        if self.family == "keras2":
            return [Case("ema_overwrite", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.5,
                                                           ema_overwrite_frequency=2))]
        if self.family == "legacy":
            return NotApplicable("Keras 2's legacy OptimizerV2 has no use_ema (tensorflow-addons' "
                                 "MovingAverage and SWA are the tfa cells)")
        T = _tfa().optimizers
        return [
            Case("MovingAverage", lambda m: T.MovingAverage(o.SGD(0.1), average_decay=0.9, dynamic_decay=True)),
            Case("SWA", lambda m: T.SWA(o.SGD(0.1), start_averaging=1, average_period=2)),
        ]

    # ----------------------------------------------------------- runs
    def pair_model(self, dtype="float32", seed=0):
        """The model of the large-batch comparisons (:meth:`pair`)."""
        if self.legacy:
            return self.R.dense_model(seed, dtype=dtype)
        return self.R.make_mlp(seed, dtype=dtype)

    def pair_data(self, n, dtype="float32"):
        if self.legacy:
            return self.R.dense_data(n, dtype=np.dtype(dtype).type)
        return self.R.make_data(n, dtype=dtype)

    def data(self, n):
        """Samples for the trainers' model (``make_mlp``: 6 -> 3)."""
        return self.R.make_data(n)

    def inner_state(self, inner) -> tuple[list, list]:
        """``(names, arrays)`` of every variable of a plain optimizer: Keras
        3's ``variables``; for Keras 2 also the variables held as attributes
        (learning rate, a schedule's current rate, Nadam's ``_u_product``);
        legacy ``weights`` (``iterations``, slots, tfa's averages)."""
        if self.family == "keras3":
            vs = list(inner.variables)
            return [v.path for v in vs], [np.array(v.numpy()) for v in vs]
        if self.family == "keras2":
            found, seen = [], set()
            for v in list(inner.variables) + [
                w for name in sorted(vars(inner))
                for w in (vars(inner)[name] if isinstance(vars(inner)[name], (list, tuple)) else [vars(inner)[name]])
            ]:
                if isinstance(v, tf.Variable) and id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
            return [v.name for v in found], [np.array(v.numpy()) for v in found]
        vs = list(inner.weights)
        return [v.name for v in vs], [np.array(v.numpy()) for v in vs]

    def ema_shadows(self, inner, model) -> list | None:
        if self.family in ("keras3", "keras2"):
            if not getattr(inner, "use_ema", False):
                return None
            return [np.array(v.numpy()) for v in inner._model_variables_moving_average]
        if self.family == "tfa":
            T = _tfa().optimizers
            if isinstance(inner, T.AveragedOptimizerWrapper):
                return [inner.get_slot(v, "average").numpy() for v in model.trainable_variables]
        return None

    def learning_rate(self, opt) -> float | None:
        """The current learning rate the optimizer reports (Keras 3 and
        Keras 2's new API); ``None`` where it is not a plain attribute or the
        optimizer has none (Keras 3's MultiOptimizer: one per sub-optimizer)."""
        if self.legacy:
            return None
        try:
            return float(np.asarray(opt.learning_rate))
        except (AttributeError, ValueError):
            return None

    def reference(self, case: Case) -> Run:
        return self._run(case, accumulate=False)

    def pair(self, case: Case) -> tuple[Run, Run]:
        return self._run(case, accumulate=False), self._run(case, accumulate=True)

    def _run(self, case: Case, accumulate: bool) -> Run:
        from accum_optimizer import AccumulatingOptimizer

        n, b, updates = self.N, self.B, case.updates or self.UPDATES
        mode = case.mode or self.MODE
        x, y = self.pair_data(n * b * updates, case.dtype)
        model = self.pair_model(case.dtype)
        initial = [np.array(w.numpy()) for w in model.weights]
        inner = case.make_inner(model)
        opt = AccumulatingOptimizer(inner, n, reduction=case.reduction) if accumulate else inner
        loss = self.R.mse
        if case.reduction == "sum" and not accumulate:
            # The sum of N micro-batch mean losses has the gradient of N times the large batch's.
            loss = lambda y_, p_: self.R.mse(y_, p_) * tf.cast(float(n), p_.dtype)  # noqa: E731
        if self.family == "keras3" and not accumulate:
            # Built before the loop, as `fit` builds it (and as the wrapper
            # builds its inner optimizer, outside the trace): Keras 3 built
            # lazily inside a `tf.function` loses what `build` assigns
            # (ScheduleFreeAdamW's momentum = the weights stays 0).
            opt.build(model.trainable_variables)
        step = self.R.make_train_step(model, opt, loss, mode=mode)
        trajectory, names = [], None
        for u in range(updates):
            xs, ys = x[u * n * b:(u + 1) * n * b], y[u * n * b:(u + 1) * n * b]
            if accumulate:
                for k in range(n):
                    step(tf.constant(xs[k * b:(k + 1) * b]), tf.constant(ys[k * b:(k + 1) * b]))
            else:
                step(tf.constant(xs), tf.constant(ys))
            names, state = self.inner_state(inner)
            trajectory.append([np.array(w.numpy()) for w in model.weights] + state)
        return Run(
            trajectory=trajectory, initial=initial, n_weights=len(model.weights), state_names=names,
            iterations=int(opt.iterations.numpy()),
            micro_steps=int(opt.micro_steps.numpy()) if accumulate else None,
            learning_rate=self.learning_rate(opt), ema=self.ema_shadows(inner, model),
            objects={"model": model, "opt": opt, "inner": inner},
        )


    # ----------------------------------------------- missing gradients
    def missing_gradient_cases(self):
        o = self.optimizers
        if self.family == "keras3":
            inners = {"adamw": lambda m: o.AdamW(1e-2, weight_decay=0.2),
                      "sgd_momentum": lambda m: o.SGD(0.1, momentum=0.9, weight_decay=0.1)}
        elif self.family == "keras2":
            inners = {name: (lambda f: lambda m: f())(f) for name, f in self.R.MISSING_GRAD_INNERS.items()}
        elif self.family == "legacy":
            inners = {"Adam": lambda m: o.Adam(0.05), "SGD(momentum)": lambda m: o.SGD(0.1, momentum=0.9)}
        else:
            T = _tfa().optimizers
            inners = {"AdamW": lambda m: T.AdamW(weight_decay=0.1, learning_rate=0.05)}
        cases = [Case(f"{name}-{variant}", make, variant=variant)
                 for name, make in sorted(inners.items()) for variant in ("none_grads", "variable_subset")]
        if self.family == "legacy":  # OptimizerV2 also eagerly (both runs)
            cases.append(Case("Adam-none_grads-eager", inners["Adam"], variant="none_grads", mode="eager"))
        return cases

    def missing_gradient_runs(self, case):
        """``(ref, acc)``: the hand-built large batch of every window of
        :data:`PATTERN` and the accumulating run (a traced step per kind of
        micro-step); each a dict with the weights and inner state after every
        window."""
        from accum_optimizer import AccumulatingOptimizer

        R = self.R
        x, y = R.make_data(MISSING_N * len(PATTERN) * MISSING_MB, in_dim=4, out_dim=2)
        mb = MISSING_MB

        def name_of(v):
            return getattr(v, "path", None) or v.name

        def state(inner, model):
            """``(names, arrays)``; legacy: ``iterations`` and each slot of each
            trainable variable, a slot the plain optimizer has not made yet (no
            gradient so far) as its initial zeros (Adam's moments, momentum:
            OptimizerV2 makes a variable's slots on its first gradient)."""
            if not self.legacy:
                return self.inner_state(inner)
            names, arrays = ["iterations"], [np.array(inner.iterations.numpy())]
            for v in model.trainable_variables:
                for slot in inner.get_slot_names():
                    names.append(f"{v.name}/{slot}")
                    try:
                        arrays.append(np.array(inner.get_slot(v, slot).numpy()))
                    except KeyError:
                        arrays.append(np.zeros(v.shape, v.dtype.as_numpy_dtype))
            return names, arrays

        def record(model, inner, out):
            out["windows"].append({"weights": [np.array(w.numpy()) for w in model.weights],
                                   "state": state(inner, model)[1]})

        # The reference: one tape over the window's micro-batch losses.
        model = R.missing_grad_model()
        inner = case.make_inner(model)
        ref = {"windows": []}
        k = 0
        for window in PATTERN:
            with tf.GradientTape() as tape:
                losses = [R.missing_grad_loss(model, x[(k + i) * mb:(k + i + 1) * mb], y[(k + i) * mb:(k + i + 1) * mb], u)
                          for i, u in enumerate(window)]
                loss = tf.add_n(losses) / MISSING_N  # mean over the window's N*B samples
            k += MISSING_N
            grads = tape.gradient(loss, model.trainable_variables)
            assert (grads[2] is None) == (not any(window))
            inner.apply_gradients(zip(grads, model.trainable_variables))
            record(model, inner, ref)

        model = R.missing_grad_model()
        initial = [np.array(w.numpy()) for w in model.weights]
        inner = case.make_inner(model)
        opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=MISSING_N)
        opt.build(model.trainable_variables)
        a_vars = [v for v in model.trainable_variables if "branch_a" in name_of(v)]
        subset = case.variant == "variable_subset"

        def step(xb, yb, uses_b):
            with tf.GradientTape() as tape:
                loss = R.missing_grad_loss(model, xb, yb, uses_b)
            grads = tape.gradient(loss, model.trainable_variables)
            if subset and not uses_b:
                opt.apply_gradients(zip(grads[:2], a_vars))
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables))

        if (case.mode or self.MODE) != "eager":
            step = tf.function(step)

        acc = {"windows": [], "initial": initial, "weight_names": [name_of(w) for w in model.weights]}
        k = 0
        for window in PATTERN:
            for uses_b in window:
                step(tf.constant(x[k * mb:(k + 1) * mb]), tf.constant(y[k * mb:(k + 1) * mb]), uses_b)
                k += 1
            record(model, inner, acc)
        acc["state_names"] = state(inner, model)[0]
        acc["iterations"] = int(opt.iterations.numpy())
        acc["inner_attributes"] = set(vars(inner))
        return ref, acc

    # ------------------------------------------------------- trainers
    def make_inner(self, spec: Inner):
        o = self.optimizers
        if spec.kind == "sgd":
            return o.SGD(spec.lr, momentum=spec.momentum) if spec.momentum else o.SGD(spec.lr)
        if spec.kind == "adam":
            return o.Adam(spec.lr)
        if spec.kind == "adam_ema":
            return o.Adam(spec.lr, use_ema=True)
        if spec.kind == "rmsprop":
            return o.RMSprop(spec.lr, momentum=spec.momentum, centered=spec.centered)
        if spec.kind == "adamw_ema":
            schedule = self.keras.optimizers.schedules.CosineDecay(
                spec.lr, decay_steps=10, warmup_target=2 * spec.lr, warmup_steps=2)
            return o.AdamW(schedule, weight_decay=0.05, use_ema=True, ema_momentum=0.9)
        raise ValueError(spec)

    def trainer(self, inner: Inner, n=None, seed: int = 0, reduction: str = "mean", weighted: bool = False,
                mode: str = "graph", strategy=None, **options) -> "KerasTrainer":
        """``options``: more arguments of the AccumulatingOptimizer
        (``nonfinite=``, ``accumulator_dtype=``)."""
        return KerasTrainer(self, inner, n, seed, reduction, mode, strategy, options)

    def variable(self, value, dtype="float32"):
        if self.family == "keras3":
            return self.keras.Variable(np.array(value, "float32"), dtype=dtype)
        return tf.Variable(np.array(value, dtype))

    def vectors(self, inits: list, inner: Inner, n, reduction: str = "mean", traced: bool = False,
                dtype: str = "float32", **options) -> "KerasVectors":
        """``dtype``: of the variables and gradients; ``options``: as for :meth:`trainer`."""
        return KerasVectors(self, inits, inner, n, reduction, traced, dtype, options)

    def modes(self) -> list:
        return ["graph"]

    def between_updates_modes(self) -> list:
        return ["graph", "eager"] if self.legacy else ["graph"]

    def save_formats(self) -> list:
        return {"keras3": ["checkpoint", "store"], "keras2": ["checkpoint", "weights", "store"],
                "legacy": ["checkpoint", "weights"]}[self.family]

    def old_save_formats(self):
        """Formats that can hold state saved before ``mini_step`` and
        ``window_weight`` existed (the optimizer's arrays without them)."""
        return {"keras3": NotApplicable("Keras 3 state of that age is covered by keras3/test_sparse_window.py's "
                                        "store without row trackers; its window variables came with them"),
                "keras2": ["weights", "store"], "legacy": ["weights"]}[self.family]


class KerasTrainer:
    """A seeded ``make_mlp`` model (6 -> 5 tanh -> 3) with a plain or an
    accumulating optimizer, and a custom-loop step: the gradient of the
    micro-batch's mean squared error, applied with ``weight`` if given.
    Traced steps take any batch size (one trace per kind of call)."""

    def __init__(self, d: KerasDriver, inner: Inner, n, seed, reduction, mode, strategy, options=None):
        from accum_optimizer import AccumulatingOptimizer

        self.d, self.n, self.strategy = d, n, strategy
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self.model = d.R.make_mlp(seed)
            self.inner = d.make_inner(inner)
            self.opt = self.inner if n is None else AccumulatingOptimizer(
                self.inner, n, reduction=reduction, **(options or {}))
        model, opt, mse = self.model, self.opt, d.R.mse

        def step(x, y, weight=None):
            with tf.GradientTape() as tape:
                loss = mse(y, model(x, training=True))
                if strategy is not None:
                    loss = loss / strategy.num_replicas_in_sync  # Keras' convention
            grads = tape.gradient(loss, model.trainable_variables)
            if weight is None:
                opt.apply_gradients(zip(grads, model.trainable_variables))
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables), weight=weight)

        self._eager = step
        if mode == "eager" or strategy is not None:
            self._plain, self._weighted = step, step
        else:
            sig = [tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([None, 3], tf.float32)]
            self._plain = tf.function(lambda x, y: step(x, y), input_signature=sig)
            self._weighted = tf.function(step, input_signature=sig + [tf.TensorSpec([], tf.float32)])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self, x, y, weight=None):
        if weight is None:
            self._plain(tf.constant(x), tf.constant(y))
        else:
            self._weighted(tf.constant(x), tf.constant(y), tf.constant(float(weight), tf.float32))

    def replica_step(self, x_parts, y_parts):
        """Under the trainer's strategy, eagerly: replica ``r`` gets
        ``x_parts[r]`` and passes its own sample count as ``weight``."""
        s = self.strategy

        def replica_fn(xs, ys):
            self._eager(xs, ys, weight=tf.cast(tf.shape(xs)[0], tf.float32))

        def value(parts):
            return s.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

        s.run(replica_fn, args=(value(x_parts), value(y_parts)))

    def build(self):
        self.opt.build(self.model.trainable_variables)

    def flush(self, traced=False):
        (tf.function(self.opt.flush) if traced else self.opt.flush)()

    def weights(self) -> list:
        return [np.array(w.numpy()) for w in self.model.weights]

    def inner_state(self) -> list:
        return self.d.inner_state(self.inner)[1]

    def state_names(self) -> list:
        return self.d.inner_state(self.inner)[0]

    def snapshot(self) -> list:
        """Everything an update could touch: the weights, every inner
        variable and (legacy) the inner's hyperparameter variables."""
        extra = []
        if self.d.legacy:
            extra = [np.array(v.numpy()) for v in self.inner._hyper.values() if isinstance(v, tf.Variable)]
        return self.weights() + self.inner_state() + extra

    def counters(self) -> dict:
        opt = self.opt
        out = {"iterations": int(opt.iterations.numpy())}
        if self.n is not None:
            out["micro_steps"] = int(opt.micro_steps.numpy())
            if opt.mini_step is not None:
                out["mini_step"] = int(opt.mini_step.numpy())
                out["window_weight"] = float(opt.window_weight.numpy())
            for name in SKIP_COUNTERS:
                if getattr(opt, name, None) is not None:
                    out[name] = int(getattr(opt, name).numpy())
        return out

    def acc_grads(self) -> list:
        return [np.array(a.numpy()) for a in self.opt.acc_grads]

    def own_variables(self) -> list:
        """The wrapper's variables that are not the inner optimizer's."""
        inner_ids = {id(v) for v in (self.inner.weights if self.d.legacy else self.inner.variables)}
        mine = self.opt.weights if self.d.legacy else self.opt.variables
        return [v for v in mine if id(v) not in inner_ids]

    def is_wrapper_counter(self, v) -> bool:
        return v is self.opt.micro_steps

    @property
    def grad_received(self):
        return self.opt.grad_received

    # --------------------------------------------------------- saving
    def save(self, fmt: str, directory, drop_window: bool = False):
        """The model and optimizer state in ``fmt``: ``"checkpoint"``
        (``tf.train.Checkpoint``), ``"weights"`` (``get_weights``, what Keras
        2's ``.h5`` format stores), ``"store"`` (``save_own_variables``, what
        ``.keras`` and ``.weights.h5`` call). ``drop_window``: without
        ``mini_step`` and ``window_weight`` (state saved before they existed)."""
        model, opt = self.model, self.opt
        if fmt == "checkpoint":
            assert not drop_window
            return tf.train.Checkpoint(model=model, optimizer=opt).write(str(directory / "ckpt"))
        if fmt == "weights":
            state = [np.array(v.numpy()) for v in (opt.weights if self.d.legacy else opt.variables)]
            if drop_window:
                assert state[-2].dtype == np.int64 and state[-1].dtype == np.float32  # mini_step, window_weight
                state = state[:-2]
            return model.get_weights(), state
        assert fmt == "store", fmt
        store = {}
        opt.save_own_variables(store)
        if drop_window:
            store = {str(i): store[str(i)] for i in range(len(store) - 2)}
        return model.get_weights(), store

    def restore(self, fmt: str, saved, drop_window: bool = False):
        """Into this trainer (built first: the restore must overwrite);
        ``drop_window`` is in what was saved."""
        model, opt = self.model, self.opt
        self.build()
        if fmt == "checkpoint":
            tf.train.Checkpoint(model=model, optimizer=opt).read(saved).assert_consumed()
        elif fmt == "weights":
            model.set_weights(saved[0])
            opt.set_weights(saved[1])
        else:
            model.set_weights(saved[0])
            opt.load_own_variables(saved[1])


class KerasVectors:
    """Hand-computed checks: variables with given initial values, gradients
    given per micro-step (``None``: no gradient), ``apply_gradients`` with
    ``weight``. ``traced``: the micro-step is a ``tf.function`` whose weight is
    a runtime tensor."""

    def __init__(self, d: KerasDriver, inits, inner: Inner, n, reduction, traced, dtype="float32", options=None):
        from accum_optimizer import AccumulatingOptimizer

        self.dtype = dtype
        self.variables = [d.variable(v, dtype) for v in inits]
        self.opt = AccumulatingOptimizer(d.make_inner(inner), n, reduction=reduction, **(options or {}))
        self.traced = traced
        self._fns = {}

    def apply(self, grads, weight=None, at_build=False):
        """One micro-step (``at_build``: the same here; eager code has no
        build time apart from the call)."""
        pairs_of = lambda gs: list(zip(gs, self.variables))  # noqa: E731
        grads = [None if g is None else tf.constant(np.array(g, "float32"), self.dtype) for g in grads]
        if not self.traced:
            if weight is None:
                self.opt.apply_gradients(pairs_of(grads))
            else:
                self.opt.apply_gradients(pairs_of(grads), weight=weight)
            return
        key = tuple(g is None for g in grads)
        if key not in self._fns:
            def fn(gs, w):
                self.opt.apply_gradients(pairs_of([None if m else g for g, m in zip(gs, key)]), weight=w)

            self._fns[key] = tf.function(fn)
        present = [tf.zeros([2], self.dtype) if g is None else g for g in grads]
        self._fns[key](present, tf.constant(1.0 if weight is None else weight, tf.float32))

    def build(self):
        """Build the window (the optimizer) before any micro-step."""
        self.opt.build(self.variables)

    def flush(self, traced=False):
        (tf.function(self.opt.flush) if traced else self.opt.flush)()

    def values(self) -> list:
        return [np.array(v.numpy()) for v in self.variables]

    def counters(self) -> dict:
        """The counters; ``None`` for a window variable not built yet."""
        opt = self.opt

        def value(v, kind):
            return None if v is None else kind(v.numpy())

        # Before the first micro-step builds it, Keras 2's wrapper has no
        # micro_steps/mini_step/window_weight attribute (Keras 3's: None).
        out = {"iterations": int(opt.iterations.numpy()),
               "micro_steps": value(getattr(opt, "micro_steps", None), int),
               "mini_step": value(getattr(opt, "mini_step", None), int),
               "window_weight": value(getattr(opt, "window_weight", None), float)}
        for name in SKIP_COUNTERS:
            if getattr(opt, name, None) is not None:
                out[name] = int(getattr(opt, name).numpy())
        return out

    def acc_grads(self) -> list:
        return [np.array(a.numpy()) for a in self.opt.acc_grads]

    def acc_dtypes(self) -> list:
        """The accumulators' dtypes, as names (``"float32"``)."""
        return [tf.as_dtype(a.dtype).name for a in self.opt.acc_grads]


def _tfa():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tensorflow_addons as tfa
    return tfa


# ======================================================================= TF1
class TF1Driver(Driver):
    """``tf.compat.v1.train.Optimizer``: graph code, each run in its own
    ``tf.Graph`` and ``Session``; ``"v2"`` is TF2's defaults in a graph
    (resource variables, ``cond_v2``), ``"v1"`` what
    ``tf.compat.v1.disable_v2_behavior()`` gives (``RefVariable``\\ s,
    control flow v1). The model is :mod:`support.reference_tf1`'s softmax
    regression."""

    family = "tf1"
    N, B, UPDATES = 3, 4, 3
    MOVED = 1e-3
    MODE = "v2"
    RICH_INNER = Inner("adam", 0.02)
    ALL_STATE_MOVES_ON_UPDATE = True

    def __init__(self):
        from support import reference_tf1 as T

        self.T = T

    def equivalence_cases(self):
        return [Case(name, make) for name, make in self.T.INNER_OPTIMIZERS.items()
                if name != "Adam-exponential_decay"]

    def mode_cases(self):
        """The same under TF1 defaults: RefVariables and control flow v1 (the
        ``_apply_dense`` kernels, a ``tf.cond`` built in the graph itself)."""
        return [Case(f"{name}-v1", self.T.INNER_OPTIMIZERS[name], mode="v1")
                for name in ("Adam-exponential_decay", "Momentum-nesterov", "Ftrl")]

    def float64_cases(self):
        return NotApplicable("the TF1 model is float32 only (as before the reshape)")

    def sum_cases(self):
        return NotApplicable("reduction='sum' is proven bitwise against the design document's hand-written "
                             "recipe in tf1/test_semantics.py")

    def schedule_cases(self):
        # The user code: a schedule on global_step, which counts updates.
        return [Case("Adam-exponential_decay", self.T.INNER_OPTIMIZERS["Adam-exponential_decay"])]

    def fast_schedule_pair(self):
        tf1 = tf.compat.v1
        return (Case("exponential_decay", lambda gs: tf1.train.AdamOptimizer(
                    tf1.train.exponential_decay(0.05, gs, decay_steps=1, decay_rate=0.5))),
                Case("fast", lambda gs: tf1.train.AdamOptimizer(
                    tf1.train.exponential_decay(0.05, gs, decay_steps=1 / self.N, decay_rate=0.5))))

    def ema_cases(self):
        return NotApplicable("tf.compat.v1.train optimizers have no EMA (tf.train.ExponentialMovingAverage "
                             "is an op of its own, outside the optimizer)")

    def reference(self, case):
        return self._run(case, None)

    def pair(self, case):
        return self._run(case, None), self._run(case, self.N)

    def _run(self, case, n):
        updates = case.updates or self.UPDATES
        out = self.T.train_mlp(case.make_inner, n, self.N * self.B if n is None else self.B, updates,
                               reduction=case.reduction, mode=case.mode or self.MODE, every_update=True)
        names = sorted(out["trajectory"][0])
        model_names = [k for k in self.T.mlp_init() if k in names]
        state_names = [k for k in names if k not in model_names]
        trajectory = [[s[k] for k in model_names] + [s[k] for k in state_names] for s in out["trajectory"]]
        init = self.T.mlp_init()
        return Run(trajectory=trajectory, initial=[init[k] for k in model_names], n_weights=len(model_names),
                   state_names=state_names, iterations=int(out["trajectory"][-1]["global_step"]),
                   micro_steps=out["micro_steps"])


    def missing_gradient_cases(self):
        tf1 = tf.compat.v1
        inners = {"Adam": lambda gs: tf1.train.AdamOptimizer(0.05),
                  "Momentum": lambda gs: tf1.train.MomentumOptimizer(0.1, 0.9)}
        cases = [Case(f"{name}-{variant}", make, variant=variant)
                 for name, make in sorted(inners.items()) for variant in ("none_grads", "variable_subset")]
        if self.family == "legacy":  # OptimizerV2 also eagerly (both runs)
            cases.append(Case("Adam-none_grads-eager", inners["Adam"], variant="none_grads", mode="eager"))
        return cases

    def missing_gradient_runs(self, case):
        """The graph version of :meth:`KerasDriver.missing_gradient_runs`:
        ``y = a(x) + b(x)`` (dense layers as variables, b's kernel
        constrained to be non-negative), one train op per kind of micro-step
        (all four variables; b left out of the loss, so its gradient is None;
        only a's variables), and a reference whose window loss has b's term
        only for the micro-batches that use it (so in a window without b its
        gradient is None and the plain optimizer skips it, slots included)."""
        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        rng = np.random.default_rng(3)
        init = {"branch_a/kernel": rng.normal(size=(4, 2)).astype("float32"),
                "branch_a/bias": np.zeros(2, "float32"),
                "branch_b/kernel": rng.normal(size=(4, 2)).astype("float32"),
                "branch_b/bias": np.zeros(2, "float32")}
        n, mb = MISSING_N, MISSING_MB
        data = np.random.default_rng(1)
        x = data.normal(size=(n * len(PATTERN) * mb, 4)).astype("float32")
        y = data.normal(size=(n * len(PATTERN) * mb, 2)).astype("float32")

        def variables():
            nonneg = lambda w: tf.maximum(w, 0.0)  # noqa: E731
            return {name: tf1.Variable(value, name=name, constraint=nonneg if name == "branch_b/kernel" else None)
                    for name, value in init.items()}

        def loss(vs, xb, yb, uses_b):
            pa = tf.matmul(xb, vs["branch_a/kernel"]) + vs["branch_a/bias"]
            if not uses_b:
                return tf.reduce_mean(tf.square(yb - pa))
            return tf.reduce_mean(tf.square(yb - pa - tf.matmul(xb, vs["branch_b/kernel"]) - vs["branch_b/bias"]))

        def snapshot(sess, vs, inner, global_step):
            """Names and values: the model's variables; every variable of the
            inner optimizer (slots, beta powers) and global_step."""
            state = list(inner.variables()) + [global_step]
            return (list(init), [v.name for v in state],
                    {"weights": sess.run([vs[k] for k in init]), "state": sess.run(state)})

        # The reference.
        with tf.Graph().as_default(), tf1.Session() as sess:
            vs = variables()
            global_step = tf1.train.get_or_create_global_step()
            inner = case.make_inner(global_step)
            xs = [tf1.placeholder(tf.float32, [None, 4]) for _ in range(n)]
            ys = [tf1.placeholder(tf.float32, [None, 2]) for _ in range(n)]
            ops = {}
            for window in PATTERN:
                if tuple(window) not in ops:
                    window_loss = tf.add_n([loss(vs, xs[i], ys[i], u) for i, u in enumerate(window)]) / n
                    ops[tuple(window)] = inner.minimize(window_loss, global_step=global_step)
            sess.run(tf1.global_variables_initializer())
            ref = {"windows": []}
            k = 0
            for window in PATTERN:
                feed = {}
                for i in range(n):
                    feed[xs[i]], feed[ys[i]] = x[(k + i) * mb:(k + i + 1) * mb], y[(k + i) * mb:(k + i + 1) * mb]
                k += n
                sess.run(ops[tuple(window)], feed)
                ref["windows"].append(snapshot(sess, vs, inner, global_step)[2])

        # The accumulating run.
        with tf.Graph().as_default(), tf1.Session() as sess:
            vs = variables()
            global_step = tf1.train.get_or_create_global_step()
            inner = case.make_inner(global_step)
            opt = AccumulatingOptimizer(inner, n)
            xb, yb = tf1.placeholder(tf.float32, [None, 4]), tf1.placeholder(tf.float32, [None, 2])
            full = opt.minimize(loss(vs, xb, yb, True), global_step=global_step, var_list=list(vs.values()))
            if case.variant == "variable_subset":
                without_b = opt.minimize(loss(vs, xb, yb, False), global_step=global_step,
                                         var_list=[vs["branch_a/kernel"], vs["branch_a/bias"]])
            else:
                grads_and_vars = opt.compute_gradients(loss(vs, xb, yb, False), var_list=list(vs.values()))
                assert [g is None for g, _ in grads_and_vars] == [False, False, True, True]
                without_b = opt.apply_gradients(grads_and_vars, global_step=global_step)
            sess.run(tf1.global_variables_initializer())
            names, state_names, first = snapshot(sess, vs, inner, global_step)
            acc = {"windows": [], "initial": first["weights"], "weight_names": names, "state_names": state_names}
            k = 0
            for window in PATTERN:
                for uses_b in window:
                    sess.run(full if uses_b else without_b, {xb: x[k * mb:(k + 1) * mb], yb: y[k * mb:(k + 1) * mb]})
                    k += 1
                acc["windows"].append(snapshot(sess, vs, inner, global_step)[2])
            acc["iterations"] = int(sess.run(global_step))
            acc["inner_attributes"] = set()  # TF1: the inner's kernels are the family's own business
        return ref, acc

    def modes(self):
        return ["v2", "v1"]

    def trainer(self, inner: Inner, n=None, seed=0, reduction="mean", weighted=False, mode="v2", strategy=None,
                **options):
        assert strategy is None
        return TF1Trainer(self, inner, n, seed, reduction, weighted, mode, options)

    def vectors(self, inits, inner: Inner, n, reduction="mean", traced=False, dtype="float32", **options):
        return TF1Vectors(self, inits, inner, n, reduction, dtype, options)

    def make_inner(self, spec: Inner):
        tf1 = tf.compat.v1
        if spec.kind == "sgd":
            if spec.momentum:
                return tf1.train.MomentumOptimizer(spec.lr, spec.momentum)
            return tf1.train.GradientDescentOptimizer(spec.lr)
        if spec.kind == "adam":
            return tf1.train.AdamOptimizer(spec.lr)
        raise ValueError(spec)

    def data(self, n):
        """Samples for the trainers' model (the softmax regression: 4 -> 3)."""
        return self.T.mlp_data(n)

    def save_formats(self):
        return ["saver"]

    def old_save_formats(self):
        return ["saver"]


class TF1Trainer:
    """The softmax regression of :mod:`support.reference_tf1` in its own graph
    and session, global_step, the inner optimizer, and one train op
    (``minimize(..., weight=<placeholder>)`` if ``weighted``) and, when
    accumulating, the flush op."""

    def __init__(self, d: TF1Driver, inner: Inner, n, seed, reduction, weighted, mode, options=None):
        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        T = d.T
        self.d, self.n, self.weighted = d, n, weighted
        self.graph = tf.Graph()
        with T.control_flow(mode), self.graph.as_default():
            self.mlp = T.build_mlp(T.mlp_init(seed=seed))
            self.global_step = tf1.train.get_or_create_global_step()
            self.inner = d.make_inner(inner)
            self.weight = tf1.placeholder(tf.float32, [], name="weight") if weighted else None
            if n is None:
                self.opt = self.inner
                self.train_op = self.inner.minimize(self.mlp.loss, global_step=self.global_step)
            else:
                self.opt = AccumulatingOptimizer(self.inner, n, reduction=reduction, **(options or {}))
                self.train_op = self.opt.minimize(self.mlp.loss, global_step=self.global_step, weight=self.weight)
                self.flush_op = self.opt.flush() if self.opt.mini_step is not None else None
            init = tf1.global_variables_initializer()
        self.sess = tf1.Session(graph=self.graph)
        self.sess.run(init)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sess.close()
        return False

    def step(self, x, y, weight=None):
        feed = self.mlp.feed(x, y)
        if self.weighted:
            feed[self.weight] = 1.0 if weight is None else float(weight)
        else:
            assert weight is None, "build the trainer with weighted=True"
        self.sess.run(self.train_op, feed)

    def build(self):
        pass  # the state exists from minimize on

    def flush(self, traced=False):
        self.sess.run(self.flush_op)

    def weights(self) -> list:
        return self.sess.run(list(self.mlp.variables.values()))

    def inner_state(self) -> list:
        with self.graph.as_default():  # TF1 optimizers list the variables of the default graph
            return self.sess.run(list(self.inner.variables()) + [self.global_step])

    def state_names(self) -> list:
        with self.graph.as_default():
            return [v.name for v in self.inner.variables()] + ["global_step"]

    def snapshot(self) -> list:
        return self.weights() + self.inner_state()

    def counters(self) -> dict:
        # The wrapper's state is per graph: read it with its graph as the default.
        with self.graph.as_default():
            out = {"iterations": int(self.sess.run(self.global_step))}
            if self.n is not None:
                opt = self.opt
                out["micro_steps"] = int(self.sess.run(opt.micro_steps))
                if opt.mini_step is not None:
                    out["mini_step"] = int(self.sess.run(opt.mini_step))
                    out["window_weight"] = float(self.sess.run(opt.window_weight))
                for name in SKIP_COUNTERS:
                    if getattr(opt, name, None) is not None:
                        out[name] = int(self.sess.run(getattr(opt, name)))
        return out

    def acc_grads(self) -> list:
        with self.graph.as_default():
            slots = [self.opt.get_slot(v, "acc_grad") for v in self.mlp.variables.values()]
            return [] if any(s is None for s in slots) else self.sess.run(slots)

    def own_variables(self) -> list:
        with self.graph.as_default():
            inner = {v.ref() for v in self.inner.variables()}
            return [v for v in self.opt.variables() if v.ref() not in inner]

    def is_wrapper_counter(self, v) -> bool:
        with self.graph.as_default():
            return v is self.opt.micro_steps

    @property
    def grad_received(self):
        """TF1's wrapper has no ``grad_received`` attribute (its window's
        variables are listed by ``accumulation_variables()``)."""
        with self.graph.as_default():
            return getattr(self.opt, "grad_received", None)

    def save(self, fmt, directory, drop_window=False):
        """A ``tf.compat.v1.train.Saver`` checkpoint of every global variable;
        ``drop_window``: without ``mini_step`` and ``window_weight``."""
        assert fmt == "saver", fmt
        with self.graph.as_default():  # a Saver runs in graph mode
            return tf.compat.v1.train.Saver(self._saved(drop_window)).save(self.sess, str(directory / "ckpt"))

    def restore(self, fmt, saved, drop_window=False):
        with self.graph.as_default():
            tf.compat.v1.train.Saver(self._saved(drop_window)).restore(self.sess, saved)

    def _saved(self, drop_window):
        if not drop_window:
            return None  # every global variable
        opt = self.opt
        return [v for v in tf.compat.v1.global_variables() if v is not opt.mini_step and v is not opt.window_weight]


class TF1Vectors:
    """Hand-computed checks in a graph: variables with given initial values,
    a placeholder per gradient, ``weight`` a ``placeholder_with_default(1.0)``;
    one train op per set of variables that have a gradient (the one with all
    of them built first: it builds the window), and the flush op."""

    def __init__(self, d: TF1Driver, inits, inner: Inner, n, reduction, dtype="float32", options=None):
        import itertools

        tf1 = tf.compat.v1
        from accum_optimizer.families.tf1 import AccumulatingOptimizer

        self.graph, self.dtype = tf.Graph(), dtype
        with self.graph.as_default():
            self.variables = [tf1.Variable(np.array(v, dtype), name=f"v{i}") for i, v in enumerate(inits)]
            self.global_step = tf1.train.get_or_create_global_step()
            self.grads = [tf1.placeholder(dtype, v.shape, name=f"g{i}") for i, v in enumerate(self.variables)]
            self.weight = tf1.placeholder_with_default(1.0, [], name="weight")
            self.opt = AccumulatingOptimizer(d.make_inner(inner), n, reduction=reduction, **(options or {}))
            self.ops = {}
            k = len(self.variables)
            masks = [m for r in range(k, 0, -1) for m in itertools.combinations(range(k), r)]
            for mask in masks:
                self.ops[mask] = self.opt.apply_gradients(
                    [(self.grads[i] if i in mask else None, v) for i, v in enumerate(self.variables)],
                    global_step=self.global_step, weight=self.weight)
            self.flush_op = self.opt.flush()
            init = tf1.global_variables_initializer()
        self.sess = tf1.Session(graph=self.graph)
        self.sess.run(init)

    def apply(self, grads, weight=None, at_build=False):
        """One micro-step. ``at_build``: ``weight`` is given to
        ``apply_gradients`` as a Python value, when the op is built (a new
        op, run once), instead of fed to the placeholder when it runs."""
        mask = tuple(i for i, g in enumerate(grads) if g is not None)
        if at_build:
            with self.graph.as_default():
                op = self.opt.apply_gradients(
                    [(None if g is None else tf.constant(np.array(g, self.dtype)), v)
                     for g, v in zip(grads, self.variables)], global_step=self.global_step, weight=weight)
            self.sess.run(op)
            return
        feed = {self.grads[i]: np.array(grads[i], self.dtype) for i in mask}
        if weight is not None:
            feed[self.weight] = weight
        self.sess.run(self.ops[mask], feed)

    def build(self):
        """The window is built with the train ops (in ``__init__``)."""

    def flush(self, traced=False):
        self.sess.run(self.flush_op)

    def values(self) -> list:
        return self.sess.run(self.variables)

    def counters(self) -> dict:
        with self.graph.as_default():  # the wrapper's state is per graph
            o = self.opt
            it, ms, mini, ww = self.sess.run([self.global_step, o.micro_steps, o.mini_step, o.window_weight])
            out = {"iterations": int(it), "micro_steps": int(ms), "mini_step": int(mini), "window_weight": float(ww)}
            for name in SKIP_COUNTERS:
                if getattr(o, name, None) is not None:
                    out[name] = int(self.sess.run(getattr(o, name)))
        return out

    def acc_grads(self) -> list:
        with self.graph.as_default():
            return self.sess.run([self.opt.get_slot(v, "acc_grad") for v in self.variables])

    def acc_dtypes(self) -> list:
        with self.graph.as_default():
            return [self.opt.get_slot(v, "acc_grad").dtype.base_dtype.name for v in self.variables]

