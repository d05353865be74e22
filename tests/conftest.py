"""Shared test setup, safe in every leg of ``make test`` (TF 2.15 to 2.21,
Keras 2 or 3): it imports TensorFlow and hypothesis, nothing of Keras.

* TensorFlow's BFC CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC``), for the
  tests that read allocator statistics.
* Two logical CPU devices are configured before TensorFlow initialises its
  devices, so the distribution tests can build a 2-replica MirroredStrategy.
* Hypothesis profiles: ``ci`` (default, bounded) and ``full`` (opt-in with
  ``HYPOTHESIS_PROFILE=full`` or ``make test-full``).
* ``strategy``: one session-wide 2-replica MirroredStrategy fixture.
* The report header names the leg (``ACCUM_LEG``), the versions that import
  and the optimizer families usable here (``tests/support/families.py``).
* Every test carries its family's marker (by folder; the contract tests by
  parameter), and ``--leave-out MARKER[,MARKER]`` deselects a leg's share
  (see .ci/legs.py).
"""

import os
import platform
from importlib import metadata

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow's BFC allocator on the CPU keeps allocator statistics, which
# `tf.config.experimental.get_memory_info("CPU:0")` (tests/keras3/test_sparse.py)
# needs; without it that call raises "Allocator stats not available".
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

try:  # (the k3-jax and k3-torch legs have no TensorFlow: they run tests/backends/)
    import tensorflow as tf  # noqa: E402
except ImportError:
    tf = None
else:
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "full",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def strategy():
    """One 2-replica MirroredStrategy for the whole session.

    Two strategy objects over the same devices in one process can hand out
    the same collective group and instance keys, and their all-reduces then
    fail with "Shape mismatch in the collective instance": every test module
    shares this one.
    """
    assert len(tf.config.list_logical_devices("CPU")) >= 2, "two logical CPUs are configured above"
    s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert s.num_replicas_in_sync == 2
    return s


_FAMILY_FOLDERS = ("keras3", "keras2", "legacy", "tf1")
# Folders whose tests are another family's: tests/backends/ is Keras 3's on
# whichever backend runs, and so is tests/clients/ (libraries built on Keras
# 3: keras-hub), whose tests also carry `clients`.
_FOLDER_FAMILY = {"backends": "keras3", "clients": "keras3"}


def pytest_addoption(parser):
    parser.addoption(
        "--leave-out", action="append", default=[], metavar="MARKER[,MARKER...]",
        help="deselect the tests that carry every one of these markers (a leg's own selection, set in "
             ".ci/legs.py; -m and -k stay free for PYTEST_ARGS). Repeatable.",
    )


def pytest_collection_modifyitems(config, items):
    """Each test in a family's folder carries that family's marker (the
    contract tests' parameters carry theirs, and every contract test
    ``contract``); then ``--leave-out`` deselects."""
    for item in items:
        folder = item.path.parent.name
        if folder in _FAMILY_FOLDERS or folder in _FOLDER_FAMILY:
            item.add_marker(getattr(pytest.mark, _FOLDER_FAMILY.get(folder, folder)))
            if folder == "clients":
                item.add_marker(pytest.mark.clients)
        elif folder == "contract":
            item.add_marker(pytest.mark.contract)
    groups = [set(g.split(",")) for g in config.getoption("--leave-out")]
    if not groups:
        return
    kept, left_out = [], []
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        (left_out if any(g <= marks for g in groups) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def pytest_report_header(config):
    from support import families

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    dists = ["tensorflow", "keras", "tf_keras", "tensorflow-addons", "jax", "torch", "numpy"]
    usable = [f for f in families.FAMILIES if families.available(f)]
    return [
        f"accum_optimizer leg: {os.environ.get('ACCUM_LEG', '(not set)')}; Python {platform.python_version()}; "
        f"TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS', '')}; "
        f"KERAS_BACKEND={os.environ.get('KERAS_BACKEND', '')}",
        "installed: " + ", ".join(f"{d} {version(d)}" for d in dists),
        "families usable here: " + (", ".join(usable) or "none"),
    ]


# ------------------------------------------- what backs the feature table
# Each test that passed, once per family marker it carries, as
# "<family> <nodeid without parameters>"; written to ACCUM_PASSED_OUT at
# the end of the session (``make test`` sets it per leg; the feature
# table's check reads every leg's file: tests/support/features.py).
_PASSED: set = set()


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        base = report.nodeid.split("[", 1)[0]
        for family in _FAMILY_FOLDERS + ("tfa",):
            if family in report.keywords:
                _PASSED.add(f"{family} {base}")


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("ACCUM_PASSED_OUT")
    if out:
        with open(out, "w") as f:
            f.write("\n".join(sorted(_PASSED)) + "\n")
