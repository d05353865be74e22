"""Layers that follow an ``AccumulatingOptimizer``'s windows.

* :class:`BatchNormalization`: ``keras.layers.BatchNormalization`` whose
  moving statistics move once per window, by the window's pooled
  statistics (Keras 3, TensorFlow backend; see ``docs/batchnorm.md``).
* :func:`convert_batch_norm`: a copy of a Sequential or Functional model
  (``keras.applications`` included) with every ``BatchNormalization``
  replaced by it, weights copied.

Importing this module imports Keras 3. Under Keras 2 (``tf_keras``, TF <=
2.15) it raises ``ImportError``: the layer exists for Keras 3 only so far.
"""

from __future__ import annotations

import keras

from accum_optimizer._packages import major

if major(keras) < 3:
    raise ImportError(
        "accum_optimizer.layers needs Keras 3 (`import keras` is Keras 3.x): its BatchNormalization is "
        "written for Keras 3 only so far; under Keras 2 (tf_keras, TF <= 2.15) keep "
        "tf.keras.layers.BatchNormalization (moving statistics per micro-batch)."
    )

from accum_optimizer.layers._keras3 import BatchNormalization, convert_batch_norm  # noqa: E402

__all__ = ["BatchNormalization", "convert_batch_norm"]
