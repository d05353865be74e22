"""Layers that follow an ``AccumulatingOptimizer``'s windows.

* :class:`BatchNormalization`: the active Keras' ``BatchNormalization`` whose
  moving statistics move once per window, by the window's pooled
  statistics (see ``docs/batchnorm.md``).
* :func:`convert_batch_norm`: a copy of a Sequential or Functional model
  (``keras.applications`` included) with every ``BatchNormalization``
  replaced by it, weights copied.

Both are the active Keras' (as ``tf.keras`` resolves: Keras 3, or Keras 2's
``tf_keras`` / TF <= 2.15's ``keras``), resolved on first use: importing
this module imports no Keras. The implementations:
:mod:`~accum_optimizer.layers._keras3` and :mod:`~accum_optimizer.layers._keras2`
(one class per Keras 2 package); :mod:`~accum_optimizer.layers._link` ties
a layer to its optimizer.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["BatchNormalization", "convert_batch_norm"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from accum_optimizer._packages import active_keras

    kind, package = active_keras()
    if kind == "keras3":
        from accum_optimizer.layers import _keras3

        return getattr(_keras3, name)
    from accum_optimizer.layers import _keras2

    if name == "BatchNormalization":
        return _keras2.batch_normalization_class(package)
    return functools.partial(_keras2.convert_batch_norm, package=package)
