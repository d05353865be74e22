"""Hardening of the Keras 3 wrapper (issue 6): inputs of unknown length,
sparse gradients under MirroredStrategy, the attributes Keras reads through a
wrapper, and the smaller defects.

References: the same data with a known length (``assert_cardinality``), the
single-device batch-N*B run, plain Keras without the wrapper, or values
derived by hand in the comments.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.graph_deps import micro_step_ops
from support.reference import make_data, make_mlp, max_abs_diff, weights

N = 4


# --------------------------------------------------------------------------
# 1. Inputs of unknown length: no phantom micro-step at the end of an epoch
# --------------------------------------------------------------------------
def _xy(n=24, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, x.sum(1, keepdims=True) + 0.1 * rng.normal(size=(n, 1)).astype("float32")


def _generator_ds(x, y, batch):
    return tf.data.Dataset.from_generator(
        lambda: iter(zip(x, y)),
        output_signature=(tf.TensorSpec([3], tf.float32), tf.TensorSpec([1], tf.float32)),
    ).batch(batch)


def _filtered_ds(x, y, batch):
    # A predicate that keeps everything still makes the length unknown.
    return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: tf.reduce_all(tf.math.is_finite(a))).batch(batch)


def _python_generator(x, y, batch):
    def gen():
        while True:  # Keras iterates a generator for steps_per_epoch batches
            for i in range(0, len(x), batch):
                yield x[i : i + batch], y[i : i + batch]

    return gen()


def _known(ds, batches):
    return ds.apply(tf.data.experimental.assert_cardinality(batches))


def _dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh"), keras.layers.Dense(1)])


def _fit_counts(make_input, steps_per_execution=1, jit_compile=False, epochs=4, strategy=None):
    x, y = _xy()
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = _dense_model()
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), N)
        model.compile(opt, "mse", steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    data, kwargs = make_input(x, y)
    model.fit(data, epochs=epochs, verbose=0, **kwargs)
    return model, opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


UNKNOWN_LENGTH_INPUTS = {
    # 24 samples in batches of 8: 3 micro-batches per epoch.
    "from_generator": lambda x, y: (_generator_ds(x, y, 8), {}),
    "filter": lambda x, y: (_filtered_ds(x, y, 8), {}),
}


@pytest.mark.parametrize("steps_per_execution", [1, 2])
@pytest.mark.parametrize("name", sorted(UNKNOWN_LENGTH_INPUTS))
def test_unknown_length_input_counts_only_real_micro_steps(name, steps_per_execution):
    make = UNKNOWN_LENGTH_INPUTS[name]
    model, opt = _fit_counts(make, steps_per_execution)
    # 4 epochs x 3 real micro-batches = 12 micro-steps = 3 windows of 4.
    assert int(opt.micro_steps.numpy()) == 12
    assert int(opt.iterations.numpy()) == 3
    ref_model, ref_opt = _fit_counts(lambda x, y: (_known(make(x, y)[0], 3), {}), steps_per_execution)
    assert int(ref_opt.micro_steps.numpy()) == 12
    assert max_abs_diff(weights(ref_model), weights(_dense_model())) > 1e-3  # training moved it
    assert max_abs_diff(weights(model), weights(ref_model)) == 0.0


def test_python_generator_equals_known_length_input():
    gen = lambda x, y: (_python_generator(x, y, 8), {"steps_per_epoch": 3})  # noqa: E731
    model, opt = _fit_counts(gen)
    ref_model, ref_opt = _fit_counts(lambda x, y: (_known(_generator_ds(x, y, 8), 3), {}))
    assert int(opt.micro_steps.numpy()) == int(ref_opt.micro_steps.numpy()) == 12
    assert int(opt.iterations.numpy()) == 3
    assert max_abs_diff(weights(model), weights(ref_model)) == 0.0


def test_unknown_length_input_with_jit_compile_counts_only_real_micro_steps():
    model, opt = _fit_counts(UNKNOWN_LENGTH_INPUTS["from_generator"], jit_compile=True)
    ref_model, _ = _fit_counts(lambda x, y: (_known(_generator_ds(x, y, 8), 3), {}), jit_compile=True)
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (12, 3)
    assert max_abs_diff(weights(model), weights(ref_model)) == 0.0


def test_unknown_length_input_under_mirrored_strategy_counts_only_real_micro_steps(strategy):
    model, opt = _fit_counts(UNKNOWN_LENGTH_INPUTS["from_generator"], strategy=strategy)
    ref_model, _ = _fit_counts(lambda x, y: (_known(_generator_ds(x, y, 8), 3), {}), strategy=strategy)
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (12, 3)
    assert max_abs_diff(weights(model), weights(ref_model)) <= 1e-6


def test_custom_loop_reading_an_exhausted_iterator_in_the_step_loses_nothing():
    # The step reads the iterator itself; the call that hits the end of the
    # data raises OutOfRangeError, and must not count as a micro-step.
    x, y = _xy()
    model = _dense_model()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), N)

    @tf.function
    def step(iterator):
        xb, yb = next(iterator)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(yb - model(xb)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(4):  # 4 epochs
        iterator = iter(_generator_ds(x, y, 8))
        while True:
            try:
                step(iterator)
            except (tf.errors.OutOfRangeError, StopIteration):
                break
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (12, 3)
    # Reference: fit over the same data with a known length.
    ref = _dense_model()
    ref_opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), N)
    ref.compile(ref_opt, "mse")
    ref.fit(_known(_generator_ds(x, y, 8), 3), epochs=4, verbose=0)
    assert max_abs_diff(weights(model), weights(ref)) <= 1e-6


def _text_data(n=24, vocab=30, seed=5):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, vocab, size=rng.integers(2, 9)).astype("int32") for _ in range(n)]
    labels = rng.integers(0, 2, size=(n, 1)).astype("float32")
    return seqs, labels


def _text_ds(seqs, labels, batch, known):
    ds = tf.data.Dataset.from_generator(
        lambda: iter(zip(seqs, labels)),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([1], tf.float32)),
    ).padded_batch(batch, padded_shapes=([None], [1]))
    return _known(ds, len(seqs) // batch) if known else ds


def _gru_fit(known, epochs=4):
    seqs, labels = _text_data()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(30, 4, mask_zero=True),
        keras.layers.GRU(3),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), N)
    model.compile(opt, "binary_crossentropy")
    model.fit(_text_ds(seqs, labels, 8, known), epochs=epochs, verbose=0)
    return model, opt


def test_gru_text_model_with_padded_batch_from_a_generator_equals_known_length():
    model, opt = _gru_fit(known=False)
    ref, ref_opt = _gru_fit(known=True)
    assert int(opt.micro_steps.numpy()) == int(ref_opt.micro_steps.numpy()) == 12
    assert int(opt.iterations.numpy()) == 3
    assert max_abs_diff(weights(model), weights(ref)) <= 1e-6


# --------------------------------------------------------------------------
# 1b. Embedding under MirroredStrategy
# --------------------------------------------------------------------------
def _embedding_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(50, 4),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])


def test_embedding_fit_under_mirrored_strategy_matches_single_device_large_batch(strategy):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 12, size=(48, 3)).astype("int32")  # repeated ids
    y = rng.normal(size=(48, 1)).astype("float32")
    b = 4  # per-step global micro-batch (2 per replica)
    with strategy.scope():
        model = _embedding_model()
        # SGD with momentum: Keras applies IndexedSlices with repeated ids
        # exactly like the dense gradient (Adam would not; see the README).
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.2, momentum=0.9), N)
        model.compile(opt, "mse")
    model.fit(x, y, batch_size=b, epochs=2, shuffle=False, verbose=0)
    ref = _embedding_model()
    ref_opt = keras.optimizers.SGD(0.2, momentum=0.9)
    ref.compile(ref_opt, "mse")
    ref.fit(x, y, batch_size=N * b, epochs=2, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 6
    assert max_abs_diff(weights(ref), weights(_embedding_model())) > 1e-3
    assert max_abs_diff(weights(model), weights(ref)) <= 1e-5


def test_embedding_micro_step_under_mirrored_strategy_is_a_scatter_add(strategy):
    # The replica's accumulate path must stay sparse: no dense conversion of
    # the table-shaped gradient in the traced step.
    with strategy.scope():
        model = _embedding_model()
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), N)
        opt.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        def replica(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(yr - model(xr)))
            grads = tape.gradient(loss, model.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica, args=(xb, yb))

    x = tf.constant(np.arange(6, dtype="int32").reshape(2, 3))
    y = tf.zeros((2, 1))
    graph = step.get_concrete_function(x, y).graph
    ops = micro_step_ops(graph)  # an accumulate-only micro-step's (the window cond's false branch)
    assert "ResourceScatterAdd" in {op.type for op in ops}
    for op in ops:
        if op.type in ("UnsortedSegmentSum", "ScatterNd") and op.outputs[0].shape.as_list()[:1] == [50]:
            raise AssertionError(f"dense conversion of the table's gradient: {op.name}")
    step(x, y)
    assert int(opt.micro_steps.numpy()) == 1


def test_none_gradient_on_the_closing_micro_step_under_mirrored_strategy(strategy):
    # Hand reference: SGD(0.1), N = 2, 2 replicas. Keras sums the replicas'
    # gradients (fit scales each replica's loss by 1/replicas; here the raw
    # gradients go in, as plain Keras would take them). `a` gets 1 then 3 on
    # each replica: window mean 2 per replica, a = 1 - 0.1 * (2 + 2). `b` gets
    # 2 on the first micro-step only: window mean 1, b = 1 - 0.1 * (1 + 1).
    # `c` never gets one: untouched. Every replica runs the gated update at
    # once around the same inner optimizer.
    with strategy.scope():
        a, b, c = (keras.Variable(np.ones(2, "float32"), name=n) for n in "abc")
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2)
        opt.build([a, b, c])

    @tf.function
    def step(ga, gb):
        strategy.run(lambda: opt.apply([ga, gb, None], [a, b, c]))

    @tf.function
    def closing(ga):
        strategy.run(lambda: opt.apply([ga, None, None], [a, b, c]))

    step(tf.fill((2,), 1.0), tf.fill((2,), 2.0))
    closing(tf.fill((2,), 3.0))
    assert int(opt.iterations.numpy()) == 1
    for v in (a, b, c):
        for component in strategy.experimental_local_results(v.value):
            np.testing.assert_allclose(
                component.numpy(), {"a": 0.6, "b": 0.8, "c": 1.0}[v.name], rtol=1e-6
            )


# --------------------------------------------------------------------------
# 2. Attributes that Keras reads through a wrapper
# --------------------------------------------------------------------------
def test_loss_scale_optimizer_outside_switches_off_the_inner_loss_scale_factor_once():
    # Issue 6's example. Without the wrapper, LSO divides by its own scale
    # only: v = [1,2,3,4] - 0.5 * [1,6,7,2] = [0.5, -1, -0.5, 3].
    def run(wrap):
        sgd = keras.optimizers.SGD(0.5, loss_scale_factor=100)
        opt = keras.optimizers.LossScaleOptimizer(wrap(sgd))
        v = keras.Variable([1.0, 2.0, 3.0, 4.0])
        opt.apply([keras.ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale], [v])
        return v.numpy()

    expected = np.array([1, 2, 3, 4], "float32") - 0.5 * np.array([1, 6, 7, 2], "float32")
    np.testing.assert_allclose(run(lambda o: o), expected, rtol=1e-6)
    np.testing.assert_allclose(run(lambda o: AccumulatingOptimizer(o, 1)), expected, rtol=1e-6)


def test_loss_scale_factor_on_the_inner_is_applied_once_per_update():
    # No LSO: scale_loss multiplies by 100 (inner's factor), the update divides
    # by it once: w = 0 - 0.1 * mean(1, 3) = -0.2.
    w = keras.Variable(np.zeros(2, "float32"))
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=100.0), 2)
    for g in (1.0, 3.0):
        opt.apply([opt.scale_loss(tf.fill((2,), g))], [w])
    np.testing.assert_allclose(w.numpy(), [-0.2, -0.2], rtol=1e-6)


FORWARDED_READS = [
    # attribute, who reads it (keras/src/...)
    ("learning_rate", "callbacks: learning_rate_scheduler, reduce_lr_on_plateau, tensorboard"),
    ("iterations", "callbacks: tensorboard, orbax_checkpoint; trainers"),
    ("use_ema", "callbacks/swap_ema_weights.py"),
    ("_model_variables_moving_average", "callbacks/swap_ema_weights.py"),
    ("loss_scale_factor", "optimizers/loss_scale_optimizer.py"),
    ("optimizers", "callbacks: learning_rate_scheduler, reduce_lr_on_plateau, tensorboard"),
    ("ema_momentum", "optimizer config"),
    ("clipnorm", "optimizer config"),
    ("global_clipnorm", "optimizer config"),
    ("clipvalue", "optimizer config"),
    ("weight_decay", "optimizer config"),
]


@pytest.mark.parametrize("through_lso", [False, True], ids=["wrapper", "lso_of_wrapper"])
@pytest.mark.parametrize("multi", [False, True], ids=["adamw", "multi"])
def test_attributes_keras_reads_answer_as_the_inner_optimizer(multi, through_lso):
    model = make_mlp()
    o = keras.optimizers
    if multi:
        inner = o.MultiOptimizer(lambda v: o.Adam(1e-2, use_ema=True) if "kernel" in v.path else o.SGD(0.1))
    else:
        inner = o.AdamW(1e-2, weight_decay=0.1, use_ema=True, clipnorm=2.0)
    opt = AccumulatingOptimizer(inner, N)
    seen = keras.optimizers.LossScaleOptimizer(opt) if through_lso else opt
    # Keras unwraps `inner_optimizer` at most once: LSO -> our wrapper.
    target = seen.inner_optimizer if through_lso else seen
    assert target is opt
    seen.build(model.trainable_variables)
    for name, _reader in FORWARDED_READS:
        assert hasattr(target, name) == hasattr(inner, name), name
        if hasattr(inner, name):
            got, want = getattr(target, name), getattr(inner, name)
            if isinstance(want, list):
                assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), name
            else:
                assert got is want or got == want, name
    assert set(map(id, opt.inner_optimizer.variables)) <= set(map(id, seen.variables))


def test_learning_rate_callbacks_work_with_a_multi_optimizer_inside():
    # Reference: plain Keras, the same MultiOptimizer and callbacks at batch
    # N*B (the callbacks act per epoch, so the schedule of learning rates and
    # the weights must agree).
    x, y = make_data(N * 4 * 2)
    o = keras.optimizers

    def run(wrap, batch):
        inner = o.MultiOptimizer(lambda v: o.Adam(1e-2) if "kernel" in v.path else o.SGD(0.1))
        model = make_mlp()
        model.compile(wrap(inner), "mse")
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9),
        ]
        model.fit(x, y, batch_size=batch, epochs=3, verbose=0, shuffle=False, callbacks=callbacks)
        return [float(sub.learning_rate.numpy()) for sub in inner.optimizers], weights(model)

    acc_lrs, acc_w = run(lambda inner: AccumulatingOptimizer(inner, N), 4)
    ref_lrs, ref_w = run(lambda inner: inner, N * 4)
    assert acc_lrs == ref_lrs
    assert acc_lrs[0] < 1e-2 / 4 and acc_lrs[1] < 0.1 / 4  # both callbacks acted
    assert max_abs_diff(acc_w, ref_w) <= 1e-6


def test_swap_ema_weights_accepts_loss_scaled_accumulation_with_ema():
    # Reference: plain LSO(Adam(use_ema)) at batch N*B; the callback swaps in
    # the EMA weights at the end of each epoch's evaluation... here: used as
    # in the Keras docs, swap_on_epoch=True, then the swapped-in weights at
    # epoch end are compared.
    x, y = make_data(N * 4 * 3)

    def run(make_opt, batch):
        model = make_mlp()
        opt = keras.optimizers.LossScaleOptimizer(make_opt())
        model.compile(opt, "mse")
        seen = []

        class Grab(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen.append(weights(self.model))

        # SwapEMAWeights swaps at epoch end before later callbacks see it.
        model.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True), Grab()])
        return seen

    adam = lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5)  # noqa: E731
    acc = run(lambda: AccumulatingOptimizer(adam(), N), 4)
    ref = run(adam, N * 4)
    assert len(acc) == len(ref) == 2
    for a, r in zip(acc, ref):
        assert max_abs_diff(a, r) <= 1e-6


# --------------------------------------------------------------------------
# 3. Smaller defects
# --------------------------------------------------------------------------
def _float8_like_variables():
    v = keras.Variable(np.ones(3, "float32"), name="w")
    s = keras.Variable(np.zeros(3, "float32"), name="scale", trainable=True)
    s.overwrite_with_gradient = True
    return v, s


def test_pass_through_accepts_overwrite_with_gradient_variables():
    # Reference: the plain inner optimizer. An overwrite_with_gradient
    # variable takes its "gradient" as its new value.
    results = []
    for wrap in (lambda o: o, lambda o: AccumulatingOptimizer(o, 1)):
        v, s = _float8_like_variables()
        opt = wrap(keras.optimizers.SGD(0.1))
        opt.apply([tf.ones(3), tf.fill((3,), 5.0)], [v, s])
        results.append((v.numpy(), s.numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_array_equal(results[1][1], np.full(3, 5.0, "float32"))


def test_overwrite_with_gradient_variables_take_the_window_maximum_once_per_window():
    # Reference by hand: an overwrite_with_gradient variable (float8 state)
    # is overwritten once per window with the element-wise maximum of the
    # values it received (the large batch's amax over its samples), never
    # weighted or divided; untouched between updates; a window where it got
    # no value (the gate) leaves it as it is; a flushed window takes the
    # maximum of what it holds. The ordinary variable gets the mean.
    v, s = _float8_like_variables()
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 3)
    micro = [(tf.fill((3,), 1.0), tf.constant([-4.0, 2.0, 0.5])),
             (tf.fill((3,), 2.0), tf.constant([-5.0, 1.0, 3.0])),
             (tf.fill((3,), 3.0), None)]  # (s gets no value on the closing micro-step)
    for g, h in micro[:2]:
        opt.apply([g, h] if h is not None else [g], [v, s] if h is not None else [v], weight=2.0)
        np.testing.assert_array_equal(s.numpy(), np.zeros(3, "float32"))
    opt.apply([micro[2][0]], [v])
    np.testing.assert_array_equal(s.numpy(), np.array([-4.0, 2.0, 3.0], "float32"))
    np.testing.assert_allclose(v.numpy(), 1.0 - 0.1 * (2 * 1.0 + 2 * 2.0 + 3.0) / 5.0, rtol=1e-6)
    for _ in range(3):  # a window without a value for s: s stays
        opt.apply([tf.ones(3)], [v])
    np.testing.assert_array_equal(s.numpy(), np.array([-4.0, 2.0, 3.0], "float32"))
    opt.apply([tf.ones(3), tf.constant([7.0, -1.0, -2.0])], [v, s])
    opt.flush()
    np.testing.assert_array_equal(s.numpy(), np.array([7.0, -1.0, -2.0], "float32"))


def test_gradient_accumulation_steps_is_read_only_after_construction():
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), 4)
    with pytest.raises(AttributeError, match=r"(?s)read-only.*it is 4; received 2"):
        opt.gradient_accumulation_steps = 2
    assert opt.gradient_accumulation_steps == 4


def test_counters_show_restored_values_before_the_first_step(tmp_path):
    x, y = make_data(N * 4 * 3)
    model = make_mlp()
    model.compile(AccumulatingOptimizer(keras.optimizers.Adam(1e-2), N), "mse")
    model.fit(x[: 40], y[: 40], batch_size=4, epochs=1, verbose=0, shuffle=False)  # 10 micro-steps
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    fresh = make_mlp()
    opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), N)
    fresh.compile(opt, "mse")
    fresh.load_weights(path)
    assert opt.built  # by the load: the whole state is there before the first step
    # 10 micro-steps = 2 updates + 2 micro-steps into the third window.
    assert int(opt.iterations.numpy()) == 2
    assert int(opt.micro_steps.numpy()) == 10
    assert int(opt.mini_step.numpy()) == 2
    # ... and training on equals uninterrupted training.
    fresh.fit(x[40:], y[40:], batch_size=4, epochs=1, verbose=0, shuffle=False)
    model.fit(x[40:], y[40:], batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert max_abs_diff(weights(model), weights(fresh)) == 0.0


def test_missing_gradients_warn_as_plain_keras_does():
    a = keras.Variable(np.ones(2, "float32"), name="a")
    b = keras.Variable(np.ones(2, "float32"), name="b")
    messages = []
    for opt in (keras.optimizers.SGD(0.1), AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.apply([tf.ones(2), None], [a, b])
        messages.append([str(w.message) for w in caught if "Gradients do not exist" in str(w.message)])
    assert messages[0] and messages[1] == messages[0]


def test_unknown_keyword_gets_the_library_message_naming_accepted_arguments():
    with pytest.raises(TypeError, match=r"(?s)unexpected keyword.*steps=4.*Accepted: inner_optimizer, "
                       r"gradient_accumulation_steps, reduction, name.*gradient_accumulation_steps"):
        AccumulatingOptimizer(keras.optimizers.Adam(), steps=4)
    with pytest.raises(TypeError, match="missing the required argument `gradient_accumulation_steps`"):
        AccumulatingOptimizer(keras.optimizers.Adam())
    with pytest.raises(TypeError, match="missing the required argument `inner_optimizer`"):
        AccumulatingOptimizer(gradient_accumulation_steps=4)
