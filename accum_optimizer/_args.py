"""Argument validation shared by every family (no framework import).

Each function names the argument, the value received and what is accepted
in the exception it raises.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import sys
import weakref
from typing import Any, Callable, Mapping, Sequence

from accum_optimizer.core.state import NONFINITE_POLICIES, REDUCTIONS
from accum_optimizer.families import _window


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()
"""Default of the wrappers' required arguments, so that a missing one gets
:func:`check_arguments`' message rather than Python's."""

ARGUMENTS = ("inner_optimizer", "gradient_accumulation_steps", "reduction", "name")
NUMERICS_ARGUMENTS = ("nonfinite", "accumulator_dtype")
KERAS_OPTIMIZER_ARGUMENTS = {
    "learning_rate": None,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
}
"""The arguments of the Keras 2 (new API) and Keras 3 ``Optimizer`` that
belong on the inner optimizer, with their defaults (a wrapper accepts them
at their defaults, so that configs written by generic code still load)."""
"""Arguments of the families that keep the state of the non-finite policies
and wider accumulators."""


def check_arguments(
    inner_optimizer: Any, gradient_accumulation_steps: Any, unknown: Mapping[str, Any],
    accepted: Sequence[str] = ARGUMENTS,
) -> None:
    """Raise ``TypeError`` for unknown keyword arguments (naming the close
    match, e.g. ``steps`` -> ``gradient_accumulation_steps``) and for a
    missing ``inner_optimizer`` or ``gradient_accumulation_steps``.
    ``accepted``: the family's arguments, for the message."""
    if unknown:
        received = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        hints = []
        for key in sorted(unknown):
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.3)
            close = close or [a for a in accepted if key in a]
            if close:
                hints.append(f"`{key}` -> `{close[0]}`")
        hint = f" Did you mean {', '.join(hints)}?" if hints else ""
        raise TypeError(
            "AccumulatingOptimizer got unexpected keyword argument(s): "
            f"{received}. Accepted: {', '.join(accepted)}.{hint}"
        )
    for arg, value in (("inner_optimizer", inner_optimizer),
                       ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if value is REQUIRED:
            raise TypeError(
                f"AccumulatingOptimizer is missing the required argument `{arg}`: "
                "AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps, "
                "reduction='mean', name=None), e.g. AccumulatingOptimizer("
                "keras.optimizers.Adam(1e-3), gradient_accumulation_steps=4)."
            )


def reject_inner_arguments(kwargs: dict, defaults: Mapping[str, Any], example: str) -> None:
    """Pop from ``kwargs`` the base-optimizer arguments that belong on the
    inner optimizer (``defaults``: their names and defaults); raise
    ``ValueError`` for one that is set to other than its default or
    ``None`` (configs written by generic code carry the defaults).
    ``example``: the inner optimizer's constructor for the message, e.g.
    ``"keras.optimizers.Adam"``."""
    for arg, default in defaults.items():
        if arg not in kwargs:
            continue
        value = kwargs.pop(arg)
        if value is not None and not _equal(value, default):
            raise ValueError(
                f"AccumulatingOptimizer does not take `{arg}` (received "
                f"{arg}={value!r}). Set it on the inner optimizer, e.g. "
                f"{example}({arg}=...), where it acts once per update on the "
                "window's gradient."
            )


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays, schedules: not a default
        return False


def validate_gradient_accumulation_steps(value: Any) -> int:
    """Return ``value`` as an ``int`` >= 1 or raise.

    Raises:
        TypeError: ``value`` is not an integer (``bool`` and ``float`` are
            rejected even when integral: ``True`` or ``4.0`` is almost always
            a mistake).
        ValueError: ``value`` < 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            "`gradient_accumulation_steps` must be a positive int (the number "
            "of micro-steps per update). Received: gradient_accumulation_steps="
            f"{value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(
            "`gradient_accumulation_steps` must be an int >= 1 (1 means no "
            f"accumulation). Received: gradient_accumulation_steps={value!r}."
        )
    return int(value)


def validate_reduction(value: Any) -> str:
    """Return ``value`` if it is one of :data:`REDUCTIONS`, else raise ValueError."""
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {REDUCTIONS}: 'mean' applies the "
            "average of the window's micro-batch gradients (equivalent to one "
            "batch of N*B samples when the loss is a mean over the batch), "
            f"'sum' applies their sum. Received: reduction={value!r}."
        )
    return value


def validate_nonfinite(value: Any, supported: Sequence[str] = NONFINITE_POLICIES) -> str:
    """Return ``value`` if it is one of ``supported`` (the policies a
    family keeps the state for), else raise ValueError."""
    if not isinstance(value, str) or value not in NONFINITE_POLICIES:
        raise ValueError(
            f"`nonfinite` must be one of {NONFINITE_POLICIES}: 'propagate' applies "
            "every micro-batch gradient as it is (a NaN or Inf reaches the "
            "weights, as in large-batch training), 'skip_micro_step' drops a "
            "micro-step whose gradients are not all finite (the window takes "
            "one more micro-batch), 'skip_window' discards the whole window "
            f"that contains one. Received: nonfinite={value!r}."
        )
    if value not in supported:
        raise ValueError(
            f"nonfinite={value!r} is not supported by this optimizer family yet "
            f"(supported: {tuple(supported)}); its wrapper does not keep the "
            "counters the skipping policies need."
        )
    return value


WIDENED_DTYPES = ("float16", "bfloat16")
"""Variable dtypes whose accumulators are float32 by default (a 16-bit
running sum stalls: in bfloat16, 256 + 1 = 256)."""


def accumulator_dtype_for(variable_dtype: str, accumulator_dtype: str | None, widen: bool = True) -> str:
    """The dtype of a variable's accumulator (names: ``"float16"``):
    ``accumulator_dtype`` if given, else (``widen``) float32 for
    :data:`WIDENED_DTYPES`, else the variable's own. The Keras 2, legacy and
    TF1 families do not widen by default: their accumulators always had the
    variable's dtype, and a checkpoint holding a float16 accumulator does not
    restore into a float32 one."""
    if accumulator_dtype is not None:
        return accumulator_dtype
    return "float32" if widen and variable_dtype in WIDENED_DTYPES else variable_dtype


def bad_accumulator_dtype(value: Any) -> ValueError:
    """The error for an ``accumulator_dtype`` that is not ``None`` or a float dtype."""
    return ValueError(
        "`accumulator_dtype` must be None (the default: the variable's dtype; "
        "float32 for float16/bfloat16 variables in the Keras 3 family) or a float "
        f"dtype such as 'float32'. Received: accumulator_dtype={value!r}."
    )


def validate_accumulation_schedule(value: Any) -> Any:
    """Return ``gradient_accumulation_steps`` in one of its accepted forms.

    Accepted: an ``int >= 1`` (returned as ``int``); a dict
    ``{first_update: N, ...}`` (piecewise constant over updates; int keys
    strictly ascending from 0, int values >= 1; returned as a new dict with
    ``int`` keys and values; string keys of digits, as JSON turns them, are
    accepted); a callable ``update_index -> N`` (returned as is; it receives
    the window's first update index as an int64 scalar tensor and returns an
    int or an integer scalar tensor >= 1, checked when the step runs).

    Raises:
        TypeError: not an int, dict or callable; a dict key or value that is
            not an int (``bool`` and ``float`` are rejected).
        ValueError: N < 1; keys not starting at 0 or not strictly ascending
            (in the order given: ``{0: 1, 30: 2, 20: 4}`` is rejected, not
            sorted); an empty dict.
    """
    if callable(value) and not isinstance(value, dict):
        return value
    if not isinstance(value, dict):
        return validate_gradient_accumulation_steps(value)
    if not value:
        raise ValueError(
            "`gradient_accumulation_steps` as a schedule must map the first "
            "update of each phase to its N, starting at update 0, e.g. "
            "{0: 1, 1000: 4}. Received an empty dict."
        )
    schedule: dict[int, int] = {}
    previous = None
    for key, steps in value.items():
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral):
            raise TypeError(
                "`gradient_accumulation_steps` schedule keys must be ints (the "
                f"first update of each phase). Received key {key!r} of type "
                f"{type(key).__name__} (value {steps!r})."
            )
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
            raise TypeError(
                "`gradient_accumulation_steps` schedule values must be ints >= 1 "
                f"(micro-steps per update). Received {{{key!r}: {steps!r}}}: "
                f"a value of type {type(steps).__name__}."
            )
        if steps < 1:
            raise ValueError(
                "`gradient_accumulation_steps` schedule values must be >= 1. "
                f"Received {{{key!r}: {steps!r}}}."
            )
        if previous is None and key != 0:
            raise ValueError(
                "`gradient_accumulation_steps` schedule must start at update 0 "
                f"(the N of the first window). Received first key {key!r} "
                f"(value {steps!r})."
            )
        if previous is not None and key <= previous:
            raise ValueError(
                "`gradient_accumulation_steps` schedule keys must be strictly "
                f"ascending, in the order given. Received key {key!r} (value "
                f"{steps!r}) after key {previous!r}."
            )
        schedule[int(key)] = int(steps)
        previous = key
    return schedule


def accumulates(steps: Any, nonfinite: str = "propagate") -> bool:
    """Whether micro-steps go through windows (else: the pass-through, N = 1
    without a skipping policy)."""
    return not isinstance(steps, int) or steps > 1 or nonfinite != "propagate"


def resolve_identifier(identifier: Any, resolve: Callable[[Any], Any], resolver: str) -> Any:
    """``resolve(identifier)`` for a name or config dict (``"adam"``),
    ``identifier`` itself otherwise.

    Raises:
        ValueError: ``resolve`` cannot resolve it (the message names
            ``resolver``, e.g. ``"keras.optimizers.get"``).
    """
    if not isinstance(identifier, (str, dict)):
        return identifier
    try:
        return resolve(identifier)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"`inner_optimizer` could not be resolved by {resolver}. Received: "
            f"inner_optimizer={identifier!r}. ({e})"
        ) from None


@dataclasses.dataclass(frozen=True)
class InnerSpec:
    """What a family's inner optimizer is.

    Attributes:
        kind: what is accepted, for messages ("a Keras 3 optimizer instance
            (`keras.optimizers.Optimizer`, e.g. keras.optimizers.Adam())").
        base: the family's optimizer class(es).
        resolve: turns a name or config dict (``"adam"``) into an optimizer,
            or ``None`` where the family takes instances only.
        resolver: what ``resolve`` is, for messages (``"keras.optimizers.get"``).
        loss_scale: the family's ``LossScaleOptimizer`` class(es), refused
            inside (the loss scaling goes outside).
    """

    kind: str
    base: Any
    resolve: Callable[[Any], Any] | None = None
    resolver: str = ""
    loss_scale: Any = ()


def resolve_inner(inner_optimizer: Any, spec: InnerSpec) -> Any:
    """The inner optimizer: ``inner_optimizer`` resolved (a name or config
    dict) and checked.

    Raises:
        ValueError: an identifier that cannot be resolved; the optimizer is
            already an ``AccumulatingOptimizer``, a ``LossScaleOptimizer``,
            or uses Keras' built-in accumulation.
        TypeError: not an optimizer of the family.
    """
    inner = inner_optimizer
    expected = spec.kind
    if spec.resolve is not None:
        inner = resolve_identifier(inner_optimizer, spec.resolve, spec.resolver)
        expected += f" or an identifier that `{spec.resolver}` resolves (e.g. 'adam')"
    if isinstance(inner, Constructor):
        raise ValueError(
            "`inner_optimizer` is already an AccumulatingOptimizer "
            f"(gradient_accumulation_steps={inner.gradient_accumulation_steps}); "
            "nesting them would accumulate twice. Use one AccumulatingOptimizer "
            "with gradient_accumulation_steps equal to the product."
        )
    if not isinstance(inner, spec.base):
        kind = type(inner)
        raise TypeError(
            f"`inner_optimizer` must be {expected}. Received: inner_optimizer="
            f"{inner!r} of type {kind.__module__}.{kind.__qualname__}."
        )
    if spec.loss_scale and isinstance(inner, spec.loss_scale):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer (received "
            f"inner_optimizer={inner!r}). Put the loss scaling "
            "outside: LossScaleOptimizer(AccumulatingOptimizer(inner, N)). "
            "Under the 'mixed_float16' policy, model.compile does that by "
            "itself; with a LossScaleOptimizer inside, it would wrap a second "
            "one around the first and unscale the gradients twice."
        )
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if steps and not isinstance(steps, bool):
        raise ValueError(
            "`inner_optimizer` already uses Keras' built-in gradient "
            f"accumulation (inner_optimizer.gradient_accumulation_steps={steps}); "
            "wrapping it would accumulate twice. Create the inner optimizer "
            "without `gradient_accumulation_steps` and pass that value to "
            "AccumulatingOptimizer instead."
        )
    return inner


# id(inner optimizer) -> (weak inner, weak wrapper), for check_unshared.
_WRAPPERS: dict = {}


def check_unshared(inner: Any) -> None:
    """Refuse an inner optimizer another live ``AccumulatingOptimizer`` wraps.

    Raises:
        ValueError: two wrappers would apply updates through one optimizer's
            slots and counters (and Keras fails later, in the first update,
            with "Unknown variable").
    """
    for key, (inner_ref, wrapper_ref) in list(_WRAPPERS.items()):
        if inner_ref() is None or wrapper_ref() is None:
            del _WRAPPERS[key]
    entry = _WRAPPERS.get(id(inner))
    if entry is not None and entry[0]() is inner:
        raise ValueError(
            f"`inner_optimizer` ({inner!r}) is already wrapped by another "
            f"AccumulatingOptimizer ({entry[1]()!r}): both would update through its "
            "slots and counters. Give each AccumulatingOptimizer its own inner "
            "optimizer, e.g. type(opt).from_config(opt.get_config())."
        )


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The constructor's arguments, checked (see :class:`Constructor`)."""

    inner: Any
    steps: Any
    reduction: str
    name: str | None
    nonfinite: str
    accumulator_dtype: Any


class Constructor:
    """Mixin of every family's ``AccumulatingOptimizer``: its constructor,
    whose arguments are checked here, once for all families.

    ``AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps,
    reduction="mean", name=None, nonfinite="propagate",
    accumulator_dtype=None)``; the family class says what each means there.
    A family sets :attr:`_INNER_ONLY` (its base optimizer's arguments that
    belong on the inner optimizer, with their defaults), :attr:`_NONFINITE`
    (the policies it keeps the state for), :attr:`_SCHEDULES` (whether N may
    be a schedule), and implements :meth:`_inner_spec`,
    :meth:`_base_arguments` (what its framework base class' ``__init__``
    takes) and :meth:`_init_state` (everything after it).

    Raises:
        TypeError: a missing or unknown argument, or one of the wrong type.
        ValueError: an argument with a bad value (each message names it, the
            value received and what is accepted).
    """

    _FAMILY = "?"
    _INNER_ONLY: Mapping[str, Any] = {}
    _IGNORED: Sequence[str] = ()
    _NONFINITE: Sequence[str] = ("propagate",)
    _SCHEDULES = True

    def __init__(
        self,
        inner_optimizer: Any = REQUIRED,
        gradient_accumulation_steps: Any = REQUIRED,
        reduction: str = "mean",
        name: str | None = None,
        nonfinite: str = "propagate",
        accumulator_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        self._check_environment()
        # The one attribute written past the framework's tracking: everything
        # untracked is the window's (families/_window.py).
        self.__dict__["_window"] = _window.Window()
        for key in self._IGNORED:
            kwargs.pop(key, None)
        reject_inner_arguments(kwargs, self._INNER_ONLY, self._inner_example())
        check_arguments(inner_optimizer, gradient_accumulation_steps, kwargs, ARGUMENTS + NUMERICS_ARGUMENTS)
        if self._SCHEDULES:
            steps = validate_accumulation_schedule(gradient_accumulation_steps)
        else:
            steps = validate_gradient_accumulation_steps(gradient_accumulation_steps)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"`name` must be a non-empty string or None. Received: name={name!r}.")
        reduction = validate_reduction(reduction)
        nonfinite = validate_nonfinite(nonfinite, self._NONFINITE)
        accumulator_dtype = self._check_accumulator_dtype(accumulator_dtype)
        inner = resolve_inner(inner_optimizer, self._inner_spec())
        check_unshared(inner)
        args = Arguments(inner, steps, reduction, name, nonfinite, accumulator_dtype)
        self._before_base(args)
        super().__init__(**self._base_arguments(args))
        self._window.steps = steps
        self._window.hooks = self._hooks()
        self._init_state(args)
        self._window.constructed = True  # (from now on, settings of the inner are forwarded)
        _WRAPPERS[id(inner)] = (weakref.ref(inner), weakref.ref(self))

    def __repr__(self) -> str:
        """Names the family: Keras' "Could not interpret optimizer
        identifier: ..." (a wrapper compiled into another Keras' model)
        prints it."""
        try:
            inner, steps = self.inner_optimizer, self.gradient_accumulation_steps
            return (
                f"<AccumulatingOptimizer of the {self._family_models()}: "
                f"{type(inner).__module__}.{type(inner).__qualname__}, "
                f"gradient_accumulation_steps={steps!r}>"
            )
        except Exception:  # (partly constructed)
            return object.__repr__(self)

    @property
    def gradient_accumulation_steps(self) -> Any:
        """N, micro-steps per update: an int, or the schedule given (a dict
        ``{first_update: N}`` or a callable ``update_index -> N``). Read-only:
        fixed at construction."""
        window = self.__dict__.get("_window")
        return None if window is None else window.steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: Any) -> None:
        if self.gradient_accumulation_steps is None and value is None:
            return  # Keras 3's base __init__ sets its own (None: built-in accumulation off)
        raise AttributeError(
            "`gradient_accumulation_steps` is read-only after construction "
            f"(it is {self.gradient_accumulation_steps}; received {value!r}): "
            "the steps traced or built so far have the window length fixed, and "
            "changing it would drop or mis-scale the partial window. Create a "
            "new AccumulatingOptimizer(inner_optimizer, gradient_accumulation_steps=...) "
            "instead."
        )

    # -- the family's part
    def _check_environment(self) -> None:
        """Raise if the family cannot run here (called first)."""

    def _inner_example(self) -> str:
        """An inner optimizer's constructor, for messages."""
        return "keras.optimizers.Adam"

    def _family_models(self) -> str:
        """What this wrapper trains, for messages: "Keras 3 family (keras
        3.15.1 models; ...)"."""
        package = self._inner_spec().resolver.split(".")[0] or "tensorflow"
        version = getattr(sys.modules.get(package), "__version__", "?")
        return (
            f"{self._FAMILY} family (for {package} {version} models; a model of another "
            f"Keras needs an AccumulatingOptimizer around that Keras' optimizer)"
        )

    def _check_accumulator_dtype(self, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "`accumulator_dtype` is not supported by this optimizer family yet "
                f"(received accumulator_dtype={value!r}); the accumulators take "
                "each variable's dtype. Accepted: None."
            )
        return None

    def _inner_spec(self) -> InnerSpec:
        raise NotImplementedError

    def _before_base(self, args: Arguments) -> None:
        """Checks that need the checked arguments, before the base class' ``__init__``."""

    def _base_arguments(self, args: Arguments) -> dict:
        return {}

    def _init_state(self, args: Arguments) -> None:
        raise NotImplementedError

    def _hooks(self) -> Any:
        """The family's :class:`~accum_optimizer.families._window.Hooks`, or
        ``None`` (a family that keeps its windows elsewhere)."""
        return None


# ------------------------------------------- the inner optimizer's settings
def forwarded(name: str, writable: bool = True) -> property:
    """A property answered by the inner optimizer (``AttributeError`` where it
    has no such attribute, so ``hasattr`` tells the truth). Before the inner
    optimizer is set (inside the framework base class' ``__init__``), values
    are kept aside and never reach it: they are the base class' defaults for
    the wrapper."""

    def fget(self: Any) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            try:
                return self._window.before_inner[name]
            except KeyError:
                raise AttributeError(name) from None
        return getattr(inner, name)

    def fset(self: Any, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            self._window.before_inner[name] = value
        elif writable:
            setattr(inner, name, value)
        else:
            raise AttributeError(f"`{name}` belongs to the inner optimizer; set it there.")

    return property(fget, fset, doc=f"The inner optimizer's ``{name}``.")
