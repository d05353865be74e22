"""Accumulation under ``tf.distribute.MirroredStrategy`` (2 logical CPUs).

``conftest.py`` splits the CPU into two logical devices, so the strategy has
two replicas. The setting throughout: micro-batches of ``B = 8`` global
samples (4 per replica), ``N = 4`` micro-steps per update, so one update sees
``N * B = 32`` samples.

Keras scales the loss by ``1 / num_replicas`` under a strategy
(``keras.src.losses.loss.scale_loss_for_distribution``), so each replica's
gradient is ``grad(mean loss over its 4 samples) / 2`` and the sum over the
replicas is the gradient of the mean over all 8. Each replica adds its own
micro-batch gradients into its own (``ON_READ``) accumulator slots; on an
update step it hands ``slot / N`` to the inner optimizer, whose all-reduce
(SUM) is the only cross-replica reduction of the window. The result is the
gradient of the mean loss over the window's 32 samples, so the independent
reference is the plain inner optimizer trained on ONE device with batch 32
(same initial weights, same samples in the same order, no shuffling).

Clipping (``clipnorm`` / ``global_clipnorm`` on the inner optimizer) is not
part of that single-device comparison: plain Keras under a strategy clips each
replica's gradient before the all-reduce, which is not the same as clipping
the global gradient. It is compared instead against plain Keras under the same
strategy with batch ``N * B`` per step (``test_clipping_matches_plain_keras_
under_the_same_strategy``), with the data ordered so that each replica sees the
same samples in both runs.
"""

from __future__ import annotations

import functools

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer, CountedLoss, FlushPartialWindow
from support.reference import (
    MISSING_GRAD_INNERS,
    MISSING_GRAD_PATTERN,
    make_data,
    make_mlp,
    max_abs_diff,
    missing_grad_loss,
    missing_grad_model,
    missing_grad_reference,
    mse,
    train,
    weights,
)
from support.distribution import ReductionCounter
from support.drivers import driver

N = 4  # gradient_accumulation_steps
B = 8  # global micro-batch (4 samples per replica)
REPLICAS = 2
WINDOWS = 3  # updates per epoch
EPOCHS = 2
TOL = 1e-5

def _dataset(x, y, batch):
    # No shuffling: the same samples in the same order for every run.
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _fit(model, optimizer, x, y, batch, epochs, jit_compile=False):
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(_dataset(x, y, batch), epochs=epochs, shuffle=False, verbose=0)
    return model


# The inner optimizers of the MirroredStrategy fit (tests/contract/test_mirrored.py).
OPTIMIZERS = {c.name: functools.partial(c.make_inner, None) for c in driver("keras3").mirrored_cases()}


def _distributed_accumulating_fit(strategy, optimizer_fn, x, y, epochs=EPOCHS):
    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
        _fit(model, opt, x, y, B, epochs)
    return model, opt


def _assert_replicas_identical(variables):
    for v in variables:
        components = driver("keras3").replica_values(v, REPLICAS)
        for c in components[1:]:
            np.testing.assert_array_equal(c, components[0], err_msg=v.path)


# --------------------------------------------------------------------------
# The fault this library fixes: Keras' built-in accumulation
# --------------------------------------------------------------------------
def test_keras_builtin_accumulation_crashes_under_mirrored_fit(strategy):
    """Keras 3's own ``gradient_accumulation_steps`` puts the inner update
    (which calls ``merge_call``) inside a replica-context ``cond``; under
    MirroredStrategy in graph mode that raises. If a future Keras fixes it,
    this test fails and the README's claim needs revisiting."""
    x, y = make_data(N * B)
    with strategy.scope():
        model = make_mlp(seed=0)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=N),
            loss="mse",
            jit_compile=False,
        )
    with pytest.raises(RuntimeError, match=r"`merge_call` called while defining a new graph"):
        model.fit(_dataset(x, y, B), epochs=1, shuffle=False, verbose=0)

    # Same model and data, the wrapper instead: trains.
    model, opt = _distributed_accumulating_fit(strategy, lambda: keras.optimizers.Adam(1e-2), x, y, epochs=1)
    assert int(opt.iterations.numpy()) == 1


# --------------------------------------------------------------------------
# One cross-replica reduction per update, not per micro-step
# --------------------------------------------------------------------------
def _replica_gradients(model, x, y):
    """The hand reference: each replica's micro-batch gradient computed
    independently on one device, as Keras forms it under a 2-replica strategy:
    ``grad(mean loss over the replica's half of the batch) / num_replicas``."""
    clone = make_mlp(seed=0)
    clone.set_weights(model.get_weights())
    half = len(x) // REPLICAS
    out = []
    for r in range(REPLICAS):
        xs, ys = x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]
        with tf.GradientTape() as tape:
            loss = mse(ys, clone(xs, training=True)) / REPLICAS
        out.append([g.numpy() for g in tape.gradient(loss, clone.trainable_variables)])
    return out


def test_one_cross_replica_reduction_per_update_in_fit(strategy, monkeypatch):
    m = 2 * N + 1  # two updates, then one micro-step that does not update
    x, y = make_data(m * B, seed=3)
    counter = ReductionCounter(monkeypatch, strategy)

    # Control: plain Adam under the same strategy reduces once per step,
    # which shows the counter counts executions (the step is traced once).
    with strategy.scope():
        plain = make_mlp(seed=0)
        _fit(plain, keras.optimizers.Adam(1e-2), x, y, B, epochs=1)
    control = counter.counts()
    assert control["all_reduce"] == REPLICAS * m
    assert control["batch_reduce_to"] == m

    # The wrapper: m micro-steps, m // N updates, one reduction per update.
    counter.all_reduce.assign(0)
    counter.batch_reduce_to.assign(0)
    counter.reduce_to.assign(0)
    model, opt = _distributed_accumulating_fit(strategy, lambda: keras.optimizers.Adam(1e-2), x, y, epochs=1)
    assert int(opt.micro_steps.numpy()) == m
    assert int(opt.iterations.numpy()) == m // N == 2
    counts = counter.counts()
    assert counts["all_reduce"] == REPLICAS * (m // N), counts
    assert counts["batch_reduce_to"] == m // N, counts
    # `_reduce_to` is what Keras uses for the per-step logs (loss metric);
    # the wrapper adds none of its own: same number as the plain run.
    assert counts["reduce_to"] == control["reduce_to"], (counts, control)

    # After the last (non-update) micro-step each replica's slots hold only
    # its own local gradient of that micro-batch: not reduced, so the two
    # components differ, and each equals the hand-computed replica gradient.
    last_x, last_y = x[(m - 1) * B :], y[(m - 1) * B :]
    expected = _replica_gradients(model, last_x, last_y)
    for i, acc in enumerate(opt.acc_grads):
        components = [np.asarray(c.numpy()) for c in acc.value.values]
        assert len(components) == REPLICAS
        assert np.max(np.abs(components[0] - components[1])) > 1e-3
        for r in range(REPLICAS):
            np.testing.assert_allclose(components[r], expected[r][i], rtol=0, atol=1e-6)
        np.testing.assert_allclose(
            components[0] + components[1], expected[0][i] + expected[1][i], rtol=0, atol=1e-6
        )
        # Read in cross-replica context the ON_READ slot is their sum.
        np.testing.assert_allclose(acc.numpy(), components[0] + components[1], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------
# Custom loop: strategy.run(step_fn) inside tf.function
# --------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_custom_loop_strategy_run_matches_single_device_large_batch(strategy, monkeypatch, opt_name):
    optimizer_fn = OPTIMIZERS[opt_name]
    x, y = make_data(N * B * WINDOWS, seed=4)
    counter = ReductionCounter(monkeypatch, strategy)

    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
        # Built up front, as for any Keras optimizer in a custom distributed
        # loop: building lazily inside `strategy.run` fails on this TF/Keras
        # even for a plain keras.optimizers.Adam (InvalidArgumentError "You
        # must feed a value for placeholder tensor 'cond/Placeholder'").
        opt.build(model.trainable_variables)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            # Mean over the replica's samples, scaled so replicas sum to the
            # global mean (as tf.nn.compute_average_loss does).
            loss = mse(yb, model(xb, training=True)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(batch):
        strategy.run(step_fn, args=batch)

    for batch in strategy.experimental_distribute_dataset(_dataset(x, y, B)):
        train_step(batch)
    # Read before the reference runs: outside a strategy, the default replica
    # context's (no-op) all_reduce is called by every plain update too.
    counts = counter.counts()

    ref_model = make_mlp(seed=0)
    ref_opt = optimizer_fn()
    train(ref_model, ref_opt, x, y, N * B, WINDOWS)

    assert int(opt.micro_steps.numpy()) == N * WINDOWS
    assert int(opt.iterations.numpy()) == WINDOWS
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL
    assert max_abs_diff(weights(opt.inner_optimizer.variables), weights(ref_opt.variables)) <= TOL
    # Nothing else in this loop reduces across replicas: exactly one
    # reduction per update, none per micro-step.
    assert counts == {
        "all_reduce": REPLICAS * WINDOWS,
        "batch_reduce_to": WINDOWS,
        "reduce_to": 0,
    }


# --------------------------------------------------------------------------
# Clipping: against plain Keras under the same strategy
# --------------------------------------------------------------------------
def _per_replica_order(x, big, micro, replicas):
    """Reorder samples so that accumulating micro-batches of ``micro`` give
    each replica exactly the samples plain Keras gives it from batches of
    ``big``: in plain training replica r gets ``batch[r*big/R:(r+1)*big/R]``;
    micro-batch k of the window is made of the k-th ``micro/R`` chunk of each
    replica's share."""
    local_big, local_micro = big // replicas, micro // replicas
    idx = []
    for w in range(len(x) // big):
        for k in range(big // micro):
            for r in range(replicas):
                start = w * big + r * local_big + k * local_micro
                idx.extend(range(start, start + local_micro))
    return np.asarray(idx)


# Thresholds inside the range of the per-replica gradient norms of this
# model and data (per variable 0.09..0.59, global 0.39..0.72), so some
# gradients are clipped and some are not.
@pytest.mark.parametrize("clip,c", [("clipnorm", 0.2), ("global_clipnorm", 0.5)])
def test_clipping_matches_plain_keras_under_the_same_strategy(strategy, clip, c):
    """Keras clips each replica's gradient before the all-reduce. The wrapper
    hands each replica's window gradient (``slot / N``) to the inner optimizer,
    which clips it, then all-reduces: the same per-replica clipping of the same
    per-replica gradient as plain Keras with batch ``N * B``, provided each
    replica sees the same samples (``_per_replica_order``)."""

    def optimizer_fn():
        return keras.optimizers.SGD(0.1, momentum=0.5, **{clip: c})

    x, y = make_data(N * B * WINDOWS, seed=5)
    order = _per_replica_order(x, N * B, B, REPLICAS)
    assert sorted(order.tolist()) == list(range(len(x)))

    model, opt = _distributed_accumulating_fit(strategy, optimizer_fn, x[order], y[order])

    with strategy.scope():
        ref_model = make_mlp(seed=0)
        _fit(ref_model, optimizer_fn(), x, y, N * B, EPOCHS)

    assert int(opt.iterations.numpy()) == WINDOWS * EPOCHS
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL

    # The comparison discriminates: clipping is active (the unclipped run
    # differs), and per-replica clipping is not single-device clipping.
    xe, ye = np.concatenate([x] * EPOCHS), np.concatenate([y] * EPOCHS)
    unclipped = train(make_mlp(seed=0), keras.optimizers.SGD(0.1, momentum=0.5), xe, ye, N * B, WINDOWS * EPOCHS)
    global_clip = train(make_mlp(seed=0), optimizer_fn(), xe, ye, N * B, WINDOWS * EPOCHS)
    assert max_abs_diff(weights(ref_model), weights(unclipped)) > 1e-3
    assert max_abs_diff(weights(ref_model), weights(global_clip)) > 1e-4


# --------------------------------------------------------------------------
# Weight decay on gated variables (issue 17, bug 0)
# --------------------------------------------------------------------------
def test_adamw_counted_loss_and_flush_under_mirrored_fit_match_single_device_large_batch(strategy):
    """The README's recipe (AdamW + CountedLoss + FlushPartialWindow) under
    MirroredStrategy: 86 samples in micro-batches of B = 8 (the last holds
    6), N = 4, so each epoch is two full windows and a flushed window of
    8 + 8 + 6 samples. The reference: AdamW on one device, fit with batch 32
    (32, 32, 22). Flushing gates every variable (its gradient is not taken on
    the flush), so the inner weight decay runs gated: it used to crash with
    "merge_call called while defining a new graph"."""
    n_samples = 2 * N * B + 2 * B + 6
    x, y = make_data(n_samples, seed=6)

    def optimizer_fn():
        return keras.optimizers.AdamW(2e-2, weight_decay=0.1)

    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=N)
        model.compile(optimizer=opt, loss=CountedLoss("mse"), jit_compile=False)
    model.fit(_dataset(x, y, B), epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[FlushPartialWindow()])

    ref_model = make_mlp(seed=0)
    ref_opt = optimizer_fn()
    _fit(ref_model, ref_opt, x, y, N * B, EPOCHS)

    assert int(opt.iterations.numpy()) == 3 * EPOCHS == int(ref_opt.iterations.numpy())
    assert int(opt.mini_step.numpy()) == 0
    assert max_abs_diff(weights(ref_model), weights(make_mlp(seed=0))) > 1e-2
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL
    assert max_abs_diff(weights(opt.inner_optimizer.variables), weights(ref_opt.variables)) <= TOL
    _assert_replicas_identical(list(model.weights) + list(opt.inner_optimizer.variables))


# ``MISSING_GRAD_INNERS``' SGD overwrites the weights with their EMA
# (``ema_overwrite_frequency``), which plain Keras cannot do under
# MirroredStrategy either (its overwrite runs a replica-context update in a
# ``cond``): an SGD with weight decay and EMA but no overwrite stands in.
DECAY_INNERS = {
    "adamw_ema": MISSING_GRAD_INNERS["adamw_ema"],
    "sgd_momentum_ema": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, weight_decay=0.1, use_ema=True, ema_momentum=0.5
    ),
}


@pytest.mark.parametrize("inner", sorted(DECAY_INNERS))
def test_weight_decay_skips_variables_without_gradient_under_mirrored_strategy(strategy, inner):
    """A two-branch model whose branch b gets no gradient on some micro-steps
    (``MISSING_GRAD_PATTERN``; never in the first and last windows), trained
    with ``strategy.run`` and an inner optimizer with weight decay: equal to
    the plain inner optimizer on one device with each window's large batch,
    where b, untouched by a window, gets no update, weight decay or
    constraint."""
    inner_fn = DECAY_INNERS[inner]
    mb = 4  # global micro-batch: 2 samples per replica
    steps = N * len(MISSING_GRAD_PATTERN)
    x, y = make_data(steps * mb, in_dim=4, out_dim=2, seed=8)

    with strategy.scope():
        model = missing_grad_model()
        opt = AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=N)
        opt.build(model.trainable_variables)

    def step_fn(xb, yb, uses_b):
        with tf.GradientTape() as tape:
            loss = missing_grad_loss(model, xb, yb, uses_b) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(xb, yb, uses_b):
        strategy.run(step_fn, args=(xb, yb, uses_b))

    flat = [u for window in MISSING_GRAD_PATTERN for u in window]
    batches = iter(strategy.experimental_distribute_dataset(_dataset(x, y, mb)))
    for uses_b in flat:
        train_step(*next(batches), uses_b)

    ref_model, ref_opt = missing_grad_reference(inner_fn, x, y, mb, n=N)
    assert int(opt.iterations.numpy()) == len(MISSING_GRAD_PATTERN) == int(ref_opt.iterations.numpy())
    assert max_abs_diff(weights(model), weights(missing_grad_model())) > 1e-3
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL
    assert max_abs_diff(weights(opt.inner_optimizer.variables), weights(ref_opt.variables)) <= TOL


# --------------------------------------------------------------------------
# keras.distribution on TensorFlow: Keras 3.15 places no variable by layout
# --------------------------------------------------------------------------
def test_keras_distribution_model_parallel_on_tensorflow_keeps_accumulators_beside_their_variables():
    """``keras.distribution.ModelParallel`` with a ``LayoutMap`` sharding a
    kernel, on the TensorFlow backend (Keras 3.15): Keras creates every
    variable as one unsharded ``tf.Variable`` (its TF backend does not apply
    a layout to variables), so there is no sharding for an accumulator to
    follow; each accumulator is the variable's shape and dtype, on the
    variable's device, and ``fit`` under the distribution trains like the
    plain inner optimizer at batch ``N * B`` without one."""
    x, y = make_data(2 * N * B)
    reference = _fit(make_mlp(seed=0), keras.optimizers.Adam(1e-2), x, y, N * B, EPOCHS)
    mesh = keras.distribution.DeviceMesh((1, 2), ("data", "model"), devices=keras.distribution.list_devices()[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    try:
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=N)
        _fit(model, opt, x, y, B, EPOCHS)
    finally:
        keras.distribution.set_distribution(None)
    kernel = model.layers[0].kernel
    assert isinstance(kernel.value, tf.Variable) and tuple(kernel.value.shape) == tuple(kernel.shape)  # unsharded
    by_path = {v.path: v for v in model.trainable_variables}
    for variable, acc in zip(opt._build_order, opt.acc_grads):
        assert by_path[variable.path] is variable
        assert (tuple(acc.shape), acc.dtype) == (tuple(variable.shape), variable.dtype)
        assert acc.value.device == variable.value.device, (acc.path, acc.value.device, variable.value.device)
    assert int(opt.inner_optimizer.iterations) == EPOCHS * len(x) // (N * B)
    assert max_abs_diff(weights(model), weights(reference)) <= TOL
