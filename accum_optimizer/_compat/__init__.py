"""Every private Keras / TensorFlow symbol this package touches, fenced here.

Private means: an underscore attribute of an object the package does not
own (inherited ones included), ``keras.src``, ``tensorflow.python``, frame
inspection, or patching a method onto an instance. Outside this package no
module of ``accum_optimizer`` does any of these (``tests/core/test_compat.py``
checks it), and where a public route exists it is taken instead.

One module per package, each use declared once as a :class:`Private`
record (the symbol, why no public route serves, the versions it was checked
on, and how to find it):

* :mod:`~accum_optimizer._compat.keras3`: Keras 3;
* :mod:`~accum_optimizer._compat.keras3_jax`: Keras 3's JAX trainer (imported
  on the JAX backend only);
* :mod:`~accum_optimizer._compat.keras2`: Keras 2 (``tf_keras``, Keras 2.x
  of TF <= 2.15) and its legacy ``OptimizerV2``;
* :mod:`~accum_optimizer._compat.tf`: TensorFlow, its ``tf.compat.v1``
  optimizers included.

The test ``tests/core/test_compat.py`` resolves every record in every leg
and fails, naming the symbol and the installed version, when one is missing
or changed; at run time :func:`require` raises :class:`PrivateSymbolMissing`
with the same message instead of letting a missing symbol give a wrong
result.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

from accum_optimizer import _packages


class PrivateSymbolMissing(RuntimeError):
    """A private framework symbol the package needs is missing or changed in
    the installed version (the message names both)."""


@dataclasses.dataclass(frozen=True)
class Private:
    """One private symbol in use.

    Attributes:
        symbol: where it lives, as a reader would look it up
            (``"keras.optimizers.Optimizer._var_key"``).
        distribution: the installed distribution whose version decides
            (``"keras"``, ``"tensorflow"``, ``"tf_keras"``).
        reason: why it is used: what it does for us, and why no public
            route serves.
        checked: the versions it was checked on.
        probe: ``probe(package)`` returns the symbol, or raises
            ``AttributeError``/``ImportError``/``KeyError``/``TypeError``
            when it is missing or changed; ``package`` is the imported
            framework module it belongs to (``keras``, ``tf_keras``, ...).
    """

    symbol: str
    distribution: str
    reason: str
    checked: str
    probe: Callable[[Any], Any]


REGISTRY: list[Private] = []


def private(symbol: str, distribution: str, reason: str, checked: str, probe: Callable[[Any], Any]) -> Private:
    """Declare a private symbol (at import of its compatibility module)."""
    entry = Private(symbol, distribution, reason, checked, probe)
    REGISTRY.append(entry)
    return entry


def attributes(owner: Any, *names: str) -> tuple:
    """``owner``'s attributes ``names`` (``AttributeError`` for a missing one):
    what a probe of several symbols of one class returns."""
    return tuple(getattr(owner, name) for name in names)


def require(entry: Private, package: Any) -> Any:
    """``entry``'s symbol in ``package`` (cached).

    Raises:
        PrivateSymbolMissing: it is missing or changed in the installed
            version (the message names the symbol, the reason and both
            versions).
    """
    return _resolve(entry, package)


@functools.lru_cache(maxsize=None)
def _resolve(entry: Private, package: Any) -> Any:
    try:
        return entry.probe(package)
    except (AttributeError, ImportError, KeyError, TypeError) as e:
        raise PrivateSymbolMissing(message(entry, package, e)) from None


def message(entry: Private, package: Any, error: Exception | None = None) -> str:
    """What went wrong, for :class:`PrivateSymbolMissing` and the test."""
    installed = getattr(package, "__version__", None) or _packages.version(entry.distribution)
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    return (
        f"accum_optimizer needs the private symbol {entry.symbol} of {entry.distribution} "
        f"({entry.reason}), which the installed {entry.distribution} {installed} does not "
        f"have or has changed{detail}. It was checked on {entry.checked}. Use one of those "
        "versions, or report this at the accum_optimizer issue tracker."
    )


def model_up_the_stack(optimizer: Any, model_class: type) -> Any:
    """The built ``model_class`` instance held in a frame up the stack (Keras'
    loader: ``model.load_weights``, ``saving_lib._load_state(model, ...)``)
    whose ``optimizer`` is ``optimizer`` or wraps it (a
    ``LossScaleOptimizer``'s ``inner_optimizer``), or ``None``. Only through
    a package module's declared record (``MODEL_BEING_LOADED``)."""
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, model_class) and getattr(value, "built", False):
                outer = getattr(value, "optimizer", None)
                if outer is optimizer or getattr(outer, "inner_optimizer", None) is optimizer:
                    return value
        frame = frame.f_back
    return None


# ----------------------------------------- the inner optimizer's settings
#: The types of an inner optimizer's plain settings (Adam's ``epsilon``,
#: ``amsgrad``, SGD's ``nesterov``) that :class:`ForwardsSettings` forwards.
PLAIN_SETTINGS = (bool, int, float)

#: The methods of every Keras optimizer API that apply gradients: never
#: reached on the inner optimizer through the wrapper, even where the
#: wrapper's class lacks one (called on the inner optimizer, they would
#: update the weights at every micro-step, bypassing the accumulation).
UPDATE_METHODS = frozenset({"apply", "apply_gradients", "minimize", "stateless_apply", "update_step"})


class ForwardsSettings:
    """Mixin (placed before the framework's optimizer class, whose
    ``__setattr__``/``__getattr__`` it overrides: here, in the fence): the
    inner optimizer's hyperparameters and plain settings read and assigned
    through the wrapper (``opt.beta_1``, ``opt.epsilon``,
    ``opt.amsgrad = True``), and its public methods called through it
    (tensorflow-addons' ``opt.assign_average_vars(model.variables)``), as
    user code and tests do on the optimizer they compiled with.

    A name is forwarded when it is public (no leading underscore), not the
    wrapper's own (neither an attribute of its instance nor of its class:
    every method of the framework's optimizer base class, ``apply_gradients``
    and ``minimize`` among them, stays the wrapper's) and is, on the inner
    optimizer, one of :meth:`_inner_hyperparameters` (Keras 2's legacy
    ``_hyper`` names), an instance attribute holding a ``bool``, ``int`` or
    ``float``, or a method (a callable attribute of its class) other than
    :data:`UPDATE_METHODS`, which raise ``AttributeError`` saying why. The
    inner optimizer's variables and slots are not forwarded (read them on
    ``inner_optimizer``). Assignments are forwarded only to settings, and
    only after construction, so the wrapper's own attributes never reach the
    inner optimizer."""

    def _inner_hyperparameters(self) -> Any:
        """The inner optimizer's hyperparameter names (a container)."""
        return ()

    def _forwardable(self, name: str) -> Any:
        """The inner optimizer if ``name`` is public and not the wrapper's own, else ``None``."""
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_") or name in self.__dict__ or hasattr(type(self), name):
            return None
        return inner

    def _inner_setting(self, name: str) -> Any:
        """The inner optimizer if ``name`` is one of its forwarded settings, else ``None``."""
        inner = self._forwardable(name)
        if inner is None:
            return None
        if name in self._inner_hyperparameters():
            return inner
        value = getattr(inner, "__dict__", {}).get(name)
        return inner if type(value) in PLAIN_SETTINGS else None

    def _inner_method(self, name: str) -> Any:
        """The inner optimizer if ``name`` is one of its forwarded methods, else ``None``."""
        inner = self._forwardable(name)
        if inner is None or name in UPDATE_METHODS:
            return None
        return inner if callable(getattr(type(inner), name, None)) else None

    def __getattr__(self, name: str) -> Any:
        # Reached only where the normal lookup (and the framework's own) failed.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        inner = self._inner_setting(name)
        if inner is None:
            inner = self._inner_method(name)
        if inner is None:
            if name in UPDATE_METHODS and self._forwardable(name) is not None:
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}: the inner optimizer's "
                    f"`{name}` is not reached through the wrapper, because it would update the weights at "
                    "every micro-step, bypassing the accumulation. Call the wrapper's apply_gradients or "
                    "minimize (or fit)."
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        window = self.__dict__.get("_window")
        inner = self._inner_setting(name) if window is not None and window.constructed else None
        if inner is not None:
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)
