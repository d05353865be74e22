"""Per-family drivers of the contract tests (``tests/contract/``): the
shared part is :mod:`support.drivers.base` (its docstring says what a driver
answers), each family's driver is a module of this package (``keras3``,
``keras2``, ``legacy`` with ``tfa``, ``tf1``; the Keras families' shared
part: ``keras``). What the tests import is here."""

from support.drivers.base import (  # noqa: F401
    FAMILIES,
    MISSING_MB,
    MISSING_N,
    PATTERN,
    SKIP_COUNTERS,
    TOL,
    Case,
    Driver,
    Inner,
    NotApplicable,
    Run,
    assert_matches_large_batch,
    driver,
    params,
)
