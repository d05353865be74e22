"""The five cases where "exactly like the large batch" needs a recipe, written
once: ``tests/keras3/test_caveats.py`` asserts them, ``experiments/caveats.py``
measures them (docs/semantics.md, "Five more, measured").

Each case trains a small model on fixed random data from the same initial
weights and in the same sample order as its reference, and returns the
weights (and counts) for the caller to compare: ``max_abs_diff`` of
:mod:`support.arrays`. :class:`Caveats` holds the sizes both callers choose
(N, the MLP's hidden width, the learning rate) and whether ``fit`` runs
eagerly (the test: no tracing, seconds saved; the study: compiled, as users
run it). Keras 3 on TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_mlp, weights


def updates(opt) -> int:
    """The optimizer's update count (``iterations``)."""
    return int(opt.iterations.numpy())


class InterruptAt(keras.callbacks.Callback):
    """Raise ``RuntimeError("interrupted")`` after ``batches`` batches of
    epoch ``epoch`` (as Keras' own tests interrupt a fit)."""

    def __init__(self, epoch: int, batches: int):
        super().__init__()
        self.at, self.epoch = (epoch, batches), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("interrupted")


class TwoPart(keras.Model):
    """Encoder and head; ``train_step`` applies their gradients in one call
    (``one_call``), in two calls on ``self.optimizer`` (``two_calls``), or
    with one optimizer each (``two_optimizers``: ``enc_opt``, ``head_opt``)."""

    def __init__(self, mode: str, hidden: int, out: int, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        self.encoder = keras.layers.Dense(hidden, activation="tanh", name="encoder")
        self.head = keras.layers.Dense(out, name="head")
        self.enc_opt = self.head_opt = None

    def call(self, x):
        return self.head(self.encoder(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - self(x, training=True)))
        enc, head = self.encoder.trainable_variables, self.head.trainable_variables
        grads = tape.gradient(loss, enc + head)
        g_enc, g_head = grads[: len(enc)], grads[len(enc):]
        if self.mode == "one_call":
            self.optimizer.apply_gradients(zip(grads, enc + head))
        elif self.mode == "two_calls":
            self.optimizer.apply_gradients(zip(g_enc, enc))
            self.optimizer.apply_gradients(zip(g_head, head))
        else:  # "two_optimizers"
            self.enc_opt.apply_gradients(zip(g_enc, enc))
            self.head_opt.apply_gradients(zip(g_head, head))
        return {"loss": loss}


LATENT = 3


class GAN(keras.Model):
    """The Keras guide's GAN ``train_step``, with the latent vectors taken
    from the data (so that both batch sizes see the same draws) and no label
    noise. ``order="alternating"``: D is updated, then G's gradient goes
    through the new D (the guide). ``"simultaneous"``: both gradients first,
    then both updates."""

    def __init__(self, order: str, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.order = order
        self.generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(hidden, activation="tanh"),
                                           keras.layers.Dense(2)], name="generator")
        self.discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(hidden, activation="tanh"),
                                               keras.layers.Dense(1)], name="discriminator")
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, d_optimizer, g_optimizer, run_eagerly=False):
        super().compile(optimizer=keras.optimizers.SGD(0.0), run_eagerly=run_eagerly)  # unused by train_step
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        d_optimizer.build(self.discriminator.trainable_variables)
        g_optimizer.build(self.generator.trainable_variables)

    def call(self, z):
        return self.generator(z)

    def d_gradients(self, real, z_d):
        images = tf.concat([self.generator(z_d), real], axis=0)
        labels = tf.concat([tf.ones_like(real[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            loss = self.bce(labels, self.discriminator(images))
        return loss, tape.gradient(loss, self.discriminator.trainable_variables)

    def g_gradients(self, z_g):
        with tf.GradientTape() as tape:
            loss = self.bce(tf.zeros_like(z_g[:, :1]), self.discriminator(self.generator(z_g)))
        return loss, tape.gradient(loss, self.generator.trainable_variables)

    def train_step(self, data):
        real, z_d, z_g = data
        d_vars, g_vars = self.discriminator.trainable_variables, self.generator.trainable_variables
        d_loss, d_grads = self.d_gradients(real, z_d)
        if self.order == "alternating":
            self.d_optimizer.apply_gradients(zip(d_grads, d_vars))
        g_loss, g_grads = self.g_gradients(z_g)
        if self.order == "simultaneous":
            self.d_optimizer.apply_gradients(zip(d_grads, d_vars))
        self.g_optimizer.apply_gradients(zip(g_grads, g_vars))
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan_data(n: int, seed: int = 2):
    """``n`` real 2-d points and two sets of ``n`` latent vectors (for D's
    and for G's step)."""
    rng = np.random.default_rng(seed)
    real = (rng.normal(size=(n, 2)) * [0.5, 0.2] + [1.0, -0.5]).astype("float32")
    return real, rng.normal(size=(n, LATENT)).astype("float32"), rng.normal(size=(n, LATENT)).astype("float32")


def read_scalars(log_dir: str) -> dict:
    """``{tag: [(step, value), ...]}`` of the scalar summaries in every event
    file under ``log_dir``, sorted by step."""
    out: dict = {}
    for root, _, files in os.walk(log_dir):
        for name in files:
            if "tfevents" not in name:
                continue
            for record in tf.data.TFRecordDataset(os.path.join(root, name)):
                event = tf.compat.v1.Event.FromString(record.numpy())
                for v in event.summary.value:
                    if v.metadata.plugin_data.plugin_name != "scalars":  # the model config, graphs
                        continue
                    out.setdefault(v.tag, []).append((int(event.step), float(tf.make_ndarray(v.tensor))))
    return {k: sorted(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Caveats:
    """The cases at one size: ``n`` accumulation steps, Adam(``lr``), an MLP
    6-``hidden``-3 (tanh), ``fit`` eager or not (``run_eagerly``)."""

    n: int = 4
    lr: float = 1e-2
    hidden: int = 8
    run_eagerly: bool = False

    def adam(self):
        return keras.optimizers.Adam(self.lr)

    def acc(self, n: int | None = None):
        return AccumulatingOptimizer(self.adam(), gradient_accumulation_steps=n or self.n)

    def mlp(self, seed: int = 0):
        return make_mlp(seed, hidden=self.hidden)

    # ------------------------------------- 1. two calls on one wrapper
    def two_part(self, mode: str, make_opt, batch: int, x, y, epochs: int):
        """:class:`TwoPart` trained by ``fit``: its weights and each
        optimizer's update count."""
        keras.utils.set_random_seed(0)
        model = TwoPart(mode, self.hidden, y.shape[-1])
        model(x[:1])  # build: the same initial weights in every run
        if mode == "two_optimizers":
            model.enc_opt, model.head_opt = make_opt(), make_opt()
            model.enc_opt.build(model.encoder.trainable_variables)
            model.head_opt.build(model.head.trainable_variables)
            model.compile(optimizer=keras.optimizers.SGD(0.0), run_eagerly=self.run_eagerly)  # unused
            opts = [model.enc_opt, model.head_opt]
        else:
            model.compile(optimizer=make_opt(), run_eagerly=self.run_eagerly)
            model.optimizer.build(model.trainable_variables)
            opts = [model.optimizer]
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        return weights(model), [updates(o) for o in opts]

    # ------------------------------------------- 2. alternating updates
    def gan(self, order: str, make_opt, batch: int, data, epochs: int):
        """:class:`GAN` trained by ``fit``: its weights and D's update count."""
        keras.utils.set_random_seed(0)
        model = GAN(order, self.hidden)
        model.compile(make_opt(), make_opt(), run_eagerly=self.run_eagerly)
        ds = tf.data.Dataset.from_tensor_slices(data).batch(batch)
        model.fit(ds, epochs=epochs, shuffle=False, verbose=0)
        return weights(model), updates(model.d_optimizer)

    def gan_two_passes(self, batch: int, data, epochs: int):
        """The guide's order, exact under accumulation: per window, D's N
        micro-steps first (D updates at the N-th), then G's N micro-steps
        through the updated D (a custom loop; G does not change during D's
        pass). Its weights."""
        keras.utils.set_random_seed(0)
        model = GAN("alternating", self.hidden)
        model.compile(self.acc(), self.acc())
        gen, disc = model.generator, model.discriminator
        compiled = (lambda f: f) if self.run_eagerly else tf.function

        @compiled
        def d_step(real, z_d):
            model.d_optimizer.apply_gradients(zip(model.d_gradients(real, z_d)[1], disc.trainable_variables))

        @compiled
        def g_step(z_g):
            model.g_optimizer.apply_gradients(zip(model.g_gradients(z_g)[1], gen.trainable_variables))

        real, z_d, z_g = (tf.constant(a) for a in data)
        for _ in range(epochs):
            for w in range(len(data[0]) // (self.n * batch)):
                mbs = [slice((w * self.n + i) * batch, (w * self.n + i + 1) * batch) for i in range(self.n)]
                for sl in mbs:
                    d_step(real[sl], z_d[sl])
                for sl in mbs:
                    g_step(z_g[sl])
        return weights(model)

    # ------------------------------------- 3. resuming an interrupted fit
    def compiled_mlp(self, make_opt, seed: int = 0):
        model = self.mlp(seed)
        model.compile(optimizer=make_opt(), loss="mse", run_eagerly=self.run_eagerly)
        return model

    def uninterrupted(self, make_opt, batch: int, x, y, epochs: int):
        """The reference of a resumed run: its weights and update count."""
        model = self.compiled_mlp(make_opt)
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        return weights(model), updates(model.optimizer)

    def resumed(self, make_opt, batch: int, x, y, epochs: int, how: str, interrupt: tuple, save_freq=None) -> dict:
        """Train, interrupted at ``interrupt`` = (epoch, batches done), then
        resume in a fresh model and optimizer. ``how``: ``"backup"``
        (BackupAndRestore with ``save_freq``; ``backup_metadata``, the
        backup's epoch and batch) or ``"checkpoint"`` (ModelCheckpoint every
        epoch, then ``load_model`` and ``fit(initial_epoch=...)``;
        ``checkpoints``, the files, and ``checkpoint_epochs_done``).
        ``weights`` and ``updates`` of the resumed model."""
        fit_kw = dict(batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        with tempfile.TemporaryDirectory() as tmp:
            backup = os.path.join(tmp, "backup")
            if how == "backup":
                callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)]
            else:
                callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(tmp, "epoch{epoch}.keras"))]
            try:
                self.compiled_mlp(make_opt).fit(x, y, callbacks=callbacks + [InterruptAt(*interrupt)], **fit_kw)
                raise AssertionError("the interruption did not happen")
            except RuntimeError as e:
                if str(e) != "interrupted":
                    raise
            info = {}
            if how == "backup":
                with open(os.path.join(backup, "training_metadata.json")) as f:
                    info["backup_metadata"] = json.load(f)  # {"epoch": ..., "batch": ...}
                resumed = self.compiled_mlp(make_opt, seed=7)  # other initial weights: the restore must overwrite them
                resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)], **fit_kw)
            else:
                info["checkpoints"] = sorted(p for p in os.listdir(tmp) if p.startswith("epoch"))
                done = max(int(p[5:-6]) for p in info["checkpoints"])
                info["checkpoint_epochs_done"] = done
                resumed = keras.models.load_model(os.path.join(tmp, f"epoch{done}.keras"))
                resumed.fit(x, y, initial_epoch=done, **fit_kw)
        info["weights"] = weights(resumed)
        info["updates"] = updates(resumed.optimizer)
        return info

    # ------------------------------------------- 4. numpy fit, ragged end
    def fit_numpy(self, make_opt, batch: int, x, y, epochs: int, dataset: bool = False):
        """``fit`` on arrays (``batch_size=batch``) or on a ``tf.data``
        dataset batched with ``drop_remainder=True``: the weights, updates
        and micro-steps (``None`` for a plain optimizer)."""
        model = self.compiled_mlp(make_opt)
        if dataset:
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
            model.fit(ds, epochs=epochs, verbose=0)
        else:
            model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        opt = model.optimizer
        return weights(model), updates(opt), int(opt.micro_steps.numpy()) if hasattr(opt, "micro_steps") else None

    # ----------------------------------------------- 5. TensorBoard's rates
    def tensorboard_fit(self, make_opt, batch: int, x, y, epochs: int, log_dir: str, callbacks=()):
        """``fit`` with ``callbacks`` then TensorBoard (steps per second, a
        summary per batch) logging to ``log_dir``: the model and the scalars
        logged (:func:`read_scalars`)."""
        model = self.compiled_mlp(make_opt)
        tb = keras.callbacks.TensorBoard(log_dir, write_steps_per_second=True, update_freq="batch",
                                         write_graph=False)
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[*callbacks, tb])
        return model, read_scalars(log_dir)
