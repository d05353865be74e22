"""`accum_optimizer.layers.BatchNormalization`: moving statistics that move
once per window, by the window's pooled statistics (Keras 3; Keras 2 under
both Keras 2 families).

Reference: the same model with `keras.layers.BatchNormalization`, trained by
the plain inner optimizer on the batch of N·B (or, for a layer whose inputs
change inside training, the moments of the inputs it saw, computed here with
NumPy). Tolerance 1e-6: float32 rounding of a mean/variance over a few
hundred elements, relative to statistics of order 1-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer, FlushPartialWindow
from support.families import skip_reason

if any(skip_reason(f) is None for f in ("keras3", "keras2", "legacy")):
    from accum_optimizer.layers import BatchNormalization, convert_batch_norm  # the active Keras'

keras = tf.keras

# A window property: each Keras 2 family's cells run in one Keras 2 leg
# (.ci/legs.py: keras2's in tfkeras, legacy's in tf215; one Keras 2 package each).
pytestmark = pytest.mark.windows
TOL = 1e-6
N, B, WINDOWS = 4, 8, 3
# The families whose models have a pooling BatchNormalization: Keras 3, and
# Keras 2's models trained by either Keras 2 family. (TF1 graph code: no.)
BN_FAMILIES = ("keras3", "keras2", "legacy")


@pytest.fixture(params=[
    pytest.param(f, id=f, marks=[getattr(pytest.mark, f)] + (
        [pytest.mark.skip(reason=skip_reason(f))] if skip_reason(f) else []))
    for f in BN_FAMILIES
])
def O(request):
    """The family's optimizers module (Keras 2's legacy one for the legacy family)."""
    return tf.keras.optimizers.legacy if request.param == "legacy" else tf.keras.optimizers


def _data(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, (n, *shape)).astype("float32")
    return x, rng.normal(size=(n, 1)).astype("float32")


def _dense(front_trainable=False, two=False):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((5,)), keras.layers.Dense(6, trainable=front_trainable),
              keras.layers.BatchNormalization(momentum=0.9)]
    if two:
        layers += [keras.layers.Dense(4), keras.layers.BatchNormalization(momentum=0.8)]
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def _conv(data_format):
    """Conv -> BN (channels_last, the conv frozen), or BN on the input
    (channels_first: TF's CPU convolution is NHWC only)."""
    keras.utils.set_random_seed(1)
    if data_format == "channels_last":
        return keras.Sequential([
            keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, trainable=False),
            keras.layers.BatchNormalization(momentum=0.9), keras.layers.Flatten(), keras.layers.Dense(1),
        ])
    return keras.Sequential([
        keras.Input((2, 6, 6)), keras.layers.BatchNormalization(axis=1, momentum=0.9),
        keras.layers.Flatten(), keras.layers.Dense(1),
    ])


def _step(model, optimizer):
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _bns(model, cls=keras.layers.BatchNormalization):
    return [layer for layer in model.layers if isinstance(layer, cls)]


def _stats(model):
    return [(bn.moving_mean.numpy(), bn.moving_variance.numpy()) for bn in _bns(model)]


def _assert_stats_close(got, want, tol=TOL):
    for (gm, gv), (wm, wv) in zip(got, want, strict=True):
        np.testing.assert_allclose(gm, wm, rtol=0, atol=tol)
        np.testing.assert_allclose(gv, wv, rtol=0, atol=tol)


def _assert_one_window_matches_the_large_batch(reference, model, x, y, O):
    """``reference`` takes one step on ``x`` (N·B rows), ``model`` one
    window of N micro-batches of B; then their moving statistics agree."""
    _step(reference, O.SGD(0.1))(x, y)
    step = _step(model, AccumulatingOptimizer(O.SGD(0.1), N))
    for k in range(N):
        step(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
    _assert_stats_close(_stats(model), _stats(reference))


def _pair(make):
    """The reference model (Keras' layer) and its converted copy."""
    reference = make()
    return reference, convert_batch_norm(reference)


# ---------------------------------------------------------- the large batch
@pytest.mark.parametrize("make", [
    _dense, lambda: _conv("channels_last"), lambda: _conv("channels_first"),
], ids=["dense", "conv-channels_last", "input-channels_first"])
def test_moving_statistics_equal_the_large_batch_after_every_window(make, O):
    reference, model = _pair(make)
    x, y = _data(N * B * WINDOWS, reference.input_shape[1:])
    ref_step = _step(reference, O.SGD(0.1))
    step = _step(model, AccumulatingOptimizer(O.SGD(0.1), N))
    for w in range(WINDOWS):
        ref_step(x[w * N * B:(w + 1) * N * B], y[w * N * B:(w + 1) * N * B])
        for k in range(N):
            lo = (w * N + k) * B
            step(x[lo:lo + B], y[lo:lo + B])
            if k < N - 1 and w == 0:  # inside the first window: nothing moved yet
                _assert_stats_close(_stats(model), [(np.zeros(s[0].shape), np.ones(s[1].shape)) for s in _stats(model)], 0)
        _assert_stats_close(_stats(model), _stats(reference))
        assert all(float(bn.window_count.numpy()) == 0 for bn in _bns(model, BatchNormalization))


def test_fit_moving_statistics_equal_the_large_batch(O):
    reference, model = _pair(_dense)
    x, y = _data(N * B * WINDOWS, (5,))
    reference.compile(O.SGD(0.1), "mse")
    model.compile(AccumulatingOptimizer(O.SGD(0.1), N), "mse")
    reference.fit(x, y, batch_size=N * B, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    _assert_stats_close(_stats(model), _stats(reference))


def test_first_window_of_a_fully_trainable_model_equals_the_large_batch(O):
    """Its first BN: the layers in front have not moved yet. (A second BN
    sees what the first normalised by each micro-batch's own moments, not
    the large batch's: the next test.)"""
    reference, model = _pair(lambda: _dense(front_trainable=True))
    x, y = _data(N * B, (5,))
    _assert_one_window_matches_the_large_batch(reference, model, x, y, O)


def test_every_bn_of_a_trainable_network_pools_the_inputs_it_saw(O):
    """Two BNs, every layer training: after each window, each BN's moving
    statistics are one momentum step from the moments of the inputs it saw
    in the window (recomputed here with the window's starting weights, which
    stay put inside the window)."""
    _, model = _pair(lambda: _dense(front_trainable=True, two=True))
    x, y = _data(N * B * WINDOWS, (5,))
    step = _step(model, AccumulatingOptimizer(O.Adam(0.05), N))
    probe = keras.Sequential([keras.Input((5,))] + [
        keras.layers.BatchNormalization.from_config(layer.get_config())
        if isinstance(layer, BatchNormalization) else layer.__class__.from_config(layer.get_config())
        for layer in model.layers])
    bn_at = [i for i, layer in enumerate(model.layers) if isinstance(layer, BatchNormalization)]
    for w in range(WINDOWS):
        before = _stats(model)
        for p, m in zip(probe.layers, model.layers):
            p.set_weights(m.get_weights()[:len(p.get_weights())])
        seen = {i: [] for i in bn_at}
        for k in range(N):
            h = x[(w * N + k) * B:(w * N + k + 1) * B]
            for i, layer in enumerate(probe.layers[:bn_at[-1] + 1]):
                if i in seen:
                    seen[i].append(np.asarray(h))
                h = layer(h, training=True)
        for k in range(N):
            lo = (w * N + k) * B
            step(x[lo:lo + B], y[lo:lo + B])
        for (mean, var), (old_m, old_v), i in zip(_stats(model), before, bn_at):
            inputs, momentum = np.concatenate(seen[i]).astype("float64"), model.layers[i].momentum
            np.testing.assert_allclose(mean, old_m * momentum + inputs.mean(0) * (1 - momentum), rtol=0, atol=TOL)
            np.testing.assert_allclose(var, old_v * momentum + inputs.var(0) * (1 - momentum), rtol=0, atol=TOL)


# --------------------------------------------------- windows of every shape
@pytest.mark.parametrize("loop", ["fit", "eager"])
def test_a_forward_pass_before_accumulated_training_keeps_keras_update(loop, O):
    """A training-mode forward pass outside any step (a warm-up, a plain
    eager phase) moves the statistics as Keras' layer does; the
    accumulated training after it starts its first window empty."""
    reference, model = _pair(_dense)
    probe, _ = _data(B, (5,), seed=3)
    x, y = _data(N * B, (5,))
    reference(probe, training=True)
    model(probe, training=True)
    _step(reference, O.SGD(0.1))(x, y)
    opt = AccumulatingOptimizer(O.SGD(0.1), N)
    if loop == "fit":
        model.compile(opt, "mse")
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    else:
        for k in range(N):
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y[k * B:(k + 1) * B], model(x[k * B:(k + 1) * B], training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    _assert_stats_close(_stats(model), _stats(reference))


def test_unequal_micro_batches_pool_by_their_sizes(O):
    sizes = (4, 4, 2)
    reference, model = _pair(_dense)
    x, y = _data(sum(sizes), (5,))
    _step(reference, O.SGD(0.1))(x, y)
    opt = AccumulatingOptimizer(O.SGD(0.1), len(sizes))
    edges = np.cumsum((0,) + sizes)
    for lo, hi in zip(edges[:-1], edges[1:]):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[lo:hi], model(x[lo:hi], training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    _assert_stats_close(_stats(model), _stats(reference))


def test_masked_micro_batches_pool_by_their_unmasked_counts(O):
    """A sequence model with masked time steps (a different number in each
    micro-batch): the pool counts the unmasked elements, as the large
    batch's masked moments do."""
    def make():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((5, 3)), keras.layers.Masking(0.0), keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1),
        ])

    reference, model = _pair(make)
    x, y = _data(N * B, (5, 3))
    steps = np.arange(5)[None, :, None]
    x = np.where(steps < np.random.default_rng(1).integers(1, 6, (N * B, 1, 1)), x, 0.0).astype("float32")
    _assert_one_window_matches_the_large_batch(reference, model, x, y, O)


def test_a_flushed_partial_window_moves_them_by_what_it_holds(O):
    reference, model = _pair(_dense)
    x, y = _data(2 * B, (5,))
    _step(reference, O.SGD(0.1))(x, y)
    opt = AccumulatingOptimizer(O.SGD(0.1), N)
    step = _step(model, opt)
    step(x[:B], y[:B])
    step(x[B:], y[B:])
    assert _stats(model)[0][0].tolist() == [0.0] * 6  # the window is open
    opt.flush()
    _assert_stats_close(_stats(model), _stats(reference))
    opt.flush()  # an empty window: nothing moves
    _assert_stats_close(_stats(model), _stats(reference))


def test_flush_partial_window_callback_in_fit(O):
    reference, model = _pair(_dense)
    x, y = _data(6 * B, (5,))  # one window of 4 and a partial one of 2 micro-batches
    reference.compile(O.SGD(0.1), "mse")
    reference.fit(x[:4 * B], y[:4 * B], batch_size=4 * B, verbose=0)
    reference.fit(x[4 * B:], y[4 * B:], batch_size=2 * B, verbose=0)
    model.compile(AccumulatingOptimizer(O.SGD(0.1), N), "mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[FlushPartialWindow()])
    _assert_stats_close(_stats(model), _stats(reference))


def test_an_accumulation_schedule_closes_windows_of_each_length(O):
    schedule, windows = {0: 1, 2: 4}, (1, 1, 4, 4)
    reference, model = _pair(_dense)
    x, y = _data(B * sum(windows), (5,))
    ref_step = _step(reference, O.SGD(0.1))
    step = _step(model, AccumulatingOptimizer(O.SGD(0.1), schedule))
    lo = 0
    for n in windows:
        ref_step(x[lo:lo + n * B], y[lo:lo + n * B])
        for _ in range(n):
            step(x[lo:lo + B], y[lo:lo + B])
            lo += B
        _assert_stats_close(_stats(model), _stats(reference))


# ----------------------------------------------------------------- resume
@pytest.mark.parametrize("fmt", ["keras", "weights.h5", "checkpoint"])
def test_resume_mid_window_gives_the_large_batch_statistics(tmp_path, fmt, O):
    if fmt == "keras" and O is getattr(keras.optimizers, "legacy", None):
        pytest.skip("Keras 2 drops a legacy optimizer's state from .keras (docs/saving.md): the window restarts")
    reference, model = _pair(_dense)
    x, y = _data(N * B, (5,))
    _step(reference, O.SGD(0.1))(x, y)
    opt = AccumulatingOptimizer(O.SGD(0.1), N)
    model.compile(opt, "mse")
    step = _step(model, opt)
    for k in range(2):
        step(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
    if fmt == "keras":
        model.save(tmp_path / "m.keras")
        restored = keras.models.load_model(tmp_path / "m.keras")
        opt2 = restored.optimizer
    else:
        _, restored = _pair(_dense)
        opt2 = AccumulatingOptimizer(O.SGD(0.1), N)
        restored.compile(opt2, "mse")
        if fmt == "weights.h5":
            model.save_weights(tmp_path / "m.weights.h5")
            restored.load_weights(tmp_path / "m.weights.h5")
            opt2.build(restored.trainable_variables)
            opt2.mini_step.assign(opt.mini_step)  # .weights.h5 holds the model's weights only
        else:
            path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
            opt2.build(restored.trainable_variables)
            tf.train.Checkpoint(model=restored, optimizer=opt2).read(path).assert_consumed()
    pooled = _bns(restored, BatchNormalization)[0]
    assert float(pooled.window_count.numpy()) == 2 * B
    step2 = _step(restored, opt2)
    for k in range(2, N):
        step2(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
    _assert_stats_close(_stats(restored), _stats(reference))


# -------------------------------------------------- exactly the parent layer
@pytest.mark.parametrize("optimizer", ["plain", "n1"])
def test_without_an_accumulating_window_it_is_bitwise_the_parent(optimizer, O):
    reference, model = _pair(_dense)
    x, y = _data(3 * B, (5,))
    make = (lambda: O.Adam(0.01)) if optimizer == "plain" else (
        lambda: AccumulatingOptimizer(O.Adam(0.01), 1))
    ref_step, step = _step(reference, O.Adam(0.01)), _step(model, make())
    for k in range(3):
        ref_step(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        step(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
    for ref_layer, layer in zip(reference.layers, model.layers, strict=True):
        want = ref_layer.get_weights()
        for got, expected in zip(layer.get_weights()[:len(want)], want, strict=True):
            np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(model(x, training=False), reference(x, training=False))


# ------------------------------------------------------------- conversion
def test_convert_batch_norm_replaces_every_bn_and_keeps_the_outputs(O):
    original = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=3, alpha=0.35)
    for bn in _bns(original):  # moving statistics other than the initial ones, so the copy is seen
        bn.moving_mean.assign(np.linspace(-1, 1, bn.moving_mean.shape[0]))
        bn.moving_variance.assign(np.linspace(0.5, 2, bn.moving_variance.shape[0]))
    converted = convert_batch_norm(original)
    assert len(_bns(original)) > 10
    assert len(_bns(converted, BatchNormalization)) == len(_bns(original))
    assert all(isinstance(bn, BatchNormalization) for bn in _bns(converted))
    assert not any(isinstance(bn, BatchNormalization) for bn in _bns(original))
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(converted(x, training=False), original(x, training=False))


def test_convert_batch_norm_keeps_a_frozen_nested_backbone_unfreezable(O):
    """A frozen nested backbone (the fine-tuning case) converts frozen, and
    unfreezing the copy unfreezes its layers, as with the original."""
    keras.utils.set_random_seed(1)
    backbone = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization()],
                                name="backbone")
    backbone.trainable = False
    inputs = keras.Input((5,))
    original = keras.Model(inputs, keras.layers.Dense(1)(backbone(inputs)))
    if skip_reason("keras3") is not None:  # Keras 2's clone_model does not reach into nested models
        backbone_copy = convert_batch_norm(backbone)
        inputs = keras.Input((5,))
        original = keras.Model(inputs, keras.layers.Dense(1)(backbone_copy(inputs)))
    converted = convert_batch_norm(original)
    nested = [layer for layer in converted.layers if isinstance(layer, keras.Model)][0]
    assert not nested.trainable and len(converted.trainable_weights) == len(original.trainable_weights) == 2
    assert isinstance(nested.layers[-1], BatchNormalization)
    nested.trainable = True
    assert len(converted.trainable_weights) == 2 + 4  # the Dense's kernel and bias, gamma and beta


def test_convert_batch_norm_refuses_renorm_with_the_reason(O):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(renorm=True, name="rn")])
    with pytest.raises(ValueError, match="'rn' has renorm=True"):
        convert_batch_norm(model)


def test_convert_batch_norm_refuses_a_subclassed_model(O):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    net = Net()
    net(np.zeros((1, 3), "float32"))
    with pytest.raises(TypeError, match="Net.*accum_optimizer.layers.BatchNormalization in place of"):
        convert_batch_norm(net)


# ------------------------------------------------------- config and errors
def test_saved_model_loads_with_only_the_package_imported(tmp_path, O):
    _, model = _pair(_dense)
    model.save(tmp_path / "m.keras")
    restored = keras.models.load_model(tmp_path / "m.keras")
    assert type(_bns(restored)[0]) is BatchNormalization
    assert _bns(restored)[0].get_config() == _bns(model)[0].get_config()


def test_renorm_is_refused_with_the_alternative(O):
    with pytest.raises(ValueError, match="renorm=True.*keras.layers.BatchNormalization"):
        BatchNormalization(renorm=True)


def test_one_layer_trained_by_two_accumulating_optimizers_is_refused(O):
    _, model = _pair(_dense)
    x, y = _data(B, (5,))
    first = AccumulatingOptimizer(O.SGD(0.1), N)
    _step(model, first)(x, y)
    second = AccumulatingOptimizer(O.SGD(0.1), N, name="second")
    with pytest.raises(ValueError, match="already follows the windows of.*second"):
        second.build(model.trainable_variables)


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_mirrored_strategy_pools_over_replicas_like_the_single_device_large_batch(loop, O, strategy):
    """Two replicas (logical CPUs; the session's one strategy: a second
    MirroredStrategy in a process reuses its collective keys), each
    micro-batch of B split between them:
    after every window the moving statistics equal those of one device
    trained on batches of N·B (the replicas' moments merged, then the
    micro-steps')."""
    reference = _dense()
    x, y = _data(N * B * 2, (5,))
    ref_step = _step(reference, O.SGD(0.1))
    with strategy.scope():
        model = convert_batch_norm(_dense())
        opt = AccumulatingOptimizer(O.SGD(0.1), N)
        model.compile(opt, "mse")
        if loop == "custom" or skip_reason("keras3") is not None:
            # As Keras 3's fit does (Keras 2's builds inside the first step):
            # the layers' link exists when the step is traced.
            opt.build(model.trainable_variables)
    for w in range(2):
        window = slice(w * N * B, (w + 1) * N * B)
        ref_step(x[window], y[window])
        if loop == "fit":
            model.fit(x[window], y[window], batch_size=B, shuffle=False, verbose=0)
        else:
            @tf.function
            def step(xb, yb):
                def replica_step(xr, yr):
                    with tf.GradientTape() as tape:
                        per_example = tf.reduce_mean(tf.square(yr - model(xr, training=True)), axis=-1)
                        loss = tf.nn.compute_average_loss(per_example, global_batch_size=B)
                    grads = tape.gradient(loss, model.trainable_variables)
                    opt.apply_gradients(zip(grads, model.trainable_variables))
                strategy.run(replica_step, args=(xb, yb))

            dataset = strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x[window], y[window])).batch(B))
            for xb, yb in dataset:
                step(xb, yb)
        _assert_stats_close(_stats(model), _stats(reference))


def test_a_multi_replica_step_traced_before_the_link_is_refused_at_build(O, strategy):
    with strategy.scope():
        model = convert_batch_norm(_dense())
        opt = AccumulatingOptimizer(O.SGD(0.1), N)

    @tf.function
    def step(xb, yb):
        def replica_step(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(yr - model(xr, training=True)))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica_step, args=(xb, yb))

    x, y = _data(B, (5,))
    with pytest.raises(ValueError, match="before .* was built.*optimizer.build"):
        step(tf.constant(x), tf.constant(y))
