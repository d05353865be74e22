"""Accumulation schedules written as Keras' learning-rate schedules are: a
class with ``__call__``, ``get_config`` and ``from_config``, registered with
a Keras package's ``saving.register_keras_serializable``."""

from __future__ import annotations

import tensorflow as tf


class GrowingWindows:
    """``N(u) = min(u // 2 + 1, cap)``: windows of 1, 1, 2, 2, 3, 3, ... for
    cap 3. Register it with :func:`registered` before saving one."""

    def __init__(self, cap):
        self.cap = cap

    def __call__(self, update):
        return tf.minimum(update // 2 + 1, tf.constant(self.cap, tf.int64))

    def get_config(self):
        return {"cap": self.cap}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def registered(package, cls=GrowingWindows):
    """``cls``, registered with ``package`` (``keras``, ``tf_keras``, ...)
    under the package name "accum_tests"."""
    return package.saving.register_keras_serializable(package="accum_tests")(cls)
