"""Which optimizer families this environment can test, and module-level guards.

Each test module names the family it needs on its first lines, before it
imports Keras::

    from support.families import require

    require("keras3")  # skips the whole module, with the reason, elsewhere

    import keras

so that one test tree runs in every leg of ``make test`` (see .ci/legs.py):
a module whose family is absent is *skipped with a reason* (``pytest -ra``
lists it), never an import error. Families:

``keras3``
    ``import keras`` is Keras 3 on the TensorFlow backend and ``tf.keras`` is
    that Keras (``TF_USE_LEGACY_KERAS`` not set). Legs ``k3``, ``k3-oldest``.
``keras2``
    ``tf.keras`` is Keras 2: ``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``
    (TF >= 2.16), or TF <= 2.15's own Keras. Legs ``tfkeras``, ``tf215``.
``legacy``
    ``keras2`` and ``tf.keras.optimizers.legacy`` (the ``OptimizerV2``
    classes). Legs ``tfkeras``, ``tf215``.
``tfa``
    ``keras2`` and ``tensorflow_addons`` imports. Leg ``tf215``.
``tf1``
    ``tf.compat.v1.train.Optimizer``. Every leg.

The probes import TensorFlow (and Keras) but nothing of ``accum_optimizer``.
"""

from __future__ import annotations

import functools
import os

import pytest

FAMILIES = ("keras3", "keras2", "legacy", "tfa", "tf1")

# Where each family is tested, for the skip reasons.
_LEGS = {
    "keras3": "the k3 and k3-oldest legs",
    "keras2": "the tfkeras and tf215 legs",
    "legacy": "the tfkeras and tf215 legs",
    "tfa": "the tf215 leg",
    "tf1": "every leg",
}


def legacy_keras_requested() -> bool:
    """``TF_USE_LEGACY_KERAS`` as TensorFlow reads it (``tf.keras`` -> ``tf_keras``)."""
    return os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1")


def tf_keras_version() -> str:
    """Version of the Keras that ``tf.keras`` resolves to (raises if it cannot load).

    ``tf.keras`` itself has no ``__version__`` under tf_keras or Keras 3.0,
    so ask the package its ``Layer`` class comes from (``keras`` or ``tf_keras``).
    """
    import importlib

    import tensorflow as tf

    package = tf.keras.layers.Layer.__module__.split(".")[0]
    return str(importlib.import_module(package).__version__)


@functools.cache
def why_not(family: str) -> str | None:
    """``None`` if ``family`` is usable here, else the reason it is not."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    try:
        return _probe(family)
    except Exception as e:  # a broken install is a reason too, not a crash at collection
        return f"probing it raised {type(e).__name__}: {e}"


def _probe(family: str) -> str | None:
    import tensorflow as tf

    if family == "tf1":
        if not hasattr(tf.compat.v1.train, "Optimizer"):
            return f"TensorFlow {tf.__version__} has no tf.compat.v1.train.Optimizer"
        return None

    if family == "keras3":
        import keras

        if not keras.__version__.startswith("3."):
            return f"`import keras` is Keras {keras.__version__} here (TensorFlow {tf.__version__}), not Keras 3"
        if legacy_keras_requested():
            return "TF_USE_LEGACY_KERAS=1 makes tf.keras tf_keras (Keras 2) here"
        if keras.backend.backend() != "tensorflow":
            return f"Keras runs the {keras.backend.backend()!r} backend here, not 'tensorflow'"
        return None

    # keras2, legacy, tfa: all need tf.keras to be Keras 2.
    version = tf_keras_version()
    if not version.startswith("2."):
        return f"tf.keras is Keras {version} here (TensorFlow {tf.__version__}), not Keras 2"
    if family == "keras2":
        return None
    if family == "legacy":
        if not hasattr(getattr(tf.keras.optimizers, "legacy", None), "Optimizer"):
            return f"tf.keras {version} has no tf.keras.optimizers.legacy.Optimizer"
        return None
    # tfa
    try:
        import tensorflow_addons  # noqa: F401
    except ImportError as e:
        return f"tensorflow_addons does not import here ({e})"
    return None


def available(family: str) -> bool:
    return why_not(family) is None


def keras_module():
    """The Keras this leg's Keras families use: ``import keras`` where the
    keras3 family is usable, else ``tf.keras`` (Keras 2: tf_keras under
    ``TF_USE_LEGACY_KERAS=1``, where ``import keras`` is still Keras 3, or
    TF 2.15's own Keras)."""
    if available("keras3"):
        import keras

        return keras
    import tensorflow as tf

    return tf.keras


def skip_reason(family: str) -> str | None:
    """The full skip message, or ``None`` if ``family`` is usable."""
    reason = why_not(family)
    if reason is None:
        return None
    return f"needs {family}: {reason}; {family} is tested in {_LEGS[family]}"


def require(*families: str) -> None:
    """At module level: skip the whole module unless every family is usable."""
    __tracebackhide__ = True  # report the skip at the test module's line, not here
    for family in families:
        reason = skip_reason(family)
        if reason is not None:
            pytest.skip(reason, allow_module_level=True)


def requires(*families: str) -> pytest.MarkDecorator:
    """``@requires("tfa")`` on one test or class: skip it unless every family is usable."""
    reasons = [r for r in map(skip_reason, families) if r is not None]
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))


def require_keras3_backend(backend: str):
    """Skip the calling module, with the reason, unless ``import keras`` is
    Keras 3 on ``backend`` (``KERAS_BACKEND``: the k3-jax and k3-torch
    legs); else return the ``keras`` module."""
    keras = pytest.importorskip("keras")
    here = getattr(keras.backend, "backend", lambda: "tensorflow")()
    if not keras.__version__.startswith("3.") or here != backend:
        pytest.skip(f"needs Keras 3 on {backend} (KERAS_BACKEND={backend}, the k3-{backend} leg); this is Keras "
                    f"{keras.__version__} on {here}", allow_module_level=True)
    return keras
