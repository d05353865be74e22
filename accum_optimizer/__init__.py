"""Gradient accumulation for TensorFlow and Keras that trains like the large batch.

    from accum_optimizer import AccumulatingOptimizer
    opt = AccumulatingOptimizer(keras.optimizers.AdamW(1e-3), gradient_accumulation_steps=8)

``AccumulatingOptimizer(inner_optimizer, ...)`` returns the wrapper of the
inner optimizer's family (the way ``pathlib.Path(...)`` returns a
``PosixPath``), an instance of that family's optimizer base class; the family
classes live in :mod:`accum_optimizer.families`. Importing this package
registers the wrappers of the active Keras with its serialization, so
``load_model`` needs no ``custom_objects``. Without Keras 3 or TensorFlow
the import succeeds (:mod:`accum_optimizer.core` needs no framework) and the
first use of a wrapper raises ``ImportError`` naming what to install.
"""

from __future__ import annotations

from typing import Any

from accum_optimizer import _args, _dispatch, _packages

__all__ = [
    "AccumulatingOptimizer", "CountedLoss", "FlushPartialWindow", "OneReductionPerWindow", "device_value_and_grad",
    "__version__",
]
__version__ = "0.2.0.dev0"


class _DispatchByFamily(type):
    """``AccumulatingOptimizer(...)`` builds the family's wrapper;
    ``isinstance(x, AccumulatingOptimizer)`` holds for every family's; and
    ``class Mine(AccumulatingOptimizer)`` subclasses the active Keras'
    family class (Keras 3's where ``tf.keras`` is Keras 3)."""

    def __new__(mcs, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> Any:
        if not any(isinstance(b, _DispatchByFamily) for b in bases):
            return super().__new__(mcs, name, bases, namespace, **kwargs)  # the facade itself
        family = _dispatch.subclass_family()
        base = family.wrapper()
        rebased = tuple(base if isinstance(b, _DispatchByFamily) else b for b in bases)
        namespace.setdefault("__doc__", base.__doc__)
        return type(base)(name, rebased, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args and "inner_optimizer" in kwargs:
            raise TypeError(
                "AccumulatingOptimizer got `inner_optimizer` twice: as the first "
                f"positional argument ({args[0]!r}) and as a keyword "
                f"({kwargs['inner_optimizer']!r}). Pass it once."
            )
        inner_optimizer = args[0] if args else kwargs.pop("inner_optimizer", _args.REQUIRED)
        args = args[1:]
        if inner_optimizer is _args.REQUIRED:
            _args.check_arguments(inner_optimizer, None, {
                k: v for k, v in kwargs.items() if k not in _args.ARGUMENTS + _args.NUMERICS_ARGUMENTS})
        if isinstance(inner_optimizer, (str, dict)):
            inner_optimizer = _dispatch.resolve_identifier(inner_optimizer)
        return _dispatch.family_of(inner_optimizer).wrapper()(inner_optimizer, *args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _dispatch.loaded_wrappers())

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _dispatch.loaded_wrappers())


class AccumulatingOptimizer(metaclass=_DispatchByFamily):
    """Accumulate gradients over micro-batches; update once per window.

    ``AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps,
    reduction="mean", name=None)`` returns the wrapper for the family of
    ``inner_optimizer``:

    * a ``keras.optimizers.Optimizer`` (Keras 3):
      :class:`accum_optimizer.families.keras3.AccumulatingOptimizer`;
    * a ``tf.compat.v1.train.Optimizer`` (TF1 graph code):
      :class:`accum_optimizer.families.tf1.AccumulatingOptimizer`, itself a
      ``tf.compat.v1.train.Optimizer`` (``minimize``/``apply_gradients``
      return the op of one micro-step; ``global_step`` counts updates);
    * a Keras 2 legacy ``OptimizerV2`` (``tf.keras.optimizers.legacy.*`` on
      TF <= 2.15 or with ``tf_keras``) or a tensorflow-addons optimizer:
      :class:`accum_optimizer.families.legacy.AccumulatingOptimizer`;
    * a Keras 2 new-API optimizer (``tf.keras.optimizers.*`` on TF <= 2.15,
      ``tf_keras.optimizers.*``):
      :class:`accum_optimizer.families.keras2.AccumulatingOptimizer`, a
      subclass of that package's ``Optimizer``.

    A string or config dict (``"adam"``) is resolved by the active
    ``tf.keras``' ``optimizers.get``. Every wrapper takes the same arguments
    and has the same semantics; see the family class for the details.

    Subclassing: ``class MyAccumulator(accum_optimizer.AccumulatingOptimizer)``
    creates a subclass of the active Keras' family class
    (:class:`accum_optimizer.families.keras3.AccumulatingOptimizer` where
    ``tf.keras`` is Keras 3, the Keras 2 new-API class where it is Keras 2),
    so ``keras.saving.register_keras_serializable`` and ``get_config`` work
    on it; to subclass another family's wrapper, subclass that class.

    Raises:
        TypeError: ``inner_optimizer`` belongs to no supported family (the
            message names its type and the families), is given twice, or an
            argument has the wrong type.
        ValueError: an argument has a bad value (the family class lists them).
    """

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """Rebuild a wrapper from ``get_config()`` of any family's wrapper."""
        inner = config["inner_optimizer"]
        family = _dispatch.family_of(_dispatch.resolve_identifier(inner) if isinstance(inner, (str, dict)) else inner)
        return family.wrapper().from_config(config, custom_objects=custom_objects)


try:
    _dispatch.register_active_families()
except _packages.NoFrameworkError:
    # Nothing to register. The import succeeds, so that the framework-free
    # core (accum_optimizer.core, a subpackage: importing it runs this file)
    # imports anywhere; the wrappers raise this error when first asked for
    # ("adam", CountedLoss, subclassing), and an optimizer instance implies
    # its framework.
    pass


def __getattr__(name: str) -> Any:
    # The active Keras' tools (tf.keras: Keras 3, tf_keras under
    # TF_USE_LEGACY_KERAS=1, or TF <= 2.15's Keras 2), imported on first use
    # (importing the package must not import a Keras the user did not).
    if name in ("CountedLoss", "FlushPartialWindow"):
        from accum_optimizer._packages import active_keras

        kind, package = active_keras()
        if kind == "keras3":
            from accum_optimizer.families import keras3_fit

            return getattr(keras3_fit, name)
        from accum_optimizer.families import keras2_fit

        if name == "CountedLoss":
            return keras2_fit.counted_loss_class(package)
        return keras2_fit.flush_partial_window_class(package)
    if name in ("OneReductionPerWindow", "device_value_and_grad"):  # Keras 3 on JAX
        from accum_optimizer.families import keras3_jax  # (importable with any Keras; refuses at use)

        return getattr(keras3_jax, name)
    if name == "AverageModelCheckpoint":  # tensorflow-addons' callback, for the wrapper
        from accum_optimizer._compat import keras2 as keras2_compat

        return keras2_compat.average_model_checkpoint_class(_dispatch.loaded_wrappers)
    raise AttributeError(f"module 'accum_optimizer' has no attribute {name!r}")
