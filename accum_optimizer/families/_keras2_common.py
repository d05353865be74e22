"""What the two Keras 2 families (:mod:`~accum_optimizer.families.keras2`,
:mod:`~accum_optimizer.families.legacy`) share beyond the algorithm:
``gradient_accumulation_steps`` schedules in their configs (the Keras 3
family's ``_serialize_schedule``, with the Keras 2 package's registry) and
the trace-time choice of the window's normaliser under ``tf.distribute``
(the Keras 3 family's ``_weighted``)."""

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


def weighted_windows(owner: Any, weight: Any, replicas: int) -> bool:
    """Trace-time: may this window's counts differ between replicas (the
    ``weighted`` of :func:`accum_optimizer._accumulation.micro_step`)?

    Once any micro-step of ``owner`` (the wrapper; two plain attributes in
    its ``__dict__`` record what was traced) is traced with a ``weight``,
    every window closed afterwards sums the counts over replicas (one scalar
    reduction per update); before, each replica divides by its own
    micro-step count, with no reduction.

    Raises:
        ValueError: a weighted micro-step after an unweighted close was
            traced under a multi-replica strategy (that traced update would
            normalise by the micro-step count).
    """
    flags = owner.__dict__
    if weight is not None and not flags.get("_weights_seen"):
        if replicas > 1 and flags.get("_unweighted_close_traced"):
            raise ValueError(
                "AccumulatingOptimizer got a weighted micro-step (weight=) after a "
                f"train step without weights was traced under a {replicas}-replica "
                "strategy; that step's update would normalise by the micro-step "
                "count. Use weights in every train step of this optimizer "
                "(weight=1 counts like none)."
            )
        flags["_weights_seen"] = True
    weighted = bool(flags.get("_weights_seen"))
    if not weighted:
        flags["_unweighted_close_traced"] = True
    return weighted
