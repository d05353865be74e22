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
    MIRRORED = (4, 8, 2, 2, 1e-2)
    BASE_ARGUMENTS = KerasDriver.BASE_ARGUMENTS + (("jit_compile", False),)
    BASE_DEFAULTS = {**KerasDriver.BASE_DEFAULTS, "weight_decay": 0, "jit_compile": True, "is_legacy_optimizer": False}
    #: The embedding's rows in :meth:`mirrored_model`: >= the 96 ids of one window.
    VOCAB = 120

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

    def mirrored_cases(self) -> list:
        """Keras 2 clips after its all-reduce, on the global gradient, so
        clipping is compared with the single device too. It clips before it
        merges repeated ids of an IndexedSlices gradient, so the norm it clips
        the sparse reference by counts a repeated id's rows separately, unlike
        the norm of the (dense) window gradient; the clipping case therefore
        uses data whose windows repeat no id (``variant="unique_ids"``)."""
        return [Case("adam_global_clipnorm", lambda m: self.optimizers.Adam(1e-2, global_clipnorm=0.05),
                     variant="unique_ids"),
                Case("adamw_ema_schedule", self.adamw_ema_schedule)]

    def mirrored_model(self, case=None, seed=0):
        """An embedding (sparse gradients, scatter-added into ON_READ slots)
        and a dense head."""
        keras = self.keras
        keras.utils.set_random_seed(seed)
        ids = keras.Input((3,), dtype="int32")
        feats = keras.Input((6,))
        emb = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(self.VOCAB, 4)(ids))
        h = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([emb, feats]))
        return keras.Model([ids, feats], keras.layers.Dense(3)(h))

    def mirrored_data(self, case, n, seed=1):
        """``((ids, feats), y)``; with ``case.variant == "unique_ids"`` no id
        twice in one window of N*B samples (nor so in any of its
        micro-batches), so no IndexedSlices holds repeated indices."""
        feats, y = self.R.make_data(n, seed=seed)
        rng = np.random.default_rng(seed)
        if case is not None and case.variant == "unique_ids":
            window = self.MIRRORED[0] * self.MIRRORED[1]
            ids = np.concatenate([rng.permutation(self.VOCAB)[: window * 3] for _ in range(n // window)])
            ids = ids.reshape(n, 3).astype("int32")
        else:
            ids = rng.integers(0, self.VOCAB, size=(n, 3)).astype("int32")
        return (ids, feats), y

    def mirrored_reductions(self, case, x, y, strategy, counter):
        """One gradient all-reduce per update, none on the other micro-steps
        (the update branch is traced once, so the counter counts executions)."""
        return self.MIRRORED[2] * self.MIRRORED[3]

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
