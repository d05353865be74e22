"""Keras 2's new optimizer API: ``tf.keras.optimizers`` (tf_keras, or Keras
2.15)."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from support.drivers.base import Case
from support.drivers.keras import KerasDriver


def _called(make):
    """``make()`` as a ``make_inner(model)``."""
    return lambda m: make()


class Keras2Driver(KerasDriver):
    family = "keras2"
    N, B, UPDATES, MOVED = 3, 4, 4, 1e-3
    EAGER_CASES = ("sgd_momentum", "adam", "nadam", "adafactor")

    # ----------------------------------------------------------- cases
    def equivalence_inners(self) -> dict:
        o = self.optimizers
        cases = {name: _called(make) for name, make in self.R.optimizer_cases().items()}
        cases.update({
            "clipnorm": lambda m: o.Adam(1e-2, clipnorm=0.05),
            "global_clipnorm": lambda m: o.Adam(1e-2, global_clipnorm=0.05),
            "clipvalue": lambda m: o.SGD(0.1, clipvalue=0.01),
            "weight_decay_sgd": lambda m: o.SGD(0.1, momentum=0.9, weight_decay=0.1),
        })
        return cases

    def float64_cases(self):
        by_name = {c.name: c for c in self.equivalence_cases()}
        return [dataclasses.replace(by_name[n], dtype="float64", tol=1e-12) for n in ("adam", "adafactor")]

    def sum_cases(self):
        o = self.optimizers
        return [Case("adam", lambda m: o.Adam(1e-2), reduction="sum")]

    def schedule_cases(self):
        """The learning-rate schedules (:meth:`new_api_schedule_cases`) and,
        eagerly, ExponentialDecay against its hand-derived rate."""
        o, schedules = self.optimizers, self.keras.optimizers.schedules
        return self.new_api_schedule_cases("cosine_warmup_adamw_ema") + [
            # Hand-derived: ExponentialDecay(0.2, 1, 0.3, staircase) at update k is
            # 0.2 * 0.3**k; the current learning rate the inner optimizer holds after
            # the last update was computed at iterations = UPDATES - 1. Fed
            # micro-steps, it would be 0.2 * 0.3**(N * UPDATES - 1).
            Case("exponential_decay-eager", lambda m: o.SGD(
                schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True)),
                mode="eager", expected_lr=0.2 * 0.3 ** (self.UPDATES - 1)),
        ]

    def ema_cases(self):
        o = self.optimizers
        return [Case("ema_overwrite", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.5,
                                                       ema_overwrite_frequency=2))]

    def missing_gradient_inners(self) -> dict:
        return {name: _called(make) for name, make in self.R.MISSING_GRAD_INNERS.items()}

    # ----------------------------------------------------------- runs
    def inner_state(self, inner) -> tuple[list, list]:
        """``(names, arrays)``: the optimizer's ``variables`` and the
        variables it holds as attributes (learning rate, a schedule's current
        rate, Nadam's ``_u_product``)."""
        found, seen = [], set()
        for v in list(inner.variables) + [
            w for name in sorted(vars(inner))
            for w in (vars(inner)[name] if isinstance(vars(inner)[name], (list, tuple)) else [vars(inner)[name]])
        ]:
            if isinstance(v, tf.Variable) and id(v) not in seen:
                seen.add(id(v))
                found.append(v)
        return [v.name for v in found], [np.array(v.numpy()) for v in found]

    def save_formats(self) -> list:
        return ["checkpoint", "weights", "store"]

    def old_save_formats(self):
        """Formats that can hold state saved before ``mini_step`` and
        ``window_weight`` existed (the optimizer's arrays without them)."""
        return ["weights", "store"]
