"""Which optimizer family an inner optimizer belongs to, and its wrapper.

One row of :data:`FAMILIES` per family: the module under
``accum_optimizer/families/`` that holds its wrapper class, and a test that
recognises the family's optimizers. A test only looks at modules that are
already imported (an optimizer instance implies its package is), so
dispatching imports nothing the user did not. A new family is one module in
``families/`` and one row here.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
from typing import Any, Callable

from accum_optimizer._packages import active_keras, keras2_packages, keras3


def _is_keras3(opt: Any) -> bool:
    keras = keras3()
    return keras is not None and isinstance(opt, keras.optimizers.Optimizer)


def _is_legacy(opt: Any) -> bool:
    for pkg in keras2_packages():
        legacy = getattr(getattr(pkg, "optimizers", None), "legacy", None)
        if legacy is not None and isinstance(opt, legacy.Optimizer):
            return True
    return False


def _is_keras2(opt: Any) -> bool:
    return any(isinstance(opt, pkg.optimizers.Optimizer) for pkg in keras2_packages()) and not _is_legacy(opt)


def _is_tf1(opt: Any) -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(opt, tf.compat.v1.train.Optimizer)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as in error messages
    module: str  # under accum_optimizer.families
    matches: Callable[[Any], bool]

    def wrapper(self) -> type:
        return importlib.import_module(f"accum_optimizer.families.{self.module}").AccumulatingOptimizer

    def loaded_wrappers(self) -> tuple:
        """The family's wrapper classes made so far (none if its module is
        not imported): its ``AccumulatingOptimizer`` and, for the Keras 2
        families, the class of every other Keras 2 package
        (``wrapper_class.made()``)."""
        module = sys.modules.get(f"accum_optimizer.families.{self.module}")
        if module is None:
            return ()
        made = getattr(getattr(module, "wrapper_class", None), "made", None)
        return (module.AccumulatingOptimizer, *(made() if made is not None else ()))


FAMILIES = [
    # TF1 first: `tf.compat.v1.train.Optimizer` shares no base class with any
    # Keras optimizer (Keras 3's, tf_keras' or OptimizerV2), so the order does
    # not change any answer (tests/core/test_dispatch.py::test_tf1_and_keras_families_do_not_overlap
    # checks both ways); the check is cheap and imports nothing.
    Family("TF1 (tf.compat.v1.train.Optimizer)", "tf1", _is_tf1),
    Family("Keras 3 (keras.optimizers.Optimizer)", "keras3", _is_keras3),
    # Before any Keras 2 new-API row: legacy optimizers are Keras 2 optimizers too.
    Family("Keras 2 legacy OptimizerV2 and tensorflow-addons (tf.keras.optimizers.legacy.Optimizer)",
           "legacy", _is_legacy),
    Family("Keras 2 (tf_keras.optimizers.Optimizer, or tf.keras.optimizers.Optimizer on TF <= 2.15)", "keras2", _is_keras2),
]


def resolve_identifier(identifier: Any) -> Any:
    """A string or config dict resolved by the active Keras'
    ``optimizers.get``.

    Raises:
        ValueError: the active Keras cannot resolve it.
    """
    kind, package = active_keras()
    try:
        # optimizers.get edits a config dict in place: pass a copy.
        resolved = package.optimizers.get(copy.deepcopy(identifier))
        if kind == "keras2" and isinstance(resolved, str):
            # Keras 2's optimizers.get returns the bare class name for a
            # current-format config of a class missing from its lookup table
            # (AdamW in 2.15, Lion, Adafactor); its saving API resolves it.
            resolved = package.saving.deserialize_keras_object(copy.deepcopy(identifier))
        return resolved
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"`inner_optimizer` could not be resolved by {package.__name__}.optimizers.get "
            f"(the active tf.keras). Received: inner_optimizer={identifier!r}. ({e})"
        ) from None


def family_of(inner_optimizer: Any) -> Family:
    """The family of an optimizer instance.

    Raises:
        TypeError: it belongs to no supported family (names the type
            received and the supported families).
    """
    for family in FAMILIES:
        if family.matches(inner_optimizer):
            return family
    kind = type(inner_optimizer)
    supported = "; ".join(f.name for f in FAMILIES)
    raise TypeError(
        "`inner_optimizer` must be an optimizer of a supported family "
        f"({supported}), or an identifier such as 'adam' that the active "
        "Keras' optimizers.get resolves. Received: inner_optimizer="
        f"{inner_optimizer!r} of type {kind.__module__}.{kind.__qualname__}."
    )


def subclass_family() -> Family:
    """The family whose wrapper a subclass of the public
    ``AccumulatingOptimizer`` subclasses: Keras 3's where ``tf.keras`` is
    Keras 3, the Keras 2 new API's where it is Keras 2."""
    kind, _ = active_keras()
    return next(f for f in FAMILIES if f.module == ("keras3" if kind == "keras3" else "keras2"))


def loaded_wrappers() -> tuple:
    """The wrapper classes of the families imported so far (one per Keras 2
    package for the Keras 2 families)."""
    return tuple(w for f in FAMILIES for w in f.loaded_wrappers())


def register_active_families() -> None:
    """Import (and so register with Keras' serialization) the wrappers of the
    active Keras: Keras 3's when ``tf.keras`` is Keras 3 or Keras 3 is
    already imported; the Keras 2 families' when ``tf.keras`` is Keras 2."""
    kind, package = active_keras()
    wanted = {"keras3"} if kind == "keras3" or keras3() is not None else set()
    if kind == "keras2":
        wanted |= {"keras2", "legacy"}
    for family in FAMILIES:
        if family.module in wanted:
            family.wrapper()
    if "keras3" in wanted:
        # CountedLoss, registered for load_model of a model compiled with it.
        importlib.import_module("accum_optimizer.families.keras3_fit")
        # accum_optimizer.layers.BatchNormalization, for load_model.
        importlib.import_module("accum_optimizer.layers._keras3")
    if kind == "keras2":
        importlib.import_module("accum_optimizer.families.keras2_fit").counted_loss_class(package)
        importlib.import_module("accum_optimizer.layers._keras2").batch_normalization_class(package)
