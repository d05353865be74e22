"""The earlier name of :mod:`accum_optimizer.families.keras3_fit`, kept so
that models saved with a ``CountedLoss`` by earlier versions load: their
configuration names this module, which Keras imports to find the class."""

from accum_optimizer.families.keras3_fit import CountedLoss, FlushPartialWindow

__all__ = ["CountedLoss", "FlushPartialWindow"]
