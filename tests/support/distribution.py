"""Counting cross-replica reductions under a ``tf.distribute`` strategy.

One counter for every family's distribution tests (``keras3/``,
``keras2/``, ``legacy/``): it patches the reduction entry points (with
pytest's ``monkeypatch``, so they are restored after the test) so that each
EXECUTION, not each trace, of one increments a ``tf.Variable``:

* ``ReplicaContext.all_reduce``: called in each replica (Keras 3's
  ``_all_reduce_sum_gradients`` goes through it), so it counts
  ``num_replicas`` per reduction;
* the strategy's ``extended._batch_reduce_to`` / ``_reduce_to``: every
  cross-replica reduction ends up in one of these, once per reduction (Keras
  2's gradient all-reduce, ``all_reduce_sum_gradients``, in
  ``_batch_reduce_to``).

Keras 2 tests patch only ``_batch_reduce_to`` (``entry_points``), as they did
before the counter was shared.
"""

from __future__ import annotations

import tensorflow as tf

ENTRY_POINTS = ("all_reduce", "_batch_reduce_to", "_reduce_to")


class ReductionCounter:
    def __init__(self, monkeypatch, strategy, entry_points=ENTRY_POINTS):
        self.all_reduce = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.batch_reduce_to = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.reduce_to = tf.Variable(0, dtype=tf.int64, trainable=False)
        targets = {
            "all_reduce": (tf.distribute.ReplicaContext, self.all_reduce),
            "_batch_reduce_to": (type(strategy.extended), self.batch_reduce_to),
            "_reduce_to": (type(strategy.extended), self.reduce_to),
        }
        for name in entry_points:
            cls, counter = targets[name]
            self._patch(monkeypatch, cls, name, counter)

    @staticmethod
    def _patch(monkeypatch, cls, name, counter):
        original = getattr(cls, name)

        def counting(*args, **kwargs):
            counter.assign_add(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counting)

    def counts(self) -> dict:
        return {
            "all_reduce": int(self.all_reduce.numpy()),
            "batch_reduce_to": int(self.batch_reduce_to.numpy()),
            "reduce_to": int(self.reduce_to.numpy()),
        }

    def take(self) -> int:
        """The ``_batch_reduce_to`` count so far; resets every counter."""
        value = int(self.batch_reduce_to.numpy())
        self.reset()
        return value

    def reset(self) -> None:
        for variable in (self.all_reduce, self.batch_reduce_to, self.reduce_to):
            variable.assign(0)
