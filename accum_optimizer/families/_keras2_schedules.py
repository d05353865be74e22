"""``gradient_accumulation_steps`` schedules in the configs of the Keras 2
families (:mod:`~accum_optimizer.families.keras2`,
:mod:`~accum_optimizer.families.legacy`): what the Keras 3 family's
``_serialize_schedule`` does, with the Keras 2 package's registry."""

from __future__ import annotations

from typing import Any


def serialize_schedule(package: Any, steps: Any) -> Any:
    """``gradient_accumulation_steps`` for ``get_config``: an int or a dict
    as is (JSON turns its keys into strings, which the constructor
    accepts), a callable only if it is registered with ``package``
    (``package.saving.register_keras_serializable``).

    Raises:
        ValueError: an unregistered callable.
    """
    if isinstance(steps, (int, dict)):
        return steps
    name = package.saving.get_registered_name(steps)
    if package.saving.get_registered_object(name) is not steps:
        raise ValueError(
            "Cannot serialize AccumulatingOptimizer: its gradient_accumulation_steps "
            f"is the callable {steps!r}, which is not a registered Keras object. "
            f"Register it with @{package.__name__}.saving.register_keras_serializable(), "
            "or use a dict schedule {first_update: N, ...}, which serializes as is."
        )
    return package.saving.serialize_keras_object(steps)


def deserialize_schedule(package: Any, config: dict, custom_objects: Any = None) -> dict:
    """``config`` with a serialized callable schedule (a dict with
    ``"class_name"``, from :func:`serialize_schedule`) turned back into it."""
    steps = config.get("gradient_accumulation_steps")
    if isinstance(steps, dict) and "class_name" in steps:
        config = dict(config)
        config["gradient_accumulation_steps"] = package.saving.deserialize_keras_object(
            steps, custom_objects=custom_objects
        )
    return config
