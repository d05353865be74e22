"""One module per optimizer family; each is a thin adapter over
:mod:`accum_optimizer._accumulation` and defines ``AccumulatingOptimizer``,
an instance of that family's optimizer base class.

* :mod:`~accum_optimizer.families.keras3`: Keras 3 (``keras.optimizers``).
* :mod:`~accum_optimizer.families.tf1`: TF1 graph code
  (``tf.compat.v1.train.Optimizer``, with ``Session``, ``global_step``,
  ``Saver``).
* :mod:`~accum_optimizer.families.legacy`: Keras 2 legacy ``OptimizerV2``
  (``tf.keras.optimizers.legacy``, ``tf_keras.optimizers.legacy``) and
  every tensorflow-addons optimizer.
"""
