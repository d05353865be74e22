"""The earlier name of :mod:`accum_optimizer.families.keras2_fit`, kept so
that models saved with a ``CountedLoss`` by earlier versions load: their
configuration names this module, which Keras imports to find the class."""

from accum_optimizer.families.keras2_fit import counted_loss_class, flush_partial_window_class

__all__ = ["counted_loss_class", "flush_partial_window_class"]
