"""What the two Keras 2 families (:mod:`~accum_optimizer.families.keras2`,
:mod:`~accum_optimizer.families.legacy`) share: one wrapper class per Keras 2
package.

Keras 2 is ``tf_keras`` (TF >= 2.16) or the ``keras`` 2.x of TF <= 2.15; both
can be imported in one process. A wrapper must be an instance of its inner
optimizer's package's ``Optimizer`` (that package's ``compile``,
``LossScaleOptimizer`` and saving accept nothing else), so each family
builds one class per package (:func:`wrapper_classes`), registered with that
package's serialization; ``__new__`` hands an inner optimizer of another
package to that package's class (:class:`PerPackage`).
"""

from __future__ import annotations

from typing import Any, Callable

from accum_optimizer import _args, _compat, _packages, core
from accum_optimizer._packages import active_keras, keras2_packages
from accum_optimizer.families._tf_backend import validate_accumulator_dtype


def package_of(optimizer: Any, base_of: Callable[[Any], Any]) -> Any:
    """The imported Keras 2 package whose ``base_of(package)`` class
    ``optimizer`` is an instance of, or ``None``."""
    for package in keras2_packages():
        base = base_of(package)
        if base is not None and isinstance(optimizer, base):
            return package
    return None


def primary_package(family: str) -> Any:
    """The Keras 2 package a family's module-level class is built on: the
    active ``tf.keras`` if it is Keras 2, else an imported Keras 2 package
    (``tf_keras`` first), else ``tf_keras`` if it imports.

    Raises:
        ImportError: no Keras 2 package is available.
    """
    kind, package = active_keras()
    if kind == "keras2":
        return package
    imported = keras2_packages()
    if imported:
        return imported[0]
    try:
        import tf_keras

        return tf_keras
    except ImportError:
        raise ImportError(
            f"accum_optimizer.families.{family} needs Keras 2: tf.keras on "
            "TensorFlow <= 2.15, or the tf_keras package (pip install tf_keras, "
            "with TF_USE_LEGACY_KERAS=1 to make it tf.keras)."
        ) from None


def by_registered_name(package: Any, config: Any, custom_objects: Any = None) -> Any:
    """A copy of a serialized object (``serialize``'s dict, nested ones
    included) in which each object saved with a registered name (its
    ``"registered_name"``, e.g. ``"Addons>AdamW"``, other than its
    ``"class_name"``) that ``package`` or ``custom_objects`` resolve is
    named by it in ``"class_name"``.

    Keras 2 writes a nested object's config in the current format
    (``class_name``, ``module``, ``registered_name``) even into an ``.h5``
    file, but its ``.h5`` loader resolves the config by ``class_name`` alone
    (the legacy deserializer), where a registered class is not found; its
    current deserializer looks the registered name up first, so the
    renamed config resolves in both."""
    if isinstance(config, (list, tuple)):
        return [by_registered_name(package, c, custom_objects) for c in config]
    if not isinstance(config, dict):
        return config
    renamed = {k: by_registered_name(package, v, custom_objects) for k, v in config.items()}
    name = renamed.get("registered_name")
    if (isinstance(name, str) and "class_name" in renamed and name != renamed["class_name"]
            and package.saving.get_registered_object(name, custom_objects=custom_objects) is not None):
        renamed["class_name"] = name
    return renamed


class PerPackage(_compat.ForwardsSettings):
    """Mixin: an inner optimizer of another imported Keras 2 package than the
    class' own (``tf_keras`` beside TF 2.15's ``keras``) gets that package's
    wrapper class. The inner optimizer's settings (clipping, hyperparameters)
    read and assigned through the wrapper reach the inner optimizer
    (:class:`accum_optimizer._compat.ForwardsSettings`)."""

    _keras: Any = None  # the class' Keras 2 package (set by `wrapper_classes`)
    # Keras 2 restores checkpoints lazily and by name: `mini_step` starts
    # "unknown" and is derived before each micro-step and flush.
    _resumes_position = True
    _wrapper_class: Callable[[Any], type]
    _base_of: Callable[[Any], Any]
    _NONFINITE = core.NONFINITE_POLICIES

    def _check_accumulator_dtype(self, value: Any) -> str | None:
        return validate_accumulator_dtype(value)

    def _keep_numerics(self, args: _args.Arguments) -> None:
        """Keep the non-finite policy and the accumulator dtype (``None``
        skip counters until :meth:`build`)."""
        self.nonfinite = args.nonfinite
        self.accumulator_dtype = args.accumulator_dtype
        self.skipped_micro_steps = self.skipped_windows = self.window_poisoned = None

    def _accumulator_dtype(self, variable: Any) -> str:
        """The accumulator's dtype for ``variable`` (by its ``true_dtype``
        under a mixed-precision policy): by default the variable's, as in
        earlier versions, whose checkpoints must restore (a float16
        accumulator does not restore into a float32 one)."""
        dtype = getattr(variable, "true_dtype", variable.dtype)
        return _args.accumulator_dtype_for(dtype.base_dtype.name, self.accumulator_dtype, widen=False)

    def _numerics_config(self) -> dict:
        return {"nonfinite": self.nonfinite, "accumulator_dtype": self.accumulator_dtype}

    def __new__(cls, inner_optimizer: Any = _args.REQUIRED, *args: Any, **kwargs: Any) -> Any:
        package = package_of(inner_optimizer, cls._base_of)
        if package is not None and package is not cls._keras:
            return cls._wrapper_class(package)(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    # What the family's inner optimizers are, for messages: "a {_KIND}
    # instance ({package}.{_API}.Optimizer, e.g. {package}.{_API}.Adam(){_ALSO})".
    _KIND: str
    _API: str
    _ALSO = ""
    _GET_ARGUMENTS = ""  # shown after `optimizers.get`

    @staticmethod
    def _resolve(package: Any, identifier: Any) -> Any:
        """An optimizer of ``package`` from a name or config dict."""
        raise NotImplementedError

    def _inner_spec(self) -> _args.InnerSpec:
        package, name = self._keras, self._keras.__name__
        return _args.InnerSpec(
            f"a {self._KIND} instance (`{name}.{self._API}.Optimizer`, e.g. {name}.{self._API}.Adam(){self._ALSO})",
            self._base_of(package),
            lambda identifier: self._resolve(package, identifier),
            f"{name}.optimizers.get{self._GET_ARGUMENTS}",
            getattr(getattr(package, "mixed_precision", None), "LossScaleOptimizer", ()),
        )

    def _inner_example(self) -> str:
        return f"{self._keras.__name__}.{self._API}.Adam"

    # The inner optimizer clips the window gradient at each update; the
    # wrapper never clips (its base class' own clip settings would be unused
    # defaults).
    clipnorm = _args.forwarded("clipnorm")
    global_clipnorm = _args.forwarded("global_clipnorm")
    clipvalue = _args.forwarded("clipvalue")

    @property
    def lr(self) -> Any:
        """Alias of ``learning_rate``: what Keras 2 callbacks
        (``LearningRateScheduler``, ``ReduceLROnPlateau``) read and assign."""
        return self.inner_optimizer.learning_rate

    @lr.setter
    def lr(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate


def wrapper_classes(
    mixins: tuple, base_of: Callable[[Any], Any], registered_name: str, module: str, doc: str | None
) -> Callable[[Any], type]:
    """``wrapper_class(package)``: the ``AccumulatingOptimizer`` class of a
    family for one Keras 2 package, a subclass of ``mixins`` and
    ``base_of(package)``, registered with that package's
    ``register_keras_serializable(package="accum_optimizer", name=registered_name)``;
    one class per package (cached). ``wrapper_class.made()``: the classes
    made so far (what ``isinstance(x, accum_optimizer.AccumulatingOptimizer)``
    checks)."""
    def make(package: Any) -> type:
        return type("AccumulatingOptimizer", (*mixins, base_of(package)), {
            "__module__": module, "__qualname__": "AccumulatingOptimizer", "__doc__": doc,
            "_keras": package, "_wrapper_class": staticmethod(wrapper_class),
            "_base_of": staticmethod(base_of),
        })

    def wrapper_class(package: Any) -> type:
        return _packages.per_package_class(registered_name, package, make, registered_name)

    wrapper_class.made = lambda: _packages.per_package_classes(registered_name)  # type: ignore[attr-defined]
    return wrapper_class
