"""Keras 3 on TensorFlow: ``keras.optimizers``."""

from __future__ import annotations

import dataclasses

import numpy as np

from support.drivers.base import Case, NotApplicable
from support.drivers.keras import KerasDriver


class Keras3Driver(KerasDriver):
    family = "keras3"
    N, B, UPDATES, MOVED = 4, 3, 4, 1e-4
    BASE_ARGUMENTS = KerasDriver.BASE_ARGUMENTS + (("loss_scale_factor", 128.0),)

    # ----------------------------------------------------------- cases
    def equivalence_inners(self) -> dict:
        o = self.optimizers
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
        return cases

    def mode_cases(self):
        return NotApplicable("Keras 3 runs the same code eagerly; keras3/test_equivalence_property.py's "
                             "test trains eagerly and keras3/test_xla.py compiles with XLA")

    def float64_cases(self):
        by_name = {c.name: c for c in self.equivalence_cases()}
        names = ["sgd_momentum", "adam", "adamw", "rmsprop_centered", "nadam", "lamb", "adafactor"]
        return [dataclasses.replace(by_name[n], dtype="float64", updates=3, tol=1e-12) for n in names]

    def sum_cases(self):
        o = self.optimizers
        return [Case("sgd_momentum", lambda m: o.SGD(0.02, momentum=0.9), reduction="sum", updates=3)]

    def schedule_cases(self):
        """The learning-rate schedules (:meth:`new_api_schedule_cases`) and
        ExponentialDecay."""
        o, schedules = self.optimizers, self.keras.optimizers.schedules
        return self.new_api_schedule_cases("cosine_warmup") + [
            Case("exponential_decay", lambda m: o.SGD(
                schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.3, staircase=True)))]

    def ema_cases(self):
        o = self.optimizers
        return [
            Case("ema", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.9)),
            Case("ema_overwrite", lambda m: o.Adam(1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)),
        ]

    def missing_gradient_inners(self) -> dict:
        o = self.optimizers
        return {"adamw": lambda m: o.AdamW(1e-2, weight_decay=0.2),
                "sgd_momentum": lambda m: o.SGD(0.1, momentum=0.9, weight_decay=0.1)}

    def mirrored_cases(self) -> list:
        return [Case("adam", lambda m: self.optimizers.Adam(1e-2)),
                Case("adamw_ema_schedule", self.adamw_ema_schedule)]

    # ----------------------------------------------------------- runs
    def inner_state(self, inner) -> tuple[list, list]:
        """``(names, arrays)``: the optimizer's ``variables``."""
        vs = list(inner.variables)
        return [v.path for v in vs], [np.array(v.numpy()) for v in vs]

    def build_reference(self, opt, model):
        """Built before the loop, as `fit` builds it (and as the wrapper
        builds its inner optimizer, outside the trace): Keras 3 built lazily
        inside a `tf.function` loses what `build` assigns (ScheduleFreeAdamW's
        momentum = the weights stays 0)."""
        opt.build(model.trainable_variables)

    def replica_values(self, v, replicas: int) -> list:
        components = [np.asarray(c.numpy()) for c in v.value.values]
        assert len(components) == replicas, v.path
        return components

    def variable(self, value, dtype="float32"):
        return self.keras.Variable(np.array(value, "float32"), dtype=dtype)

    def save_formats(self) -> list:
        return ["checkpoint", "store"]

    def old_save_formats(self):
        """Formats that can hold state saved before ``mini_step`` and
        ``window_weight`` existed: none here."""
        return NotApplicable("Keras 3 state of that age is covered by keras3/test_sparse_window.py's "
                             "store without row trackers; its window variables came with them")
