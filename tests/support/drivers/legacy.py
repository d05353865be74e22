"""Keras 2's legacy ``OptimizerV2`` (``tf.keras.optimizers.legacy``):
:class:`LegacyDriver`, and tensorflow-addons' optimizers on it
(:class:`TfaDriver`, ``"tfa"``); what both share is :class:`OptimizerV2Driver`."""

from __future__ import annotations


import numpy as np
import tensorflow as tf

from support.drivers.base import Case, Inner, NotApplicable
from support.drivers.keras import KerasDriver


def _tfa():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tensorflow_addons as tfa
    return tfa


class OptimizerV2Driver(KerasDriver):
    """What the legacy and tfa families share: the dense model of
    support.reference (5 -> 4 tanh -> 3), ``weights`` as the optimizer's
    variables, eager between-update checks too."""

    N, B, UPDATES, MOVED = 3, 2, 3, 1e-3
    BASE_ARGUMENTS = None  # OptimizerV2's own (clipnorm, decay, ...): legacy/test_semantics.py
    # Centered RMSprop with momentum: three slots, hyperparameter variables.
    RICH_INNER = Inner("rmsprop", 0.01, momentum=0.5, centered=True)

    @property
    def optimizers(self):
        return self.keras.optimizers.legacy

    def pair_model(self, dtype="float32", seed=0):
        return self.R.dense_model(seed, dtype=dtype)

    def pair_data(self, n, dtype="float32"):
        return self.R.dense_data(n, dtype=np.dtype(dtype).type)

    def inner_state(self, inner) -> tuple[list, list]:
        """``(names, arrays)``: the optimizer's ``weights`` (``iterations``,
        slots, tfa's averages)."""
        vs = list(inner.weights)
        return [v.name for v in vs], [np.array(v.numpy()) for v in vs]

    def ema_shadows(self, inner, model) -> list | None:
        return None

    def learning_rate(self, opt) -> float | None:
        """Not a plain attribute of OptimizerV2."""
        return None

    def missing_gradient_state(self, inner, model) -> tuple[list, list]:
        """``iterations`` and each slot of each trainable variable, a slot the
        plain optimizer has not made yet (no gradient so far) as its initial
        zeros (Adam's moments, momentum: OptimizerV2 makes a variable's slots
        on its first gradient)."""
        names, arrays = ["iterations"], [np.array(inner.iterations.numpy())]
        for v in model.trainable_variables:
            for slot in inner.get_slot_names():
                names.append(f"{v.name}/{slot}")
                try:
                    arrays.append(np.array(inner.get_slot(v, slot).numpy()))
                except KeyError:
                    arrays.append(np.zeros(v.shape, v.dtype.as_numpy_dtype))
        return names, arrays

    MIRRORED = (2, 4, 3, 1, 1e-3)

    def mirrored_model(self, case):
        return self.R.embedding_model() if case.variant == "sparse" else self.R.dense_model()

    def mirrored_data(self, case, n):
        return self.R.embedding_data(n, vocab_used=8) if case.variant == "sparse" else self.R.dense_data(n)

    def mirrored_reductions(self, case, x, y, strategy, counter):
        """As many as plain training at batch N·B under the same strategy,
        one step per update, makes (the control, counted here): the gradients
        are reduced once per update, never on a micro-step."""
        n, b, windows, _, _ = self.MIRRORED
        self.mirrored_fit(case, x, y, n * b, strategy=strategy)
        control = counter.take()
        assert control >= windows  # at least the gradients' reduction per step
        return control

    def optimizer_variables(self, opt) -> list:
        return list(opt.weights)

    def hyper_state(self, inner) -> list:
        """The inner's hyperparameter variables."""
        return [np.array(v.numpy()) for v in inner._hyper.values() if isinstance(v, tf.Variable)]

    def between_updates_modes(self) -> list:
        return ["graph", "eager"]

    def save_formats(self) -> list:
        return ["checkpoint", "weights"]

    def old_save_formats(self):
        """Formats that can hold state saved before ``mini_step`` and
        ``window_weight`` existed (the optimizer's arrays without them)."""
        return ["weights"]


class LegacyDriver(OptimizerV2Driver):
    family = "legacy"
    EAGER_CASES = ("SGD(momentum)", "Adam(amsgrad)", "Nadam", "Ftrl")

    def equivalence_inners(self) -> dict:
        """Every legacy ``OptimizerV2`` class, with the variants the legacy
        issue names, and the clipping options."""
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
            "clipnorm": lambda m: L.Adam(0.05, clipnorm=0.05),
            "global_clipnorm": lambda m: L.Adam(0.05, global_clipnorm=0.05),
            "clipvalue": lambda m: L.Adam(0.05, clipvalue=0.01),
        }

    def mirrored_cases(self) -> list:
        """``OptimizerV2`` clips *after* the all-reduce, so clipping is part of
        the single-device comparison; ``variant="sparse"``: the embedding
        model."""
        L = self.optimizers
        return [Case("Adam", lambda m: L.Adam(0.05)),
                Case("Adam(global_clipnorm)", lambda m: L.Adam(0.05, global_clipnorm=0.05)),
                Case("SGD(momentum) sparse", lambda m: L.SGD(0.1, momentum=0.9), variant="sparse")]

    def float64_cases(self):
        o = self.optimizers
        return [Case("RMSprop(centered,momentum)", lambda m: o.RMSprop(0.01, momentum=0.5, centered=True),
                     dtype="float64", tol=1e-12)]

    def sum_cases(self):
        o = self.optimizers
        return [Case("Adam", lambda m: o.Adam(0.05), reduction="sum")]

    def schedule_cases(self):
        """Learning-rate schedules, whose boundaries and decay lengths are in
        updates, and ``decay=``."""
        o, schedules = self.optimizers, self.keras.optimizers.schedules
        return [
            Case("ExponentialDecay", lambda m: o.Adam(schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))),
            Case("PiecewiseConstantDecay", lambda m: o.SGD(schedules.PiecewiseConstantDecay([1, 2], [0.3, 0.03, 0.003]))),
            Case("CosineDecay(warmup)", lambda m: o.SGD(
                schedules.CosineDecay(0.0, decay_steps=2, warmup_target=0.2, warmup_steps=2), momentum=0.9)),
            Case("decay=", lambda m: o.SGD(0.2, decay=1.0)),  # lr / (1 + decay * iterations)
        ]

    def ema_cases(self):
        return NotApplicable("Keras 2's legacy OptimizerV2 has no use_ema (tensorflow-addons' "
                             "MovingAverage and SWA are the tfa cells)")

    def missing_gradient_inners(self) -> dict:
        o = self.optimizers
        return {"Adam": lambda m: o.Adam(0.05), "SGD(momentum)": lambda m: o.SGD(0.1, momentum=0.9)}

    def missing_gradient_cases(self):
        """Also eagerly (both runs)."""
        inners = self.missing_gradient_inners()
        return super().missing_gradient_cases() + [
            Case("Adam-none_grads-eager", inners["Adam"], variant="none_grads", mode="eager")]


class TfaDriver(OptimizerV2Driver):
    family = "tfa"

    def equivalence_inners(self) -> dict:
        o, T = self.optimizers, _tfa().optimizers

        def multi(model):  # one optimizer per layer: Adam on the first, momentum SGD on the second
            return T.MultiOptimizer([(o.Adam(0.05), model.layers[0]), (o.SGD(0.1, momentum=0.9), model.layers[1])])

        return {
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

    def mode_cases(self):
        return NotApplicable("tensorflow-addons optimizers are traced only, as before the reshape")

    def float64_cases(self):
        return NotApplicable("tensorflow-addons optimizers are compared in float32 only, as before the reshape")

    def sum_cases(self):
        return NotApplicable("tensorflow-addons: the legacy cell proves reduction='sum' for OptimizerV2")

    def schedule_cases(self):
        o, T = self.optimizers, _tfa().optimizers
        return [
            Case("CyclicalLearningRate", lambda m: o.SGD(
                T.CyclicalLearningRate(0.01, 0.3, step_size=1, scale_fn=lambda x: 1.0))),
            # RAdam's rectified branch starts once the SMA length exceeds 4
            # (update 5 with beta_2=0.999), and its warmup counts iterations.
            Case("RectifiedAdam(warmup, 6 updates)", lambda m: T.RectifiedAdam(
                0.05, total_steps=6, warmup_proportion=0.5, min_lr=0.01), updates=6),
        ]

    def fast_schedule_pair(self):
        """tfa's wrappers count iterations too: Lookahead syncing every update
        stands in for one that synced at micro-step counts."""
        o, T = self.optimizers, _tfa().optimizers
        return (Case("Lookahead", lambda m: T.Lookahead(o.Adam(0.05), sync_period=2, slow_step_size=0.5)),
                Case("fast", lambda m: T.Lookahead(o.Adam(0.05), sync_period=1, slow_step_size=0.5)))

    def ema_cases(self):
        o, T = self.optimizers, _tfa().optimizers
        return [
            Case("MovingAverage", lambda m: T.MovingAverage(o.SGD(0.1), average_decay=0.9, dynamic_decay=True)),
            Case("SWA", lambda m: T.SWA(o.SGD(0.1), start_averaging=1, average_period=2)),
        ]

    def ema_shadows(self, inner, model) -> list | None:
        """The averages of tensorflow-addons' MovingAverage and SWA."""
        if isinstance(inner, _tfa().optimizers.AveragedOptimizerWrapper):
            return [inner.get_slot(v, "average").numpy() for v in model.trainable_variables]
        return None

    def missing_gradient_inners(self) -> dict:
        return {"AdamW": lambda m: _tfa().optimizers.AdamW(weight_decay=0.1, learning_rate=0.05)}
