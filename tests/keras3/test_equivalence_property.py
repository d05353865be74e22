"""Accumulating N micro-batches of B equals one batch of N*B, for any N, B,
layer shapes, optimizer, reduction and dtype (hypothesis, Keras 3).

Reference: the same model (same initial weights, same sample order) trained by
the plain inner optimizer with batch N*B and a loss that is a mean over the
batch (``support.reference.reference_and_accumulated``; with ``reduction="sum"``
the reference loss is multiplied by N). Besides the weights, the inner
optimizer's own state (moments, ``iterations``, ...) must equal the
reference optimizer's, variable by variable. Every optimizer class, one
configuration each: tests/contract/test_large_batch.py.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support.reference import make_mlp, max_abs_diff, reference_and_accumulated, weights  # noqa: E402

o = keras.optimizers
OPTIMIZERS = {
    "sgd_momentum": lambda: o.SGD(0.1, momentum=0.9),
    "adam": lambda: o.Adam(1e-2),
    "adamw": lambda: o.AdamW(1e-2, weight_decay=0.05),
    "rmsprop": lambda: o.RMSprop(1e-2),
    "adagrad": lambda: o.Adagrad(5e-2),
    "nadam": lambda: o.Nadam(1e-2),
    "lion": lambda: o.Lion(1e-3),
}


def _inner_state(opt):
    return [np.array(v.numpy()) for v in opt.variables]


def _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol):
    assert max_abs_diff(weights(ref_model), weights(acc_model)) <= tol
    ref_state, acc_state = _inner_state(ref_opt), _inner_state(acc_opt.inner_optimizer)
    assert [s.shape for s in ref_state] == [s.shape for s in acc_state]
    assert max_abs_diff(ref_state, acc_state) <= tol
    assert int(acc_opt.iterations.numpy()) == int(ref_opt.iterations.numpy())


PROPERTY_OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop", "adagrad", "nadam", "lion"]


@given(
    n=st.integers(1, 8),
    micro_batch=st.integers(1, 4),
    in_dim=st.integers(1, 5),
    hidden=st.integers(1, 6),
    out_dim=st.integers(1, 3),
    opt=st.sampled_from(PROPERTY_OPTIMIZERS),
    reduction=st.sampled_from(["mean", "sum"]),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_property_accumulation_matches_large_batch(
    n, micro_batch, in_dim, hidden, out_dim, opt, reduction, dtype
):
    # Eager steps: a fresh model per example would otherwise cost a fresh
    # tf.function trace per example (tests/contract/test_large_batch.py
    # covers the traced path).
    def model_fn():
        return make_mlp(seed=7, in_dim=in_dim, hidden=hidden, out_dim=out_dim, dtype=dtype)

    ref_model, acc_model, ref_opt, acc_opt = reference_and_accumulated(
        model_fn, OPTIMIZERS[opt], n=n, micro_batch=micro_batch, windows=2,
        reduction=reduction, dtype=dtype, mode="eager",
    )
    tol = 1e-5 if dtype == "float32" else 1e-11
    _assert_equivalent(ref_model, acc_model, ref_opt, acc_opt, tol=tol)
