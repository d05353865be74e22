"""Where "exactly like the large batch" needs a qualification: five cases,
each measured on a small model, next to the way to be exact.

Every case trains a small model (an MLP, or a two-MLP GAN, on fixed random
data; seeded; nothing downloaded) twice or more from the same initial weights
and sample order, and prints the max absolute weight difference from its
reference:

1. ``apply_gradients`` called twice per batch on one wrapper (encoder and head
   of one model, one shared optimizer, a custom ``train_step``). Reference:
   plain Adam at batch N*B, one update of all variables per batch.
2. Alternating updates in one ``train_step`` (a GAN in the Keras guide's
   order: D is updated, then G's gradient goes through the new D). Reference:
   the same GAN code with plain Adam at batch N*B. Exact: both gradients
   first, then both updates (against the large batch trained that way), or
   the guide's order in two passes over each window (a custom loop).
3. ``BackupAndRestore(save_freq=<int>)``: training is interrupted mid-epoch
   (a callback raises, as Keras' own tests do) and resumed in a new model and
   optimizer. Reference: the same configuration trained without interruption;
   plain Keras and the wrapper are each compared with themselves.
4. numpy ``fit(x, y, batch_size=B)`` where B (and N*B) does not divide
   ``len(x)``. Reference: ``fit(x, y, batch_size=N*B)`` on the same samples.
5. TensorBoard's ``epoch_steps_per_second``: what it counts, read back from
   the event files and set against micro-steps and updates per second by the
   wall clock. Needs the ``tensorboard`` package (TensorFlow 2.21 no longer
   installs it; the ``[test]`` and ``[bench]`` extras do); without it the
   case is reported as skipped.

For each, row (a) is the case as users naturally write it and (b) the exact
recipe; (b) should be at float32 rounding (~1e-7). Run::

    .venv/bin/python -m benchmarks.caveats [--out bench_output] [--cases 1,2,3,4,5]

Writes ``<out>/caveats.json`` (all figures), ``<out>/caveats.md`` (the table)
and ``<out>/caveats.png`` (the deviations on a log scale).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/caveats.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402

N, B = 4, 8          # accumulation steps, micro-batch size: the reference batch is N*B = 32
IN, HIDDEN, OUT = 6, 8, 3
LR = 1e-2
CASE_TITLES = {
    1: "two apply_gradients calls per batch on one wrapper",
    2: "alternating updates in one train_step (GAN, Keras guide order)",
    3: "BackupAndRestore(save_freq=<int>), interrupted mid-epoch and resumed",
    4: "numpy fit(x, y, batch_size=B), B and N*B not dividing len(x)",
    5: "TensorBoard epoch_steps_per_second",
}

# TensorFlow and Keras are imported by _import_tf(), after the arguments are
# parsed (so that --help is instant).
tf = keras = np = AccumulatingOptimizer = None


def _import_tf() -> None:
    global tf, keras, np, AccumulatingOptimizer
    import keras as _keras
    import numpy as _np
    import tensorflow as _tf

    from accum_optimizer import AccumulatingOptimizer as _Acc

    tf, keras, np, AccumulatingOptimizer = _tf, _keras, _np, _Acc


# ------------------------------------------------------------------- helpers
def _adam():
    return keras.optimizers.Adam(LR)


def _acc(n: int = N):
    return AccumulatingOptimizer(_adam(), gradient_accumulation_steps=n)


def _mlp(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                             keras.layers.Dense(OUT)])


def _data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, IN)).astype("float32"), rng.normal(size=(n, OUT)).astype("float32")


def _weights(model) -> list:
    return [np.array(v.numpy()) for v in model.weights]


def _diff(a, b) -> float:
    assert len(a) == len(b) and a
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


def _updates(opt) -> int:
    return int(opt.iterations.numpy())


def _row(case: int, variant: str, label: str, value: float, note: str = "", kind: str = "max_abs_dw") -> dict:
    return {"case": case, "variant": variant, "label": label, "value": value, "kind": kind, "note": note}


# ------------------------------------------------ 1. two calls, one wrapper
def _two_part_class():
    class TwoPart(keras.Model):
        """Encoder and head; ``train_step`` applies their gradients in one
        call, in two calls on ``self.optimizer``, or with one optimizer each."""

        def __init__(self, mode: str, **kwargs):
            super().__init__(**kwargs)
            self.mode = mode
            self.encoder = keras.layers.Dense(HIDDEN, activation="tanh", name="encoder")
            self.head = keras.layers.Dense(OUT, name="head")
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

    return TwoPart


def _fit_two_part(mode: str, make_opt, batch: int, x, y, epochs: int):
    keras.utils.set_random_seed(0)
    model = _two_part_class()(mode)
    model(x[:1])  # build: the same initial weights in every run
    if mode == "two_optimizers":
        model.enc_opt, model.head_opt = make_opt(), make_opt()
        model.enc_opt.build(model.encoder.trainable_variables)
        model.head_opt.build(model.head.trainable_variables)
        model.compile(optimizer=keras.optimizers.SGD(0.0))  # unused by train_step
        opts = [model.enc_opt, model.head_opt]
    else:
        model.compile(optimizer=make_opt())
        model.optimizer.build(model.trainable_variables)
        opts = [model.optimizer]
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return _weights(model), [_updates(o) for o in opts]


def case_two_calls() -> list[dict]:
    windows, epochs = 6, 2
    x, y = _data(N * B * windows)
    ref, ref_up = _fit_two_part("one_call", _adam, N * B, x, y, epochs)
    runs = {
        "naive": _fit_two_part("two_calls", _acc, B, x, y, epochs),
        "one_call": _fit_two_part("one_call", _acc, B, x, y, epochs),
        "two_optimizers": _fit_two_part("two_optimizers", _acc, B, x, y, epochs),
        "plain_two_calls": _fit_two_part("two_calls", _adam, N * B, x, y, epochs),
        "double_n": _fit_two_part("two_calls", lambda: _acc(2 * N), B, x, y, epochs),
    }
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    sgd_ref, _ = _fit_two_part("one_call", sgd, N * B, x, y, epochs)
    sgd_double_n, _ = _fit_two_part("two_calls", lambda: AccumulatingOptimizer(sgd(), 2 * N), B, x, y, epochs)
    up = f"{ref_up[0]} updates in the reference"
    return [
        _row(1, "a", "one wrapper, encoder and head applied in two calls", _diff(runs["naive"][0], ref),
             f"a window closes after {N} calls = {N // 2} batches: {runs['naive'][1][0]} updates, {up}"),
        _row(1, "b", "one wrapper, one call with all gradients", _diff(runs["one_call"][0], ref),
             f"{runs['one_call'][1][0]} updates"),
        _row(1, "b", f"one wrapper per part, each with N={N}", _diff(runs["two_optimizers"][0], ref),
             f"{runs['two_optimizers'][1]} updates"),
        _row(1, "info", "plain Adam at batch N*B, two calls (no accumulation)", _diff(runs["plain_two_calls"][0], ref),
             f"plain Keras too: iterations advances twice per batch ({runs['plain_two_calls'][1][0]}), "
             "Adam's bias correction sees it"),
        _row(1, "info", f"one wrapper with N={2 * N} (2N), two calls", _diff(runs["double_n"][0], ref),
             f"not a fix: the windows are right ({runs['double_n'][1][0]} updates) but each gradient is divided "
             f"by 2N; Adam is nearly scale-invariant (only epsilon sees it)"),
        _row(1, "info", f"same with SGD(0.1): one wrapper with N={2 * N}, two calls (vs SGD at batch N*B)",
             _diff(sgd_double_n, sgd_ref), "SGD takes half steps"),
    ]


# --------------------------------------------------- 2. alternating updates
LATENT = 3


def _gan_class():
    class GAN(keras.Model):
        """The Keras guide's GAN ``train_step``, with the latent vectors taken
        from the data (so that both batch sizes see the same draws) and no
        label noise. ``order="alternating"``: D is updated, then G's gradient
        goes through the new D (the guide). ``"simultaneous"``: both gradients
        first, then both updates."""

        def __init__(self, order: str, **kwargs):
            super().__init__(**kwargs)
            self.order = order
            self.generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                                               keras.layers.Dense(2)], name="generator")
            self.discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                                                   keras.layers.Dense(1)], name="discriminator")
            self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

        def compile(self, d_optimizer, g_optimizer):
            super().compile(optimizer=keras.optimizers.SGD(0.0))  # unused by train_step
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            d_optimizer.build(self.discriminator.trainable_variables)
            g_optimizer.build(self.generator.trainable_variables)

        def call(self, z):
            return self.generator(z)

        def train_step(self, data):
            real, z_d, z_g = data
            d_vars, g_vars = self.discriminator.trainable_variables, self.generator.trainable_variables
            fake = self.generator(z_d)
            images = tf.concat([fake, real], axis=0)
            labels = tf.concat([tf.ones_like(real[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.bce(labels, self.discriminator(images))
            d_grads = tape.gradient(d_loss, d_vars)
            if self.order == "alternating":
                self.d_optimizer.apply_gradients(zip(d_grads, d_vars))
            with tf.GradientTape() as tape:
                g_loss = self.bce(tf.zeros_like(real[:, :1]), self.discriminator(self.generator(z_g)))
            g_grads = tape.gradient(g_loss, g_vars)
            if self.order == "simultaneous":
                self.d_optimizer.apply_gradients(zip(d_grads, d_vars))
            self.g_optimizer.apply_gradients(zip(g_grads, g_vars))
            return {"d_loss": d_loss, "g_loss": g_loss}

    return GAN


def _gan_data(n: int, seed: int = 2):
    rng = np.random.default_rng(seed)
    real = (rng.normal(size=(n, 2)) * [0.5, 0.2] + [1.0, -0.5]).astype("float32")
    return real, rng.normal(size=(n, LATENT)).astype("float32"), rng.normal(size=(n, LATENT)).astype("float32")


def _fit_gan(order: str, make_opt, batch: int, data, epochs: int):
    keras.utils.set_random_seed(0)
    model = _gan_class()(order)
    model.compile(make_opt(), make_opt())
    ds = tf.data.Dataset.from_tensor_slices(data).batch(batch)
    model.fit(ds, epochs=epochs, verbose=0)
    return _weights(model), _updates(model.d_optimizer)


def _gan_two_passes(data, epochs: int):
    """The guide's order, exact under accumulation: per window, D's N
    micro-steps first (D updates at the N-th), then G's N micro-steps through
    the updated D (custom loop; G does not change during D's pass)."""
    keras.utils.set_random_seed(0)
    model = _gan_class()("alternating")
    model.compile(_acc(), _acc())
    gen, disc, bce = model.generator, model.discriminator, model.bce

    @tf.function
    def d_step(real, z_d):
        images = tf.concat([gen(z_d), real], axis=0)
        labels = tf.concat([tf.ones_like(real[:, :1]), tf.zeros_like(real[:, :1])], axis=0)
        with tf.GradientTape() as tape:
            loss = bce(labels, disc(images))
        model.d_optimizer.apply_gradients(zip(tape.gradient(loss, disc.trainable_variables),
                                              disc.trainable_variables))

    @tf.function
    def g_step(z_g):
        with tf.GradientTape() as tape:
            loss = bce(tf.zeros_like(z_g[:, :1]), disc(gen(z_g)))
        model.g_optimizer.apply_gradients(zip(tape.gradient(loss, gen.trainable_variables), gen.trainable_variables))

    real, z_d, z_g = (tf.constant(a) for a in data)
    for _ in range(epochs):
        for w in range(len(data[0]) // (N * B)):
            mbs = [slice((w * N + i) * B, (w * N + i + 1) * B) for i in range(N)]
            for sl in mbs:
                d_step(real[sl], z_d[sl])
            for sl in mbs:
                g_step(z_g[sl])
    return _weights(model)


def case_gan() -> list[dict]:
    windows, epochs = 6, 2
    data = _gan_data(N * B * windows)
    ref_alt, _ = _fit_gan("alternating", _adam, N * B, data, epochs)
    ref_sim, _ = _fit_gan("simultaneous", _adam, N * B, data, epochs)
    naive, _ = _fit_gan("alternating", _acc, B, data, epochs)
    exact, _ = _fit_gan("simultaneous", _acc, B, data, epochs)
    two_passes = _gan_two_passes(data, epochs)
    return [
        _row(2, "a", "guide order, wrappers on D and G (vs the large batch in guide order)", _diff(naive, ref_alt),
             f"G's gradient goes through the new D on 1 micro-batch of {N}, on all of them in the large batch"),
        _row(2, "b", "both gradients first, then both updates (vs the large batch, same order)", _diff(exact, ref_sim),
             "D and G gradients at the same weights in every micro-batch"),
        _row(2, "b", "guide order in two passes per window: D's N micro-steps, then G's N (vs guide order)",
             _diff(two_passes, ref_alt), "custom loop; G's gradients all go through the updated D"),
        _row(2, "info", "large batch: guide order vs both gradients first (no accumulation)", _diff(ref_sim, ref_alt),
             "the recipe is a different GAN update; this is how far apart the two large-batch GANs are"),
    ]


# ---------------------------------------------------- 3. BackupAndRestore
def _interrupter_class():
    class InterruptAt(keras.callbacks.Callback):
        """Raise after batch ``batch`` (1-based count) of epoch ``epoch``."""

        def __init__(self, epoch: int, batch: int):
            super().__init__()
            self.at, self.epoch = (epoch, batch), None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch + 1) == self.at:
                raise RuntimeError("interrupted")

    return InterruptAt


def _resume_run(make_opt, batch: int, x, y, epochs: int, how: str, interrupt: tuple, save_freq=None) -> dict:
    """Train, interrupted at ``interrupt`` = (epoch, batches done), then resume
    in a fresh model and optimizer. ``how``: ``"backup"`` (BackupAndRestore
    with ``save_freq``) or ``"checkpoint"`` (ModelCheckpoint every epoch, then
    ``load_model`` and ``fit(initial_epoch=...)``)."""
    import json

    fit_kw = dict(batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        model = _mlp()
        model.compile(optimizer=make_opt(), loss="mse")
        if how == "backup":
            callbacks = [keras.callbacks.BackupAndRestore(os.path.join(tmp, "backup"), save_freq=save_freq)]
        else:
            callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(tmp, "epoch{epoch}.keras"))]
        try:
            model.fit(x, y, callbacks=callbacks + [_interrupter_class()(*interrupt)], **fit_kw)
            raise AssertionError("the interruption did not happen")
        except RuntimeError as e:
            if str(e) != "interrupted":
                raise
        info = {}
        if how == "backup":
            meta = os.path.join(tmp, "backup", "training_metadata.json")
            with open(meta) as f:
                info["backup_metadata"] = json.load(f)  # {"epoch": ..., "batch": ...}
            resumed = _mlp(seed=7)  # other initial weights: the restore must overwrite them
            resumed.compile(optimizer=make_opt(), loss="mse")
            resumed.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(os.path.join(tmp, "backup"),
                                                                          save_freq=save_freq)], **fit_kw)
        else:
            done = max(int(p[5:-6]) for p in os.listdir(tmp) if p.startswith("epoch"))
            info["checkpoint_epochs_done"] = done
            resumed = keras.models.load_model(os.path.join(tmp, f"epoch{done}.keras"))
            resumed.fit(x, y, initial_epoch=done, **fit_kw)
    info["weights"] = _weights(resumed)
    info["updates"] = _updates(resumed.optimizer)
    return info


def _uninterrupted(make_opt, batch: int, x, y, epochs: int):
    model = _mlp()
    model.compile(optimizer=make_opt(), loss="mse")
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return _weights(model), _updates(model.optimizer)


def case_backup() -> list[dict]:
    # 160 samples: 5 batches of N*B for plain Keras, 20 micro-batches of B
    # (5 windows) for the wrapper. Both are interrupted after the same
    # samples (epoch 1, 128 samples in) with backups every 64 samples.
    epochs, windows = 3, 5
    x, y = _data(N * B * windows)
    configs = {
        "plain": dict(make_opt=_adam, batch=N * B, save_freq=2, interrupt=(1, 4)),
        "accum": dict(make_opt=_acc, batch=B, save_freq=2 * N, interrupt=(1, 4 * N)),
    }
    rows = []
    for name, cfg in configs.items():
        label = "plain Adam at batch N*B" if name == "plain" else f"AccumulatingOptimizer(Adam, {N}) at batch B"
        ref, ref_up = _uninterrupted(cfg["make_opt"], cfg["batch"], x, y, epochs)
        r = _resume_run(cfg["make_opt"], cfg["batch"], x, y, epochs, "backup", cfg["interrupt"], cfg["save_freq"])
        meta = r["backup_metadata"]
        rows.append(_row(3, "a", f"{label}: BackupAndRestore(save_freq={cfg['save_freq']})",
                         _diff(r["weights"], ref),
                         f"backup after {meta['batch'] + 1} batches of epoch {meta['epoch']}; the resumed fit "
                         f"restores it, then starts epoch {meta['epoch']} from its first batch: those batches "
                         f"train twice ({r['updates']} updates, {ref_up} uninterrupted)"))
        r = _resume_run(cfg["make_opt"], cfg["batch"], x, y, epochs, "backup", cfg["interrupt"], "epoch")
        rows.append(_row(3, "b", f"{label}: BackupAndRestore(save_freq=\"epoch\")", _diff(r["weights"], ref),
                         f"resumed from the end of epoch {r['backup_metadata']['epoch'] - 1}: {r['updates']} updates"))
        r = _resume_run(cfg["make_opt"], cfg["batch"], x, y, epochs, "checkpoint", cfg["interrupt"])
        rows.append(_row(3, "b", f"{label}: ModelCheckpoint + load_model + fit(initial_epoch)",
                         _diff(r["weights"], ref),
                         f"initial_epoch={r['checkpoint_epochs_done']}: {r['updates']} updates"))
    return rows


# ------------------------------------------------ 4. numpy fit, ragged end
def _fit_numpy(make_opt, batch: int, x, y, epochs: int, dataset: bool = False):
    model = _mlp()
    model.compile(optimizer=make_opt(), loss="mse")
    if dataset:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        model.fit(ds, epochs=epochs, verbose=0)
    else:
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    opt = model.optimizer
    return _weights(model), _updates(opt), int(opt.micro_steps.numpy()) if hasattr(opt, "micro_steps") else None


def case_ragged() -> list[dict]:
    epochs = 3
    rows = []
    for variant, length, dataset, label in (
        ("a", 100, False, "len(x)=100: last micro-batch 4 samples (N*B=32: last batch 4)"),
        ("a", 104, False, "len(x)=104: B divides it, N*B does not (13 micro-batches per epoch)"),
        ("b", 96, False, "len(x)=96, a multiple of N*B"),
        ("b", 100, True, "len(x)=100 as tf.data .batch(B, drop_remainder=True): 12 micro-batches per epoch"),
    ):
        x, y = _data(length, seed=3)
        ref, ref_up, _ = _fit_numpy(_adam, N * B, x, y, epochs, dataset)
        w, up, micro = _fit_numpy(_acc, B, x, y, epochs, dataset)
        rows.append(_row(4, variant, label, _diff(w, ref),
                         f"{micro} micro-steps, {up} updates ({micro - up * N} left in the accumulators); "
                         f"reference {ref_up} updates"
                         + (" (reference: .batch(N*B, drop_remainder=True))" if dataset else "")))
    return rows


# ------------------------------------------------------------- 5. TensorBoard
def _read_scalars(log_dir: str) -> dict:
    """{tag: [(step, value), ...]} from every event file under ``log_dir``."""
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


def _clock_class():
    class EpochClock(keras.callbacks.Callback):
        """Wall clock of each epoch, micro-steps and updates in it (placed
        just before TensorBoard, so both time nearly the same interval)."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def _counts(self):
            opt = self.model.optimizer
            micro = opt.micro_steps if hasattr(opt, "micro_steps") else opt.iterations
            return int(micro.numpy()), int(opt.iterations.numpy())

        def on_epoch_begin(self, epoch, logs=None):
            self._t0, self._c0 = time.time(), self._counts()

        def on_epoch_end(self, epoch, logs=None):
            t, c = time.time() - self._t0, self._counts()
            self.epochs.append({"seconds": t, "micro_steps": c[0] - self._c0[0], "updates": c[1] - self._c0[1]})

    return EpochClock


def _tensorboard_run(make_opt, batch: int, x, y, epochs: int) -> dict:
    model = _mlp()
    model.compile(optimizer=make_opt(), loss="mse")
    clock = _clock_class()()
    with tempfile.TemporaryDirectory() as tmp:
        tb = keras.callbacks.TensorBoard(log_dir=tmp, write_steps_per_second=True, update_freq="batch")
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[clock, tb])
        scalars = _read_scalars(tmp)
    logged = dict(scalars["epoch_steps_per_second"])
    batch_rate = scalars["batch_steps_per_second"]
    epochs_out = []
    for e, ep in enumerate(clock.epochs):
        epochs_out.append({**ep, "logged_epoch_steps_per_second": logged[e],
                           "micro_steps_per_second": ep["micro_steps"] / ep["seconds"],
                           "updates_per_second": ep["updates"] / ep["seconds"]})
    return {"epochs": epochs_out, "batch_steps_per_second": [v for _, v in batch_rate],
            "batch_summary_steps": [s for s, _ in batch_rate], "tags": sorted(scalars)}


def case_tensorboard() -> tuple[list[dict], dict]:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:  # TF 2.21 no longer depends on it
        return [_row(5, "a", "skipped: the tensorboard package is not installed (pip install tensorboard)",
                     None, kind="skipped")], None
    epochs, micro_per_epoch = 4, 64
    x, y = _data(micro_per_epoch * B)
    runs = {"accum": _tensorboard_run(_acc, B, x, y, epochs), "plain": _tensorboard_run(_adam, B, x, y, epochs)}
    # The first epoch includes tracing: medians over the others.
    steady = {k: r["epochs"][1:] for k, r in runs.items()}

    def med(name, key):
        return statistics.median(ep[key] for ep in steady[name])

    def ratio(name, num, den, factor=1.0):
        return statistics.median(factor * ep[num] / ep[den] for ep in steady[name])

    acc = runs["accum"]
    per_epoch = steady["accum"][0]
    rows = [
        _row(5, "a", "wrapper: logged epoch_steps_per_second / micro-steps per s (wall clock)",
             ratio("accum", "logged_epoch_steps_per_second", "micro_steps_per_second"),
             f"= 1/N: it counts updates ({per_epoch['updates']} of {per_epoch['micro_steps']} micro-steps per "
             f"epoch); logged {med('accum', 'logged_epoch_steps_per_second'):.0f}/s, "
             f"micro-steps {med('accum', 'micro_steps_per_second'):.0f}/s, "
             f"updates {med('accum', 'updates_per_second'):.0f}/s", kind="ratio"),
        _row(5, "b", "wrapper: N x logged epoch_steps_per_second / micro-steps per s",
             ratio("accum", "logged_epoch_steps_per_second", "micro_steps_per_second", N),
             "read it as updates/s; logged / updates per s (wall clock) = "
             f"{ratio('accum', 'logged_epoch_steps_per_second', 'updates_per_second'):.3f}", kind="ratio"),
        _row(5, "info", "plain Adam at batch B: logged epoch_steps_per_second / batches per s",
             ratio("plain", "logged_epoch_steps_per_second", "micro_steps_per_second"),
             "without accumulation updates = batches", kind="ratio"),
        _row(5, "info", "wrapper: batch-level summaries (update_freq=\"batch\") / micro-steps",
             len(acc["batch_summary_steps"]) / sum(ep["micro_steps"] for ep in acc["epochs"]),
             f"one per micro-step, at steps 1..{acc['batch_summary_steps'][-1]}; batch_steps_per_second = "
             f"1 / (on_train_batch_begin to _end), per micro-step: median "
             f"{statistics.median(acc['batch_steps_per_second'][micro_per_epoch:]):.0f}/s (excludes the time "
             "between batches)", kind="ratio"),
    ]
    detail = {k: {kk: vv for kk, vv in r.items() if kk != "batch_steps_per_second"} for k, r in runs.items()}
    for k, r in runs.items():
        detail[k]["batch_steps_per_second_median_after_epoch_0"] = statistics.median(
            r["batch_steps_per_second"][micro_per_epoch:])
    return rows, detail


# ------------------------------------------------------------------- output
def _fmt(row: dict) -> str:
    if row["value"] is None:
        return "n/a"
    if row["kind"] == "ratio":
        return f"{row['value']:.3f}"
    return f"{row['value']:.2e}"


def table(data: dict, markdown: bool = False) -> str:
    bar = "\\|" if markdown else "|"  # a bare | would split a Markdown cell
    headers = ["case", "row", "what is run", f"max{bar}w - w_ref{bar} or ratio", "what happened"]
    rows = [[str(r["case"]), r["variant"], r["label"], _fmt(r), r["note"]] for r in data["rows"]]
    s = data["settings"]
    legend = (f"N={s['N']}, B={s['B']} (reference batch {s['N'] * s['B']}), Adam({s['lr']}), float32; "
              "(a) as naturally written, (b) the exact recipe, (info) context. Cases 1-4: max absolute weight "
              "difference from the reference; case 5: the ratio named in the row.")
    out = C.format_table(headers, rows, markdown) + "\n\n" + legend
    if markdown:
        env = data["env"]
        command = " ".join([".venv/bin/python -m benchmarks.caveats", *env.get("argv", [])])
        out = (f"Produced by `{command}` in {data['wall_seconds']:.0f} s on {env['date_utc']}: TensorFlow "
               f"{env['tensorflow']}, Keras {env['keras']}, {env.get('device', 'CPU')}, {env['cpus_usable']} CPUs, "
               f"load average at start {', '.join(f'{x:.1f}' for x in env['load_average_at_start'] or [])}."
               "\n\n" + out)
    return out


def plot(data: dict, path: Path) -> Path:
    plt = C.pyplot()
    rows = [r for r in data["rows"] if r["kind"] == "max_abs_dw"]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    colors = {"a": "tab:red", "b": "tab:green", "info": "tab:gray"}
    labels = [f"{r['case']}{r['variant']}: {r['label'] if len(r['label']) <= 75 else r['label'][:74] + '…'}"
              for r in rows]
    floor = 1e-10  # where a difference of exactly 0 is drawn
    values = [max(r["value"], floor) for r in rows]
    ax.barh(range(len(rows)), values, color=[colors[r["variant"]] for r in rows])
    for i, (r, v) in enumerate(zip(rows, values)):
        ax.text(v * 1.3, i, "0" if r["value"] == 0 else f"{r['value']:.1e}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1e-6, color="k", ls=":", lw=1)
    ax.set_xlim(floor / 2, 1.0)
    ax.set_xlabel(f"max |w - w_ref| (log scale; 0 drawn at {floor:.0e}; dotted line: 1e-6)")
    ax.set_title(f"Caveats of exactness: naive (red), exact recipe (green), context (gray); N={N}, B={B}, Adam")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return C.save_figure(fig, path)


CASES = {1: case_two_calls, 2: case_gan, 3: case_backup, 4: case_ragged, 5: case_tensorboard}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_output", help="output folder (default: bench_output)")
    parser.add_argument("--cases", type=C.parse_int_list, default=list(CASES),
                        help="comma list of cases to run (default: 1,2,3,4,5)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    env = C.static_env()
    t_start = time.perf_counter()
    _import_tf()
    env.update(C.tf_env())
    # Expected along the way: fit on a tf.data.Dataset ignores `shuffle`.
    warnings.filterwarnings("ignore", message=".*shuffle.*")
    prog = C.Progress("caveats", len(args.cases))
    data = {"benchmark": "caveats", "env": env,
            "settings": {"N": N, "B": B, "lr": LR, "optimizer": "Adam", "dtype": "float32",
                         "model": f"MLP {IN}-{HIDDEN}-{OUT} (tanh); GAN: G {LATENT}-{HIDDEN}-2, D 2-{HIDDEN}-1"},
            "rows": [], "cases": {}}
    for case in args.cases:
        t = time.perf_counter()
        out = CASES[case]()
        rows, detail = out if isinstance(out, tuple) else (out, None)
        data["rows"] += rows
        data["cases"][str(case)] = {"title": CASE_TITLES[case], "rows": rows, **({"detail": detail} if detail else {})}
        prog.step(f"{case}. {CASE_TITLES[case]}", "; ".join(f"{r['variant']} {_fmt(r)}" for r in rows),
                  time.perf_counter() - t)
    data["wall_seconds"] = time.perf_counter() - t_start
    print()
    print(table(data))
    C.write_outputs(args.out, "caveats", data, table(data, markdown=True), plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
