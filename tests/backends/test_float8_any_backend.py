"""float8 training (``model.quantize("float8")``) accumulated, on whichever
backend runs (TensorFlow in the k3 leg, JAX in k3-jax, torch in k3-torch).

A float8 ``Dense`` keeps, for its inputs, its kernel and its output
gradients, a scale and an amax history, variables with
``overwrite_with_gradient=True`` whose "gradient" is their new value. The
references: the same model trained with batch ``N·B`` (the large batch,
plain ``Adam``/``SGD``) and Keras' built-in ``gradient_accumulation_steps``
at micro-batch ``B``, same seed, same data.

What is exact, and why (``docs/mixed-precision.md#float8``):

* The forward state (inputs and kernel scales and histories): a scale is
  computed from the history before the step, the same for every
  micro-batch; the history's new entry is the largest ``|value|`` of the
  batch, and the largest over the window's micro-batches is the large
  batch's. Bitwise after one window.
* The output-gradient state: ``scale_loss`` divides a micro-batch's loss by
  N, so its backward pass sees the large batch's output gradients
  (``1/B · 1/N == 1/(N·B)``, exact for powers of two, as N=4 and B=8 here):
  bitwise after one window. Keras' built-in keeps them N times larger.
* The weights: sums in another order, and the bias gradient rounded to
  bfloat16 once per micro-batch instead of once per batch (a float32 Dense
  casts its bias to bfloat16 in float8 mode): no bitwise claim, but never
  further from the large batch than Keras' built-in, which adds the same
  micro-batch gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3."):
    pytest.skip(f"Keras 3 only (this is Keras {keras.__version__})", allow_module_level=True)

if keras.backend.backend() == "tensorflow":
    from support.families import require

    require("keras3")

from keras import ops  # noqa: E402

from accum_optimizer import AccumulatingOptimizer, FlushPartialWindow  # noqa: E402
from support.arrays import assert_bitwise_equal  # noqa: E402

N, B = 4, 8
RNG = np.random.default_rng(1)
X = RNG.normal(size=(N * B * 5, 6)).astype("float32")
Y = RNG.normal(size=(N * B * 5, 3)).astype("float32")


def float8_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.quantize("float8")
    return model


def trained(kind: str, make_inner, samples: int, callbacks=()) -> tuple[list, list]:
    """(names, values) of every model variable after ``fit`` over the first
    ``samples`` samples: ``"large"`` (batch N·B), ``"builtin"`` (Keras'
    accumulation, batch B) or ``"ours"`` (batch B)."""
    model = float8_model()
    if kind == "large":
        optimizer, batch = make_inner(), N * B
    elif kind == "builtin":
        optimizer, batch = make_inner(gradient_accumulation_steps=N), B
    else:
        optimizer, batch = AccumulatingOptimizer(make_inner(), N), B
    model.compile(optimizer, "mse")
    model.fit(X[:samples], Y[:samples], batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    names = [v.path.split("/")[-1] for v in model.variables]
    return names, [np.array(ops.convert_to_numpy(v)) for v in model.variables]


def float8_state(names: list) -> list:
    return [i for i, name in enumerate(names) if "scale" in name or "amax_history" in name]


def sgd(**kwargs):
    return keras.optimizers.SGD(0.1, **kwargs)


def adam(**kwargs):
    return keras.optimizers.Adam(1e-2, **kwargs)


def test_float8_is_accepted_and_every_float8_variable_overwrites():
    names, _ = trained("ours", sgd, N * B)
    state = [names[i] for i in float8_state(names)]
    assert len(state) == 12, names  # 2 layers x (inputs, kernel, outputs_grad) x (scale, amax_history)


def test_one_window_float8_state_is_bitwise_the_large_batch_s():
    names, large = trained("large", sgd, N * B)
    _, ours = trained("ours", sgd, N * B)
    _, builtin = trained("builtin", sgd, N * B)
    for i in float8_state(names):
        assert_bitwise_equal([ours[i]], [large[i]], names[i])
    # Keras' built-in keeps the output-gradient amax N times the large batch's
    # (exactly: N is a power of two), its other float8 state as ours.
    for i in float8_state(names):
        if names[i] == "outputs_grad_amax_history":
            assert np.any(large[i] != 0)
            assert_bitwise_equal([builtin[i]], [N * large[i]], names[i])
    for i in range(len(names)):
        if i not in float8_state(names):
            assert np.max(np.abs(ours[i] - large[i])) <= np.max(np.abs(builtin[i] - large[i])), names[i]


def test_five_windows_are_never_further_from_the_large_batch_than_keras_builtin():
    names, large = trained("large", adam, N * B * 5)
    _, ours = trained("ours", adam, N * B * 5)
    _, builtin = trained("builtin", adam, N * B * 5)
    for i, name in enumerate(names):
        ours_off = float(np.max(np.abs(ours[i] - large[i])))
        builtin_off = float(np.max(np.abs(builtin[i] - large[i])))
        assert ours_off <= builtin_off, (name, ours_off, builtin_off)
        if name == "outputs_grad_amax_history":
            # the built-in's entries are N times the large batch's: off by
            # (N - 1) times the largest output gradient; ours follows the
            # large batch up to the weights' rounding (docs: 7.5e-05 vs 0.25)
            assert ours_off < builtin_off / (N - 1), (name, ours_off, builtin_off)


def test_between_updates_every_variable_float8_state_included_is_bitwise_untouched():
    model = float8_model()
    before = [np.array(ops.convert_to_numpy(v)) for v in model.variables]
    model.compile(AccumulatingOptimizer(sgd(), N), "mse")
    model.fit(X[: (N - 1) * B], Y[: (N - 1) * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    after = [np.array(ops.convert_to_numpy(v)) for v in model.variables]
    assert_bitwise_equal(after, before, "model.variables")
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 0


def test_flushed_partial_window_forward_state_is_its_smaller_batch_s():
    """A window of 2 micro-batches flushed at the epoch's end (the first
    window, so that both runs start from the same weights): its forward
    float8 state is that smaller batch's exactly; its output gradients
    were scaled for a full window (N, not yet known to be 2), so their new
    amax entry is 2/N of that batch's (exactly: powers of two)."""
    samples = 2 * B
    names, large = trained("large", sgd, samples)
    _, ours = trained("ours", sgd, samples, callbacks=[FlushPartialWindow()])
    for i in float8_state(names):
        if names[i] == "outputs_grad_amax_history":
            # entry 0 is the newest (keras.quantizers.compute_float8_amax_history)
            assert ours[i][0] == np.float32(2 / N) * large[i][0], (ours[i][0], large[i][0])
            assert_bitwise_equal([ours[i][1:]], [large[i][1:]], names[i])
        else:
            assert_bitwise_equal([ours[i]], [large[i]], names[i])


def test_save_mid_window_and_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    """The window's running maximum of the float8 state is saved with the
    other accumulators: resumed mid-window, training continues bitwise as
    if uninterrupted (reference: the uninterrupted run)."""
    x, y = X[: 6 * B], Y[: 6 * B]  # 6 micro-batches per epoch: epoch 1 ends mid-window

    def fitted(epochs: int, model=None):
        if model is None:
            model = float8_model()
            model.compile(AccumulatingOptimizer(adam(), N), "mse")
        model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
        return model

    straight = fitted(2)
    first = fitted(1)
    assert int(ops.convert_to_numpy(first.optimizer.mini_step)) == 2
    path = str(tmp_path / "model.weights.h5")
    first.save_weights(path)
    resumed = float8_model()
    resumed.compile(AccumulatingOptimizer(adam(), N), "mse")
    resumed.load_weights(path)
    fitted(1, resumed)
    values = lambda vs: [np.array(ops.convert_to_numpy(v)) for v in vs]  # noqa: E731
    assert_bitwise_equal(values(straight.variables), values(resumed.variables), "model.variables")
    assert_bitwise_equal(values(straight.optimizer.variables), values(resumed.optimizer.variables), "state")


def test_under_mixed_float16_the_loss_scale_optimizer_outside_divides_by_n_too():
    """``compile`` puts a ``LossScaleOptimizer`` outside, and ``fit`` calls
    its ``scale_loss``, not the wrapper's: it divides by N there as well, so
    the float8 state after one window is still bitwise the large batch's
    (same policy, same initial loss scale 2**15, which multiplies the large
    batch's output gradients as it does the micro-batches')."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        names, large = trained("large", sgd, N * B)
        _, ours = trained("ours", sgd, N * B)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for i in float8_state(names):
        assert_bitwise_equal([ours[i]], [large[i]], names[i])
