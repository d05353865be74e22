"""Shared test setup.

* Two logical CPU devices are configured before TensorFlow initialises its
  devices, so the distribution tests can build a 2-replica MirroredStrategy.
* Hypothesis profiles: ``ci`` (default, bounded) and ``full`` (opt-in with
  ``HYPOTHESIS_PROFILE=full`` or ``make test-full``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow's BFC allocator on the CPU keeps the statistics that
# `tf.config.experimental.get_memory_info("CPU:0")` reads (test_sparse).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf  # noqa: E402

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
