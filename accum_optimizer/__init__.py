"""Gradient accumulation for TensorFlow 2 / Keras 3 that trains like the large batch.

    from accum_optimizer import AccumulatingOptimizer
    opt = AccumulatingOptimizer(keras.optimizers.AdamW(1e-3), gradient_accumulation_steps=8)

Importing this package registers ``AccumulatingOptimizer`` with Keras'
serialization, so ``keras.models.load_model`` needs no ``custom_objects``.
"""

from accum_optimizer.keras_optimizer import AccumulatingOptimizer

__all__ = ["AccumulatingOptimizer", "__version__"]
__version__ = "0.1.0"
