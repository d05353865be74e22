"""Argument validation is shared: every family raises the shared validators'
exceptions, with their messages, word for word.

Reference: the validators themselves (``support.internals``: argument
validation lives in one module of the package, whichever it is); for the
arguments of Keras' ``Optimizer`` base class, the message's parts (the
argument, the value received, where it belongs).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from support import internals
from support.drivers import FAMILIES, Inner, NotApplicable, driver, params


def _family_class(family):
    return importlib.import_module(f"accum_optimizer.families.{family}").AccumulatingOptimizer


@pytest.mark.parametrize(
    "steps, reduction, error, validator",
    [
        (2.0, "mean", TypeError, lambda: internals.validate_gradient_accumulation_steps(2.0)),
        (True, "mean", TypeError, lambda: internals.validate_gradient_accumulation_steps(True)),
        (0, "mean", ValueError, lambda: internals.validate_gradient_accumulation_steps(0)),
        (2, "avg", ValueError, lambda: internals.validate_reduction("avg")),
    ],
    ids=["steps=2.0", "steps=True", "steps=0", "reduction=avg"],
)
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_bad_arguments_raise_the_shared_errors(family, case, steps, reduction, error, validator):
    """The same exception and message in every family (the shared
    validators)."""
    with pytest.raises(error) as expected:
        validator()
    with pytest.raises(error) as got:
        _family_class(family)(driver(family).make_inner(Inner("sgd", 0.1)), steps, reduction=reduction)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "args, kwargs",
    [((), {"gradient_accumulation_steps": 2}), ((None,), {}), ((None,), {"steps": 2})],
    ids=["missing-inner", "missing-steps", "misspelt-steps"],
)
@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_missing_and_unknown_arguments_raise_the_shared_errors(family, case, args, kwargs):
    """The same messages in every family (the shared ``check_arguments``, told
    the family's own keyword arguments): missing required arguments, and
    unknown ones with the close match."""
    d = driver(family)
    inner = d.make_inner(Inner("sgd", 0.1))
    args = tuple(inner if a is None else a for a in args)
    unknown = {k: v for k, v in kwargs.items() if k not in d.ARGUMENTS}
    given = dict(zip(("inner_optimizer", "gradient_accumulation_steps"), args), **kwargs)
    with pytest.raises(TypeError) as expected:
        internals.check_arguments(given.get("inner_optimizer", internals.REQUIRED),
                                  given.get("gradient_accumulation_steps", internals.REQUIRED), unknown,
                                  accepted=d.ARGUMENTS)
    with pytest.raises(TypeError) as got:
        _family_class(family)(*args, **kwargs)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_an_inner_optimizer_wrapped_twice_is_refused(family, case):
    """Two wrappers around one inner optimizer would update through the same
    slots and counters (Keras 3 used to fail later, inside the first update's
    ``Cond.call()``, with "Unknown variable"): refused when the second is
    made, naming the argument; free again once the first wrapper is gone."""
    import gc

    inner = driver(family).make_inner(Inner("sgd", 0.1))
    first = _family_class(family)(inner, 2)
    with pytest.raises(ValueError, match=r"`inner_optimizer` \(.*\) is already wrapped by another AccumulatingOptimizer"):
        _family_class(family)(inner, 3)
    del first
    gc.collect()
    assert _family_class(family)(inner, 3).inner_optimizer is inner


@pytest.mark.parametrize("family, case", params(FAMILIES))
def test_repr_names_the_family_and_the_inner_optimizer(family, case):
    """What Keras' "Could not interpret optimizer identifier: ..." prints when
    a wrapper is compiled into another Keras' model."""
    inner = driver(family).make_inner(Inner("sgd", 0.1))
    text = repr(_family_class(family)(inner, 2))
    names = {"keras3": "Keras 3 family", "keras2": "Keras 2 new API family",
             "legacy": "Keras 2 legacy (OptimizerV2) family", "tf1": "TF1 family"}
    assert names[family] in text
    assert f"{type(inner).__module__}.{type(inner).__qualname__}" in text
    assert "gradient_accumulation_steps=2" in text


@pytest.mark.parametrize("family, case", params(("keras3", "keras2", "legacy")))
def test_flush_before_the_optimizer_is_built_raises(family, case):
    """No window exists before the first build: flush() says so and what to
    do, rather than doing nothing silently (the TF1 family raises too: its
    flush needs the train op)."""
    opt = _family_class(family)(driver(family).make_inner(Inner("sgd", 0.1)), 2)
    with pytest.raises(ValueError, match=r"flush\(\) before the optimizer is built.*opt\.build\("):
        opt.flush()


# ------------------------------------------- the base class' arguments
@dataclasses.dataclass(frozen=True)
class Keyword:
    name: str
    value: object

    def __str__(self) -> str:  # the test id
        return f"{self.name}-{self.value}"


def _all_of(*parts):
    return "".join(f"(?=.*{re.escape(p)})" for p in parts)


def _base_arguments(d):
    if d.BASE_ARGUMENTS is None:
        return NotApplicable("its wrapper's refusal of the optimizer's own arguments is checked in its folder "
                             "(legacy/test_semantics.py, tf1/test_api.py)")
    return [Keyword(name, value) for name, value in d.BASE_ARGUMENTS]


@pytest.mark.parametrize("family, keyword", params(FAMILIES, _base_arguments))
def test_base_optimizer_arguments_on_wrapper_are_rejected(family, keyword):
    """An argument of the family's ``Optimizer`` base class given to the
    wrapper is refused, naming it, the value and where it belongs."""
    from accum_optimizer import AccumulatingOptimizer

    inner, name, value = driver(family).make_inner(Inner("sgd", 0.01)), keyword.name, keyword.value
    with pytest.raises(ValueError, match=_all_of(f"`{name}`", f"{name}={value!r}", "inner optimizer")):
        AccumulatingOptimizer(inner, gradient_accumulation_steps=2, **{name: value})


def _base_defaults(d):
    return _base_arguments(d) if d.BASE_ARGUMENTS is None else [None]


@pytest.mark.parametrize("family, case", params(FAMILIES, _base_defaults))
def test_base_optimizer_arguments_at_their_defaults_are_accepted(family, case):
    """Generic code that writes the base-class defaults still works (the
    learning rate is the inner optimizer's)."""
    from accum_optimizer import AccumulatingOptimizer

    d = driver(family)
    opt = AccumulatingOptimizer(d.make_inner(Inner("sgd", 0.3)), 2, **d.BASE_DEFAULTS)
    assert d.learning_rate(opt) == pytest.approx(0.3)
