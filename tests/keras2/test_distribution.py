"""Keras 2 new API under ``tf.distribute.MirroredStrategy`` (2 logical CPUs):
each replica's own slots, missing gradients gated in every replica. (``fit``
against the single-device large batch, for every family:
tests/contract/test_mirrored.py.)

``conftest.py`` splits the CPU into two logical devices. Micro-batches of
``B = 8`` global samples (4 per replica), ``N = 4`` micro-steps per update.
Keras 2 scales each replica's loss by ``1 / num_replicas``, so the replicas'
gradients sum to the gradient of the mean over the global micro-batch. Each
replica adds its own gradients into its own ``ON_READ`` slots; on an update
it hands ``slot / N`` to the inner optimizer's ``apply_gradients``, whose
all-reduce (SUM) is the only cross-replica reduction of the window.
References: the gradients of each replica's half computed by hand on one
device; the single-device hand-built large batch.
"""

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from support.distribution import ReductionCounter  # noqa: E402
from support.drivers import driver  # noqa: E402
from support.reference import (  # noqa: E402
    MISSING_GRAD_INNERS,
    MISSING_GRAD_PATTERN,
    make_data,
    max_abs_diff,
    missing_grad_loss,
    missing_grad_model,
    missing_grad_reference,
    optimizer_state,
    weights,
)

keras = tf.keras
DRIVER = driver("keras2")
N, B, WINDOWS, EPOCHS, _ = DRIVER.MIRRORED
REPLICAS = 2


# `strategy`: conftest.py's session-wide 2-replica MirroredStrategy.


def _model():
    return DRIVER.mirrored_model()


def _data(n):
    return DRIVER.mirrored_data(None, n)


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)  # no shuffling


def _fit(model, optimizer, x, y, batch, epochs=EPOCHS):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(_dataset(x, y, batch), epochs=epochs, verbose=0)
    return model


def test_slots_hold_each_replicas_own_unreduced_sum(strategy, monkeypatch):
    # After one micro-step (no update) no reduction has run, and each
    # replica's slot component holds the gradient of its own half of the
    # micro-batch, scaled by 1/2 as Keras 2 scales it, computed by hand on
    # one device; their sum is what a checkpoint reads.
    x, y = _data(B)
    counter = ReductionCounter(monkeypatch, strategy, entry_points=("_batch_reduce_to",))
    with strategy.scope():
        model = _model()
        opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=N)
        _fit(model, opt, x, y, B, epochs=1)
    assert (int(opt.micro_steps.numpy()), int(opt.iterations.numpy())) == (1, 0)
    assert counter.take() == 0
    clone = _model()
    half = B // REPLICAS
    expected = []
    for r in range(REPLICAS):
        xs = tuple(a[r * half : (r + 1) * half] for a in x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y[r * half : (r + 1) * half] - clone(xs))) / REPLICAS
        expected.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, clone.trainable_variables)])
    for i, acc in enumerate(opt.acc_grads):
        components = [c.numpy() for c in acc.values]
        assert len(components) == REPLICAS
        assert max_abs_diff(components, [expected[r][i] for r in range(REPLICAS)]) <= 1e-6
        assert max_abs_diff([acc.numpy()], [sum(components)]) == 0.0
    assert np.any(opt.acc_grads[0].values[0].numpy() != opt.acc_grads[0].values[1].numpy())


def test_missing_gradients_are_gated_in_every_replica(strategy):
    # The missing-gradient pattern of tests/contract/test_missing_gradients.py (a branch without
    # gradients for whole windows and on a window's last micro-step; weight
    # decay, EMA overwrite and a constraint that must not touch it) in a
    # custom loop under the strategy: the gated updates run in the
    # cross-replica apply and in weight decay's own merge_call. Reference:
    # the single-device hand-built large batch (`missing_grad_reference`).
    mb = 4
    inner_fn = MISSING_GRAD_INNERS["sgd_momentum_ema_overwrite"]
    x, y = make_data(N * len(MISSING_GRAD_PATTERN) * mb, in_dim=4, out_dim=2)
    ref_model, ref_opt = missing_grad_reference(inner_fn, x, y, mb)
    with strategy.scope():
        model = missing_grad_model()
        opt = AccumulatingOptimizer(inner_fn(), N)
        opt.build(model.trainable_variables)

    def replica_step(xb, yb, uses_b):
        with tf.GradientTape() as tape:
            loss = missing_grad_loss(model, xb, yb, uses_b) / REPLICAS
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def step(xb, yb, uses_b):
        strategy.run(replica_step, args=(xb, yb, uses_b))

    k = 0
    for window in MISSING_GRAD_PATTERN:
        for uses_b in window:
            batch = tf.data.Dataset.from_tensor_slices((x[k * mb : (k + 1) * mb], y[k * mb : (k + 1) * mb])).batch(mb)
            step(*next(iter(strategy.experimental_distribute_dataset(batch))), uses_b)
            k += 1
    assert int(opt.iterations.numpy()) == len(MISSING_GRAD_PATTERN)
    assert max_abs_diff(weights(ref_model), weights(model)) <= 1e-6
    assert max_abs_diff(optimizer_state(ref_opt), optimizer_state(opt.inner_optimizer)) <= 1e-6
