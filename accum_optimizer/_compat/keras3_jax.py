"""Keras 3's private symbols used on the JAX backend only (the train step of
:class:`accum_optimizer.OneReductionPerWindow`), each declared once.

Apart from :mod:`accum_optimizer._compat.keras3` because they exist only
where Keras runs on JAX (``keras.src.backend.jax.trainer.JAXTrainer``): this
module raises ``ImportError`` on another backend (``python -m
accum_optimizer._compat`` then leaves it out), and
:mod:`accum_optimizer.families.keras3_jax` imports it only in the train step.
Checked on Keras 3.15.1 with JAX 0.10.2; ``tests/backends/test_jax_reduction.py``
resolves each record in the k3-jax leg.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras

from accum_optimizer._compat import private, require
from accum_optimizer._compat.keras3 import _reads

if keras.backend.backend() != "jax":
    raise ImportError(f"{__name__}: Keras' JAX trainer only; the Keras backend here is {keras.backend.backend()!r}")

CHECKED = "Keras 3.15.1 (JAX 0.10.2)"

FORWARD_LOSSES = private(
    "keras.Layer._losses_override and keras.Layer._call_has_training_arg",
    "keras",
    "the JAX trainer's compute_loss_and_updates hands the losses of a stateless forward pass "
    "(activity regularizers, add_loss) to compute_loss through _losses_override, and passes "
    "`training` only to a call that takes it; a train step that runs the forward pass per device "
    "does the same (no public API hands a stateless pass's losses to compute_loss)",
    CHECKED,
    lambda k: _reads(k.Layer.__init__, "_losses_override")
    and _reads(k.Layer.__init__, "_call_has_training_arg"),
)


def call_kwargs(model: Any, training: bool) -> dict:
    """``{"training": training}`` if ``model.call`` takes ``training``, else ``{}``
    (what the JAX trainer passes)."""
    require(FORWARD_LOSSES, keras)
    return {"training": training} if model._call_has_training_arg else {}


@contextlib.contextmanager
def forward_losses(model: Any, losses: list):
    """Within: ``model.losses`` is ``losses`` (those of a stateless forward
    pass), as in the JAX trainer's ``compute_loss_and_updates``."""
    require(FORWARD_LOSSES, keras)
    if not losses:
        yield
        return
    model._losses_override.clear()
    model._losses_override = losses
    try:
        yield
    finally:
        model._losses_override.clear()


UPDATE_METRICS_VARIABLES = private(
    "keras.src.backend.jax.trainer.JAXTrainer._update_metrics_variables",
    "keras",
    "the JAX trainer's train_step updates the loss tracker and the compiled metrics through it "
    "(the loss tracker, `_loss_tracker`, is private too); a train step of our own that keeps "
    "fit's logs calls the same method",
    CHECKED,
    lambda k: __import__("keras.src.backend.jax.trainer", fromlist=["JAXTrainer"]).JAXTrainer._update_metrics_variables,
)


def update_metrics_variables(model: Any, metrics_variables: list, loss: Any, x: Any, y: Any, y_pred: Any,
                             sample_weight: Any) -> tuple:
    """``(logs, metrics_variables)`` after the loss tracker and the compiled
    metrics saw this step, as the JAX trainer's ``train_step`` computes them."""
    require(UPDATE_METRICS_VARIABLES, keras)
    return model._update_metrics_variables(metrics_variables, loss, x, y, y_pred, sample_weight)
