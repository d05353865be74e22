"""Which Keras and TensorFlow packages are imported or active.

A leaf module (it imports nothing of this package): the dispatcher and the
families both ask it. Looking only at ``sys.modules`` means asking imports
nothing the user did not, except :func:`active_keras`, which imports
the active Keras (and TensorFlow, if installed, to resolve ``tf.keras``,
unless Keras 3 runs on JAX or torch).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def major(module: Any) -> int:
    """The major version of a module's ``__version__`` (0 if unknown)."""
    try:
        return int(str(getattr(module, "__version__", "0")).split(".")[0])
    except ValueError:  # pragma: no cover - odd version strings
        return 0


def keras3() -> Any:
    """The Keras 3 package, if it is imported."""
    keras = sys.modules.get("keras")
    return keras if keras is not None and major(keras) >= 3 else None


def keras2_packages() -> list:
    """Imported Keras 2 packages: ``tf_keras``, and ``keras`` 2.x (TF <= 2.15)."""
    found = []
    for name in ("tf_keras", "keras"):
        module = sys.modules.get(name)
        if module is not None and major(module) == 2:
            found.append(module)
    return found


def tensorflow() -> Any:
    """TensorFlow, if it is imported."""
    return sys.modules.get("tensorflow")


def legacy_keras_requested() -> bool:
    """Is ``TF_USE_LEGACY_KERAS`` set so that ``tf.keras`` is ``tf_keras``
    (the values TensorFlow itself accepts: ``1``, ``true``, ``True``)?"""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True")


def keras3_backend() -> str | None:
    """The backend of Keras 3 (``"tensorflow"``, ``"jax"``, ``"torch"``, ...)
    if it is installed, else ``None``. Imports Keras (Keras 3 imports its
    backend only: not TensorFlow on JAX or torch)."""
    try:
        import keras
    except ImportError:
        return None
    return keras.backend.backend() if major(keras) >= 3 else None


def keras3_off_tensorflow() -> Any:
    """Keras 3, if it runs on another backend than TensorFlow (JAX, torch)
    and ``TF_USE_LEGACY_KERAS`` does not ask for ``tf_keras``, and TensorFlow
    is not imported; else ``None``. Imports nothing unless TensorFlow is
    not imported and ``tf_keras`` is not asked for (then Keras:
    :func:`keras3_backend`)."""
    if "tensorflow" in sys.modules or legacy_keras_requested():
        return None
    if keras3_backend() in (None, "tensorflow"):
        return None
    return sys.modules["keras"]


class NoFrameworkError(ImportError):
    """Neither Keras 3 nor TensorFlow is installed (raised by
    :func:`active_keras`; an ``ImportError``)."""


def active_keras() -> tuple[str, Any]:
    """``("keras3" | "keras2", package)``: the Keras that ``tf.keras`` is.

    ``tf.keras`` is Keras 3 on TF >= 2.16 unless ``TF_USE_LEGACY_KERAS`` is
    set (then ``tf_keras``), and Keras 2 on TF <= 2.15. Resolving it imports
    only that Keras. Keras 3 on another backend than TensorFlow (JAX,
    torch; ``KERAS_BACKEND``) with ``TF_USE_LEGACY_KERAS`` unset: Keras 3,
    without importing TensorFlow even where it is installed (unless it is
    imported already). Without TensorFlow: Keras 3.

    Raises:
        NoFrameworkError: neither TensorFlow nor Keras is installed.
        ImportError: ``import keras`` is Keras 2 and TensorFlow is not installed.
    """
    keras = keras3_off_tensorflow()
    if keras is not None:
        return "keras3", keras
    try:
        import tensorflow as tf
    except ImportError:
        try:
            import keras
        except ImportError:
            raise NoFrameworkError(
                "accum_optimizer needs Keras 3 (pip install 'accum-optimizer[keras3]' and a backend: "
                "jax, torch or tensorflow) or TensorFlow (pip install 'accum-optimizer[tensorflow]'); "
                "neither is installed."
            ) from None
        if major(keras) < 3:
            raise ImportError(f"`import keras` is Keras {keras.__version__} and TensorFlow is not installed.")
        return "keras3", keras

    top = tf.keras.optimizers.Optimizer.__module__.split(".")[0]
    package = sys.modules[top]
    return ("keras3" if major(package) >= 3 else "keras2"), package


def version(package: str) -> str:
    """The installed version of a package (``"not installed"`` if absent)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


_PER_PACKAGE: dict[tuple[str, str], type] = {}


def per_package_class(kind: str, package: Any, make: Any, registered_name: str | None = None) -> type:
    """The class ``kind`` for one Keras 2 package (``keras`` 2.x or
    ``tf_keras``): ``make(package)``, once per package (cached), and where
    ``registered_name`` is given registered with that package's
    ``register_keras_serializable(package="accum_optimizer", name=registered_name)``
    (what ``"accum_optimizer>..."`` in a saved config finds). Each Keras 2
    package has its own base classes, so each gets its own subclass."""
    key = (kind, package.__name__)
    cls = _PER_PACKAGE.get(key)
    if cls is None:
        cls = make(package)
        if registered_name is not None:
            cls = package.utils.register_keras_serializable(package="accum_optimizer", name=registered_name)(cls)
        _PER_PACKAGE[key] = cls
    return cls


def per_package_classes(kind: str) -> tuple:
    """The classes :func:`per_package_class` made for ``kind`` so far."""
    return tuple(cls for (k, _), cls in _PER_PACKAGE.items() if k == kind)
