"""Count the collective all-reduces that EXECUTE under MultiWorkerMirroredStrategy.

Used by the multi-worker tests (``tests/support/multiworker_worker.py``) and by
``benchmarks/distributed.py``. Imports TensorFlow (unlike :mod:`support.cluster`).

Every dense all-reduce of ``MultiWorkerMirroredStrategy`` -- the gradients,
Keras' per-step loss reduction, the end-of-data check of a distributed
dataset, reads of ``ON_READ`` variables -- is launched by
``CollectiveReplicaLauncher.all_reduce``
(``tensorflow/python/distribute/cross_device_utils.py``), which emits one
``CollectiveReduceV2`` op. In a ``tf.function`` a batch of gradients is
packed into one such op; eagerly there is one per tensor.
:class:`CollectiveCounter` wraps that method: next to each emitted op it
puts ``assign_add``s on counter variables that depend on the op's output, so
they run when, and only when, the collective runs -- inside the update
branch of a ``cond``, only on update steps -- whether the step is traced once
or not at all.

Counted: launches, elements and bytes, in all (``all_*``) and for the
gradient reductions (``grad_*``): the collectives emitted while a Keras
optimizer all-reduces its gradients (inside Keras 3's
``TFOptimizer._all_reduce_sum_gradients``, Keras 2's
``Optimizer.aggregate_gradients`` or ``OptimizerV2._aggregate_gradients``,
at trace time), for a plain
optimizer, the wrapper's inner optimizer and Keras' built-in accumulation
alike. That is a process-wide flag, not a thread-local one: under
``merge_call`` the collective is emitted by the main thread while the replica
thread that called the optimizer waits.
"""

from __future__ import annotations

import tensorflow as tf

KINDS = ("all", "grad")
QUANTITIES = ("launches", "elements", "bytes")
_REDUCING_GRADIENTS = [0]  # depth of TFOptimizer._all_reduce_sum_gradients calls
_INSTALLED: list = []


class CollectiveCounter:
    """Install the counting wrappers (once per process) and read the counts.

    ``read()`` returns ``{"all_launches": ..., "grad_bytes": ..., ...}``;
    counts only grow, so take differences between reads.
    """

    def __new__(cls):
        if _INSTALLED:
            return _INSTALLED[0]
        self = super().__new__(cls)
        # Created eagerly, outside any strategy scope: plain local variables.
        with tf.init_scope():
            self.vars = {f"{k}_{q}": tf.Variable(0, dtype=tf.int64, trainable=False)
                         for k in KINDS for q in QUANTITIES}
        _wrap_launcher(self)
        _flag_gradient_reductions()
        _INSTALLED.append(self)
        return self

    def read(self) -> dict:
        return {k: int(v.numpy()) for k, v in self.vars.items()}


def deltas(snapshots: list) -> list:
    """Per-interval differences of successive :meth:`CollectiveCounter.read`s."""
    return [{k: b[k] - a[k] for k in a} for a, b in zip(snapshots, snapshots[1:])]


def _wrap_launcher(counter: CollectiveCounter) -> None:
    from tensorflow.python.distribute import cross_device_utils

    launcher = cross_device_utils.CollectiveReplicaLauncher
    original = launcher.all_reduce

    def all_reduce(self_, input_tensor, control_input=None, options=None):
        out = original(self_, input_tensor, control_input, options)
        kinds = ["all"] + (["grad"] if _REDUCING_GRADIENTS[0] else [])
        n = tf.size(out, out_type=tf.int64)
        updates = []
        for k in kinds:
            updates += [counter.vars[f"{k}_launches"].assign_add(1),
                        counter.vars[f"{k}_elements"].assign_add(n),
                        counter.vars[f"{k}_bytes"].assign_add(n * out.dtype.size)]
        with tf.control_dependencies(updates):
            return tf.identity(out)

    launcher.all_reduce = all_reduce


def _flag_gradient_reductions() -> None:
    """Flag the optimizers' gradient all-reduce: Keras 3's (where ``tf.keras`` is Keras 3) and
    Keras 2's (``tf_keras`` or TF <= 2.15's ``keras``, if imported: the new
    API's ``aggregate_gradients`` and ``OptimizerV2._aggregate_gradients``)."""
    import sys

    targets = []
    keras = sys.modules.get(tf.keras.optimizers.Optimizer.__module__.split(".")[0])  # tf.keras' package
    if str(getattr(keras, "__version__", "")).startswith("3."):
        from keras.src.backend.tensorflow.optimizer import TFOptimizer

        targets.append((TFOptimizer, "_all_reduce_sum_gradients"))
    for name in ("tf_keras", "keras"):
        package = sys.modules.get(name)
        if package is not None and str(getattr(package, "__version__", "")).startswith("2."):
            targets.append((package.optimizers.Optimizer, "aggregate_gradients"))
            targets.append((package.optimizers.legacy.Optimizer, "_aggregate_gradients"))
    for cls, name in targets:
        owner = next(c for c in cls.__mro__ if name in vars(c))
        _flag(owner, name)


def _flag(owner: type, name: str) -> None:
    original = getattr(owner, name)

    def reducing_gradients(self, grads_and_vars):
        _REDUCING_GRADIENTS[0] += 1
        try:
            return original(self, grads_and_vars)
        finally:
            _REDUCING_GRADIENTS[0] -= 1

    setattr(owner, name, reducing_gradients)
