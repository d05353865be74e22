"""One module per optimizer family; each is a thin adapter over
:mod:`accum_optimizer.core` and defines ``AccumulatingOptimizer``, an
instance of that family's optimizer base class.

* :mod:`~accum_optimizer.families.keras3`: Keras 3 (``keras.optimizers``).
* :mod:`~accum_optimizer.families.keras2`: the Keras 2 new optimizer API
  (``tf_keras.optimizers``, ``tf.keras.optimizers`` on TF <= 2.15).
* :mod:`~accum_optimizer.families.legacy`: Keras 2 legacy ``OptimizerV2``
  (``tf.keras.optimizers.legacy``, ``tf_keras.optimizers.legacy``) and
  every tensorflow-addons optimizer.
* :mod:`~accum_optimizer.families.tf1`: TF1 graph code
  (``tf.compat.v1.train.Optimizer``, with ``Session``, ``global_step``,
  ``Saver``).

What they share, once, by role:

* the window object every wrapper holds: :mod:`~accum_optimizer.families._window`
  (and, for the ``keras.optimizers``-style wrappers, their shared base:
  :mod:`~accum_optimizer.families._accumulating`);
* backends (the core's arithmetic and writes in a framework):
  :mod:`~accum_optimizer.families._tf_backend`,
  :mod:`~accum_optimizer.families._keras_ops_backend`;
* routes (how a micro-step reaches the window in a framework):
  :mod:`~accum_optimizer.families._tf_route` (the three ``tf.function``
  families), :mod:`~accum_optimizer.families._keras_ops_route` (Keras 3 on
  JAX and torch), :mod:`~accum_optimizer.families._tf1_graph` (TF1 graphs);
* :mod:`~accum_optimizer.families._keras2` (the two Keras 2 families) and
  :mod:`~accum_optimizer.families._fit` (the fit tools').

The window's variables, their order and their saved layout are data:
:mod:`accum_optimizer.core.layout`.
"""
