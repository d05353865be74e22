"""The README's qualifications of "exactly like the large batch": each exact
recipe equals its reference, and the naive variant of cases 1, 2 and 4 does not.

References, as everywhere in the suite: the same model with the plain inner
optimizer at batch N*B, same initial weights and sample order (case 3: the
same configuration trained without interruption). The naive variants deviate
by construction, not by a tuned amount: their windows hold other gradients.
Case 1: twice as many updates, and each Adam update moves a weight by about
its learning rate (1e-2); case 4: 6 updates against 8, the last micro-batch
of 2 samples weighted like 4; case 2: G's gradient goes through the old D on
N-1 of N micro-batches, and D moves by ~1e-2 per update, so G's steps differ
at first order in that (1e-3 here). 1e-4 is below each of these and far above
float32 rounding over a few updates (~1e-7).
``benchmarks/caveats.py`` measures the same cases and prints their sizes.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, max_abs_diff, mse, weights

N, B = 4, 4
EXACT = 1e-6   # float32 rounding over a few Adam updates is ~1e-7
NAIVE = 1e-4   # a different window moves weights by ~lr = 1e-2


def adam():
    return keras.optimizers.Adam(1e-2)


def acc():
    return AccumulatingOptimizer(adam(), gradient_accumulation_steps=N)


# -------------------------------------- 1. several apply_gradients calls
def _train_parts(mode, opts, batch, x, y):
    """Encoder (first Dense) and head (second Dense): ``one_call``,
    ``two_calls`` on ``opts[0]``, or ``two_optimizers`` (one per part)."""
    model = make_mlp()
    enc, head = model.layers[0].trainable_variables, model.layers[1].trainable_variables
    for opt, part in zip(opts, (enc + head,) if len(opts) == 1 else (enc, head)):
        opt.build(part)

    def step(xb, yb):  # eager, like every step in this module: no tracing, seconds saved
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb, training=True))
        g_enc, g_head = tape.gradient(loss, [enc, head])
        if mode == "one_call":
            opts[0].apply_gradients(zip(g_enc + g_head, enc + head))
        else:
            opts[0].apply_gradients(zip(g_enc, enc))
            opts[-1].apply_gradients(zip(g_head, head))

    for s in range(len(x) // batch):
        step(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch])
    return weights(model)


def test_several_apply_gradients_calls_per_batch():
    x, y = make_data(N * B * 3)
    ref = _train_parts("one_call", [adam()], N * B, x, y)
    # Each call is a micro-step: the window closes after N/2 batches.
    assert max_abs_diff(_train_parts("two_calls", [acc()], B, x, y), ref) > NAIVE
    # Exact: one call with all gradients, or one wrapper per part.
    assert max_abs_diff(_train_parts("one_call", [acc()], B, x, y), ref) <= EXACT
    assert max_abs_diff(_train_parts("two_optimizers", [acc(), acc()], B, x, y), ref) <= EXACT


# ---------------------------------------------- 2. alternating updates (GAN)
def _gan():
    keras.utils.set_random_seed(0)
    gen = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
    disc = keras.Sequential([keras.Input((2,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])
    return gen, disc


def _train_gan(order, make_opt, batch, data):
    """The Keras guide's GAN step, latents from the data. ``alternating``: D
    is updated, then G's gradient goes through the new D; ``simultaneous``:
    both gradients first; ``two_passes``: per window of N micro-batches, D's N
    micro-steps, then G's N micro-steps through the updated D."""
    gen, disc = _gan()
    d_opt, g_opt = make_opt(), make_opt()
    d_opt.build(disc.trainable_variables)
    g_opt.build(gen.trainable_variables)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def d_grads(real, z_d):
        images = tf.concat([gen(z_d), real], axis=0)
        labels = tf.concat([tf.ones_like(real[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            loss = bce(labels, disc(images))
        return tape.gradient(loss, disc.trainable_variables)

    def g_grads(z_g):
        with tf.GradientTape() as tape:
            loss = bce(tf.zeros_like(z_g[:, :1]), disc(gen(z_g)))
        return tape.gradient(loss, gen.trainable_variables)

    def step(real, z_d, z_g):
        gd = d_grads(real, z_d)
        if order == "alternating":
            d_opt.apply_gradients(zip(gd, disc.trainable_variables))
        gg = g_grads(z_g)
        if order == "simultaneous":
            d_opt.apply_gradients(zip(gd, disc.trainable_variables))
        g_opt.apply_gradients(zip(gg, gen.trainable_variables))

    def d_step(real, z_d):
        d_opt.apply_gradients(zip(d_grads(real, z_d), disc.trainable_variables))

    def g_step(z_g):
        g_opt.apply_gradients(zip(g_grads(z_g), gen.trainable_variables))

    real, z_d, z_g = data
    batches = [slice(s * batch, (s + 1) * batch) for s in range(len(real) // batch)]
    if order == "two_passes":
        for w in range(0, len(batches), N):
            for sl in batches[w:w + N]:
                d_step(real[sl], z_d[sl])
            for sl in batches[w:w + N]:
                g_step(z_g[sl])
    else:
        for sl in batches:
            step(real[sl], z_d[sl], z_g[sl])
    return weights(gen.weights + disc.weights)


def test_alternating_updates_in_one_step():
    rng = np.random.default_rng(2)
    n = N * B * 3
    data = (rng.normal(size=(n, 2)).astype("float32") + 1.0, rng.normal(size=(n, 3)).astype("float32"),
            rng.normal(size=(n, 3)).astype("float32"))
    ref_alternating = _train_gan("alternating", adam, N * B, data)
    # Only the window's last micro-batch sees the new D.
    assert max_abs_diff(_train_gan("alternating", acc, B, data), ref_alternating) > NAIVE
    # Exact: both gradients first (against the large batch trained that way) ...
    ref_simultaneous = _train_gan("simultaneous", adam, N * B, data)
    assert max_abs_diff(_train_gan("simultaneous", acc, B, data), ref_simultaneous) <= EXACT
    # ... or the guide's order in two passes over each window.
    assert max_abs_diff(_train_gan("two_passes", acc, B, data), ref_alternating) <= EXACT


# --------------------------------------------- 3. resuming an interrupted fit
class InterruptAt(keras.callbacks.Callback):
    """Raise after ``batches`` batches of epoch ``epoch`` (as Keras' tests do)."""

    def __init__(self, epoch, batches):
        super().__init__()
        self.at, self.epoch = (epoch, batches), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("interrupted")


def _compiled(seed=0):
    model = make_mlp(seed)
    model.compile(optimizer=acc(), loss="mse", run_eagerly=True)
    return model


def test_resuming_mid_epoch_is_exact_from_epoch_checkpoints(tmp_path):
    # 6 micro-batches per epoch: epoch 0 ends mid-window, so the restored
    # accumulators matter. Interrupted after 3 micro-batches of epoch 1.
    x, y = make_data(6 * B)
    fit_kw = dict(batch_size=B, epochs=2, shuffle=False, verbose=0)
    reference = _compiled()
    reference.fit(x, y, **fit_kw)
    ref = weights(reference)

    def interrupted(callbacks):
        with pytest.raises(RuntimeError, match="interrupted"):
            _compiled().fit(x, y, callbacks=callbacks + [InterruptAt(1, 3)], **fit_kw)

    # BackupAndRestore(save_freq="epoch"): resumes at the start of epoch 1.
    backup = str(tmp_path / "backup")
    interrupted([keras.callbacks.BackupAndRestore(backup, save_freq="epoch")])
    with open(os.path.join(backup, "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 1
    resumed = _compiled(seed=7)
    resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq="epoch")], **fit_kw)
    assert max_abs_diff(weights(resumed), ref) <= EXACT

    # ModelCheckpoint every epoch, then load_model and fit(initial_epoch=...).
    interrupted([keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.keras"))])
    assert sorted(p.name for p in tmp_path.glob("epoch*.keras")) == ["epoch1.keras"]
    resumed = keras.models.load_model(tmp_path / "epoch1.keras")
    resumed.fit(x, y, initial_epoch=1, **fit_kw)
    assert max_abs_diff(weights(resumed), ref) <= EXACT


# ------------------------------------------------ 4. numpy fit, ragged end
def _fit_numpy(opt, batch, x, y):
    model = make_mlp()
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return weights(model)


def test_numpy_fit_needs_len_a_multiple_of_n_times_b():
    x, y = make_data(50)  # 13 micro-batches of B per epoch, the last of 2 samples
    ref = _fit_numpy(adam(), N * B, x, y)
    # The small last micro-batch counts as a full one, windows straddle epochs.
    assert max_abs_diff(_fit_numpy(acc(), B, x, y), ref) > NAIVE
    # Exact: len(x) a multiple of N*B.
    x, y = x[:48], y[:48]
    assert max_abs_diff(_fit_numpy(acc(), B, x, y), _fit_numpy(adam(), N * B, x, y)) <= EXACT


# ------------------------------------------------- 5. TensorBoard's rates
def test_tensorboard_epoch_steps_per_second_counts_updates(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tf.summary needs the tensorboard package")
    from keras.src.callbacks import tensorboard as tb_module

    # A fake clock for the callback, advanced by 1 s per micro-step: the
    # logged rates are then counts per micro-step, exactly.
    clock = [0.0]
    monkeypatch.setattr(tb_module, "time", type("FakeTime", (), {"time": staticmethod(lambda: clock[0])}))

    class Tick(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock[0] += 1.0

    micro_per_epoch, epochs = 8, 2
    x, y = make_data(micro_per_epoch * B)
    model = make_mlp()
    model.compile(optimizer=acc(), loss="mse", run_eagerly=True)
    tb = keras.callbacks.TensorBoard(str(tmp_path), write_steps_per_second=True, update_freq="batch",
                                     write_graph=False)
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, callbacks=[Tick(), tb])

    scalars = {}
    for path in tmp_path.rglob("*tfevents*"):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    scalars.setdefault(v.tag, []).append((event.step, float(tf.make_ndarray(v.tensor))))
    # Epoch level: updates per second (iterations is the wrapper's update count).
    assert sorted(scalars["epoch_steps_per_second"]) == [(e, 1.0 / N) for e in range(epochs)]
    assert int(model.optimizer.iterations) * N == int(model.optimizer.micro_steps) == micro_per_epoch * epochs
    # Batch level: one summary per micro-step, at micro-step numbers, 1 micro-step/s.
    assert sorted(scalars["batch_steps_per_second"]) == [(s, 1.0) for s in range(1, micro_per_epoch * epochs + 1)]
