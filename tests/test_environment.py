"""Each leg of ``make test`` is what its name says.

.ci/legs.py runs every leg with ``ACCUM_LEG=<leg>`` and ``ACCUM_LEG_PINS``
(the leg's pins, the same strings it installed). These tests check that the
installed distributions satisfy those pins, that the TensorFlow / Keras that
actually import are the pinned ones, and that exactly the leg's optimizer
families are usable (``tests/support/families.py``), so that a leg whose family
tests would all skip, or that silently resolved other versions, fails here
instead of passing on skips.

Outside ``make`` (no ``ACCUM_LEG``) only the probe sanity test runs.
"""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata

import pytest
import tensorflow as tf
from packaging.requirements import Requirement

from support import families

LEG = os.environ.get("ACCUM_LEG")
PINS = os.environ.get("ACCUM_LEG_PINS", "").split()

# The families each leg exists to test; every other family must be absent.
LEG_FAMILIES = {
    "k3": {"keras3", "tf1"},
    "k3-oldest": {"keras3", "tf1"},
    "tfkeras": {"keras2", "legacy", "tf1"},
    "tf215": {"keras2", "legacy", "tfa", "tf1"},
    # `make test-nightly` (opt-in): tf-nightly + keras-nightly
    "nightly": {"keras3", "tf1"},
}

in_a_leg = pytest.mark.skipif(
    LEG is None, reason="ACCUM_LEG is not set: run through `make test` or `make test-<leg>`"
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def test_every_family_probe_answers_with_a_reason_or_none():
    for family in families.FAMILIES:
        reason = families.why_not(family)
        assert reason is None or (isinstance(reason, str) and reason), family
        assert families.available(family) == (reason is None)
    with pytest.raises(ValueError, match="unknown family"):
        families.why_not("keras4")


@in_a_leg
def test_leg_is_known_and_has_pins():
    assert LEG in LEG_FAMILIES, f"ACCUM_LEG={LEG!r} is not one of {sorted(LEG_FAMILIES)}"
    assert PINS, "ACCUM_LEG_PINS is empty"


@in_a_leg
@pytest.mark.parametrize("pin", PINS)
def test_installed_distribution_satisfies_the_leg_pin(pin):
    req = Requirement(pin)
    installed = _version(req.name)
    assert installed is not None, f"{req.name} is not installed (pin {pin})"
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} does not satisfy {pin}"


@in_a_leg
def test_the_tensorflow_that_imports_is_the_installed_one():
    assert tf.__version__ == (_version("tf-nightly") if LEG == "nightly" else _version("tensorflow"))


@in_a_leg
def test_exactly_the_leg_families_are_usable():
    expected = LEG_FAMILIES[LEG]
    for family in families.FAMILIES:
        if family in expected:
            assert families.available(family), f"{LEG} must test {family}: {families.why_not(family)}"
        else:
            assert not families.available(family), f"{family} is usable in {LEG}, which is not its leg"


@in_a_leg
def test_keras_flavour_matches_the_leg():
    import keras

    tf_keras_version = families.tf_keras_version()
    legacy_env = families.legacy_keras_requested()
    if LEG in ("k3", "k3-oldest", "nightly"):
        # Keras 3 is both `keras` and `tf.keras`; no Keras 2 around.
        assert not legacy_env
        installed = _version("keras-nightly") if LEG == "nightly" else _version("keras")
        assert keras.__version__.startswith("3.") and keras.__version__ == installed
        assert tf_keras_version == keras.__version__
        assert importlib.util.find_spec("tf_keras") is None
    elif LEG == "tfkeras":
        # tf.keras is tf_keras (Keras 2) by TF_USE_LEGACY_KERAS; `import keras` is still Keras 3.
        assert legacy_env
        assert tf_keras_version.startswith("2.") and tf_keras_version == _version("tf_keras")
        assert tf_keras_version.rsplit(".", 1)[0] == tf.__version__.rsplit(".", 1)[0], (
            f"tf_keras {tf_keras_version} does not match TensorFlow {tf.__version__}"
        )
        assert keras.__version__.startswith("3.")
    elif LEG == "tf215":
        # TF 2.15's own Keras 2.15 is both `keras` and `tf.keras`; no Keras 3 installed.
        assert tf.__version__.startswith("2.15.")
        assert keras.__version__.startswith("2.15.") and tf_keras_version == keras.__version__
        assert _version("keras").startswith("2.15.")
        import tensorflow_addons as tfa

        assert tfa.__version__ == _version("tensorflow-addons")
