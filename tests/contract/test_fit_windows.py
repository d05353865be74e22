"""``model.fit`` with ``CountedLoss`` and ``FlushPartialWindow`` (the same
names and imports in every Keras family: ``from accum_optimizer import
CountedLoss, FlushPartialWindow`` resolves to the active Keras' tools):
micro-batches of unequal size, each weighted by its count, and a flush at
every epoch end make each window the large batch ``fit(batch_size=N*B)``
takes, epoch by epoch.

Reference: the same model (same initial weights, same sample order), the
plain inner optimizer, ``fit(x, y, batch_size=N*B)`` with the same loss.
Tolerance: float32 rounding of a few updates (1e-6; the weighted window forms
``c * (S / c)`` instead of ``S``).
"""

from __future__ import annotations

import numpy as np
import pytest

from support.arrays import max_abs_diff
from support.drivers import FAMILIES, NotApplicable, driver, params
from support.tokens import padded, token_data

TOL = 1e-6


def _fit_cases(d):
    if d.family == "tf1":
        return NotApplicable("TF1 graph code has no model.fit: its windows are weighted with weight= on "
                             "minimize/apply_gradients and flushed with the flush() op")
    return [None]


def _recorder(d):
    """A callback of the family's Keras recording, at every epoch end (after
    the callbacks before it in the list), the model's weights and every
    variable of the inner optimizer."""

    class Record(d.keras.callbacks.Callback):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.epochs = inner, []

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(([np.array(w.numpy()) for w in self.model.weights], d.inner_state(self.inner)[1]))

    return Record


@pytest.mark.parametrize("family, case", params(FAMILIES, _fit_cases))
def test_counted_loss_and_flush_in_fit_equal_fit_with_the_large_batch_every_epoch(family, case):
    """11 samples, B = 2, N = 3: micro-batches 2,2,2 | 2,2,1 per epoch. With
    CountedLoss (the last window is weighted 2:2:1, not 1:1:1) and
    FlushPartialWindow (each epoch ends on an update), equal to
    fit(batch_size=6) (batches of 6 and 5) at every epoch end: weights, every
    inner variable, the update count and the validation loss, which sees the
    flushed weights."""
    from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow

    d = driver(family)
    R, o, Record = d.R, d.optimizers, _recorder(d)
    x, y = R.make_data(11)
    xv, yv = R.make_data(5, seed=7)
    fit = dict(epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv))

    ref = R.make_mlp(0)
    ref_inner = o.Adam(0.05)
    ref.compile(ref_inner, "mse")
    ref_rec = Record(ref_inner)
    h_ref = ref.fit(x, y, batch_size=6, callbacks=[ref_rec], **fit)

    model = R.make_mlp(0)
    inner = o.Adam(0.05)
    opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=3)
    model.compile(opt, CountedLoss("mse"))
    rec = Record(inner)
    h = model.fit(x, y, batch_size=2, callbacks=[FlushPartialWindow(), rec], **fit)

    assert len(rec.epochs) == len(ref_rec.epochs) == 3
    for (rw, rs), (aw, as_) in zip(ref_rec.epochs, rec.epochs):
        assert max_abs_diff(rw, aw) <= TOL
        assert max_abs_diff(rs, as_) <= TOL
    assert max_abs_diff(R.weights(ref), R.weights(R.make_mlp(0))) > 1e-2  # training moved the weights
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (18, 6)
    np.testing.assert_allclose(h.history["val_loss"], h_ref.history["val_loss"], rtol=1e-5)
    assert isinstance(model.loss, d.keras.losses.Loss)  # the active Keras' loss class


@pytest.mark.parametrize("family, case", params(FAMILIES, _fit_cases))
def test_counted_masked_tokens_with_flush_in_fit_equal_the_large_batch(family, case):
    """Padded token sequences (lengths 1..9), ``Embedding(mask_zero=True)``,
    a per-token loss: CountedLoss counts each micro-batch's unmasked tokens,
    so 26 sequences in micro-batches of 4 with N = 3 and a flush (windows of
    12, 12 and 2 sequences) equal fit on batches of 12, the masked mean over
    each large batch's tokens: weights and every inner variable, 2 epochs
    (Adam; SGD for Keras 3, see below)."""
    from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow

    d = driver(family)
    K, o = d.keras, d.optimizers

    def model():
        K.utils.set_random_seed(0)
        return K.Sequential([K.Input((None,), dtype="int32"), K.layers.Embedding(12, 6, mask_zero=True),
                             K.layers.Dense(7, activation="tanh"), K.layers.Dense(5)])

    # Adam, which squares the gradient; Keras 3 applies a repeated-id
    # IndexedSlices differently from its deduplicated rows (docs/semantics.md,
    # "Embedding gradients with repeated ids": the large batch's own slices
    # are not the reference there), so Keras 3's cell uses SGD, linear in the
    # gradient. Keras 2 deduplicates the slices, as the window's update does.
    inner_fn = (lambda: o.SGD(0.3)) if family == "keras3" else (lambda: o.Adam(0.05))
    x, y = token_data(3, 26)
    ref, ref_inner = model(), inner_fn()
    ref.compile(ref_inner, K.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(padded(x, y, 12), epochs=2, verbose=0)
    acc, inner = model(), inner_fn()
    opt = AccumulatingOptimizer(inner, gradient_accumulation_steps=3)
    acc.compile(opt, CountedLoss(K.losses.SparseCategoricalCrossentropy(from_logits=True)))
    acc.fit(padded(x, y, 4), epochs=2, verbose=0, callbacks=[FlushPartialWindow()])

    assert int(opt.iterations.numpy()) == int(ref_inner.iterations.numpy()) == 6
    assert max_abs_diff(d.R.weights(ref), d.R.weights(acc)) <= TOL
    assert max_abs_diff(d.inner_state(ref_inner)[1], d.inner_state(inner)[1]) <= TOL
    assert max_abs_diff(d.R.weights(ref), d.R.weights(model())) > 1e-2  # training moved the weights
