"""The independent reference of the Keras families: the same model trained
with batch N·B, no accumulation.

Both trainers take the same initial weights (a seeded builder), the same
samples in the same order, and a loss that is a mean over the batch, and run
the same way (eagerly, as a ``tf.function``, or XLA-compiled: some Keras 2
optimizers do not compute the same in eager and graph mode, Nadam's
``_u_product`` cache being a Python counter). The accumulating run sees the
N·B samples of each large batch as N consecutive micro-batches of B.

One module for Keras 3 on TensorFlow, Keras 2's new optimizer API and
Keras 2's legacy ``OptimizerV2`` (with tensorflow-addons): ``keras`` below is
the Keras those families use in this leg (:func:`support.families.keras_module`:
``import keras`` where it is Keras 3, else ``tf.keras``). The TF1 family's
reference (graph code) is :mod:`support.reference_tf1`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.arrays import max_abs_diff  # noqa: F401  (re-exported: the tests import it from here)
from support.families import keras_module
from support.precision import epsilon_16, mixed_precision_tolerance, update_weights_recorder  # noqa: F401

keras = keras_module()

MODES = ("eager", "graph", "xla")


# ------------------------------------------------------------ models, data
def make_mlp(seed: int = 0, in_dim: int = 6, hidden: int = 5, out_dim: int = 3, dtype: str | None = "float32"):
    """A small two-layer MLP whose initial weights depend only on ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((in_dim,), dtype=dtype),
            keras.layers.Dense(hidden, activation="tanh", dtype=dtype),
            keras.layers.Dense(out_dim, dtype=dtype),
        ]
    )


def make_data(n: int, in_dim: int = 6, out_dim: int = 3, seed: int = 1, dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype(dtype)
    y = rng.normal(size=(n, out_dim)).astype(dtype)
    return x, y


# The legacy / tensorflow-addons setting: a dense model and an embedding model
# whose table gets a ``tf.IndexedSlices`` gradient.
IN, HIDDEN, OUT = 5, 4, 3
VOCAB, DIM, SEQ = 12, 3, 2


def dense_model(seed: int = 0, dtype: str = "float32", constraint=None):
    """Dense(HIDDEN, tanh) -> Dense(OUT): a dense-gradient model."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.Dense(HIDDEN, activation="tanh", dtype=dtype, kernel_constraint=constraint,
                               input_shape=(IN,)),
            keras.layers.Dense(OUT, dtype=dtype, bias_initializer="glorot_uniform"),
        ]
    )


def embedding_model(seed: int = 0):
    """Embedding(VOCAB, DIM) -> Flatten -> Dense(OUT): the embedding table's
    gradient is a ``tf.IndexedSlices`` over the ids looked up."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.Embedding(VOCAB, DIM, input_length=SEQ, input_shape=(SEQ,)),
            keras.layers.Flatten(),
            keras.layers.Dense(OUT),
        ]
    )


def dense_data(n: int, seed: int = 1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, IN)).astype(dtype), rng.normal(size=(n, OUT)).astype(dtype)


def embedding_data(n: int, seed: int = 1, vocab_used: int = VOCAB):
    """Ids drawn from the first ``vocab_used`` rows only, so that the other
    rows are never looked up (what lazy sparse optimizers must leave alone)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab_used, size=(n, SEQ)).astype(np.int32)
    return x, rng.normal(size=(n, OUT)).astype(np.float32)


def table_model(vocab: int, dim: int, seed: int = 21):
    """Embedding(vocab, dim) named ``table`` -> GlobalAveragePooling1D ->
    Dense(2), on 5 ids a sample: the table's gradient is a
    ``tf.IndexedSlices``."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="table")(inp)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(2)(h))


def table_data(n: int, seed: int = 4):
    """Ids for :func:`table_model`: few distinct ones (0-11), so micro-batches
    repeat ids (duplicate indices in the slices) and leave most rows of the
    table untouched in every window."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, size=(n, 5)).astype("int32")
    return ids, rng.normal(size=(n, 2)).astype("float32")


def densifications(ops, vocab: int, dim: int) -> list:
    """The ops among ``ops`` that turn slices into a dense tensor (TF's
    IndexedSlices-to-dense conversion is an ``UnsortedSegmentSum``), or write a
    dense ``(vocab, dim)`` value into a variable."""
    bad = []
    for op in ops:
        if op.type == "UnsortedSegmentSum":
            bad.append(op.type)
        if op.type in ("AssignAddVariableOp", "AssignVariableOp"):
            shape = op.inputs[1].shape
            if shape.rank is not None and tuple(shape.as_list()) == (vocab, dim):
                bad.append(op.type)
    return bad


def mse(y, p):
    return tf.reduce_mean(tf.square(tf.cast(y, p.dtype) - p))


# ------------------------------------------------------------------ steps
def make_train_step(model, optimizer, loss_fn=mse, mode: str = "graph"):
    """A custom-loop step: tape, gradients (of the loss scaled by the
    optimizer's ``scale_loss`` where it has one: Keras 3), ``apply_gradients``.
    ``mode``: ``"eager"`` (untraced), ``"graph"`` (``tf.function``) or
    ``"xla"`` (``tf.function(jit_compile=True)``)."""
    assert mode in MODES, mode
    scale_loss = getattr(optimizer, "scale_loss", None)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = loss if scale_loss is None else scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if mode == "eager":
        return step
    return tf.function(step, jit_compile=(mode == "xla"))


def train(model, optimizer, x, y, batch: int, steps: int, loss_fn=mse, mode: str = "graph"):
    """``steps`` optimizer calls on consecutive batches of ``batch`` samples."""
    step = make_train_step(model, optimizer, loss_fn, mode)
    for s in range(steps):
        sl = slice(s * batch, (s + 1) * batch)
        step(tf.constant(x[sl]), tf.constant(y[sl]))
    return model


def train_updates(step, x, y, n: int, b: int, updates: int, accumulate: bool, record: Callable) -> list:
    """``updates`` updates on consecutive samples of ``x, y``: each N calls of
    ``step`` on micro-batches of ``b`` (``accumulate``) or one call on the
    batch of N·b; ``record()`` after each update, its results returned."""
    out = []
    for u in range(updates):
        xs, ys = x[u * n * b:(u + 1) * n * b], y[u * n * b:(u + 1) * n * b]
        if accumulate:
            for k in range(n):
                step(tf.constant(xs[k * b:(k + 1) * b]), tf.constant(ys[k * b:(k + 1) * b]))
        else:
            step(tf.constant(xs), tf.constant(ys))
        out.append(record())
    return out


def reference_and_accumulated(
    model_fn: Callable,
    optimizer_fn: Callable,
    n: int,
    micro_batch: int,
    windows: int,
    reduction: str = "mean",
    mode: str = "graph",
    dtype: str = "float32",
    data_seed: int = 1,
):
    """Train the reference (``windows`` steps of batch ``n*micro_batch``) and the
    accumulating model (``n*windows`` micro-steps of ``micro_batch``).

    With ``reduction="sum"`` the reference loss is multiplied by ``n`` (the
    sum of ``n`` micro-batch mean losses has that gradient).
    """
    ref_model, acc_model = model_fn(), model_fn()
    in_dim = ref_model.inputs[0].shape[-1]
    out_dim = ref_model.outputs[0].shape[-1]
    x, y = make_data(n * micro_batch * windows, in_dim, out_dim, data_seed, dtype)
    scale = float(n) if reduction == "sum" else 1.0

    def ref_loss(yt, yp):
        return mse(yt, yp) * tf.cast(scale, yp.dtype)

    ref_opt = optimizer_fn()
    acc_opt = AccumulatingOptimizer(optimizer_fn(), gradient_accumulation_steps=n, reduction=reduction)
    train(ref_model, ref_opt, x, y, n * micro_batch, windows, loss_fn=ref_loss, mode=mode)
    train(acc_model, acc_opt, x, y, micro_batch, n * windows, mode=mode)
    return ref_model, acc_model, ref_opt, acc_opt


def run_pair(make_inner, n, b, updates, model_fn=dense_model, data_fn=dense_data,
             mode="graph", reduction="mean", loss_fn=mse):
    """Train the reference (batch ``n*b``) and the accumulating run (``n``
    micro-batches of ``b``); record the weights after every update (the
    legacy / tensorflow-addons setting: ``inner.weights`` is the state).

    ``make_inner(model)`` builds the plain inner optimizer (the model is
    there for tfa's ``MultiOptimizer``, which needs its layers).

    Returns ``(ref, acc)``: dicts with ``model``, ``opt`` (the optimizer the
    step called), ``inner`` (the plain optimizer whose state is compared),
    ``initial`` (the model's initial weights) and ``trajectory``: after every
    update, the model's weights followed by every variable of the inner
    optimizer (``iterations``, slots, tfa's slow/average weights).
    """
    x, y = data_fn(n * b * updates)
    out = []
    for accumulate in (False, True):
        model = model_fn()
        inner = make_inner(model)
        opt = AccumulatingOptimizer(inner, n, reduction=reduction) if accumulate else inner
        ref_loss = loss_fn
        if reduction == "sum" and not accumulate:
            ref_loss = lambda y_, p_: loss_fn(y_, p_) * n  # noqa: E731 - the "sum" reference
        step = make_train_step(model, opt, ref_loss, mode=mode)
        trajectory = train_updates(
            step, x, y, n, b, updates, accumulate,
            record=lambda: [w.numpy().copy() for w in model.weights] + [w.numpy().copy() for w in inner.weights])
        out.append({"model": model, "opt": opt, "inner": inner, "trajectory": trajectory,
                    "initial": [w.numpy() for w in model_fn().weights]})
    return out[0], out[1]


# ------------------------------------------------------------- comparisons
def weights(model_or_vars):
    vs = model_or_vars.weights if isinstance(model_or_vars, keras.Model) else list(model_or_vars)
    return [np.array(v.numpy()) for v in vs]


def moved(run) -> float:
    """How far training moved the model (so a comparison means something)."""
    return max_abs_diff(run["trajectory"][-1][: len(run["initial"])], run["initial"])


def trajectory_diff(ref, acc) -> float:
    return max(max_abs_diff(r, a) for r, a in zip(ref["trajectory"], acc["trajectory"]))


def state_diff(ref, acc) -> float:
    """Max difference over every variable of the inner optimizers (legacy
    ``weights``: ``iterations``, slots, tfa wrappers' slow/average weights),
    compared in order."""
    return max_abs_diff([w.numpy() for w in ref["inner"].weights], [w.numpy() for w in acc["inner"].weights])


def optimizer_state(opt) -> list:
    """Every ``tf.Variable`` a Keras 2 (new API) optimizer holds, as arrays, in
    a fixed order: ``opt.variables`` (iterations and slots), then the
    variables held as attributes and not listed there (the learning rate, a
    schedule's current learning rate, Nadam's ``_u_product``), by attribute
    name."""
    found, seen = [], set()

    def add(v):
        if isinstance(v, tf.Variable) and id(v) not in seen:
            seen.add(id(v))
            found.append(v)

    for v in opt.variables:
        add(v)
    for name in sorted(vars(opt)):
        value = vars(opt)[name]
        for v in value if isinstance(value, (list, tuple)) else [value]:
            add(v)
    return [np.array(v.numpy()) for v in found]


def optimizer_cases() -> dict:
    """One factory per Keras 2 new-API optimizer class (and SGD/RMSprop
    variant); every class Keras 2.15 and tf_keras 2.21 have."""
    o = keras.optimizers
    return {
        "sgd": lambda: o.SGD(0.1),
        "sgd_momentum": lambda: o.SGD(0.1, momentum=0.9),
        "sgd_nesterov": lambda: o.SGD(0.1, momentum=0.9, nesterov=True),
        "adam": lambda: o.Adam(1e-2),
        "adam_amsgrad": lambda: o.Adam(1e-2, amsgrad=True),
        "adamw": lambda: o.AdamW(1e-2, weight_decay=0.05),
        "adamax": lambda: o.Adamax(1e-2),
        "adagrad": lambda: o.Adagrad(5e-2),
        "adadelta": lambda: o.Adadelta(1.0),
        "rmsprop": lambda: o.RMSprop(1e-2),
        "rmsprop_centered": lambda: o.RMSprop(1e-2, centered=True, momentum=0.5),
        "nadam": lambda: o.Nadam(1e-2),
        "ftrl": lambda: o.Ftrl(5e-2, l1_regularization_strength=1e-3, l2_regularization_strength=1e-3),
        "lion": lambda: o.Lion(1e-3),
        "adafactor": lambda: o.Adafactor(1e-2),
    }


# ------------------------------------------------- missing gradients
def missing_grad_model():
    """y = a(x) + b(x); b's kernel has a NonNeg constraint and starts with
    negative entries, so constraining it without an update would show."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    a = keras.layers.Dense(2, name="branch_a")
    b = keras.layers.Dense(
        2,
        name="branch_b",
        kernel_constraint=keras.constraints.NonNeg(),
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=5),
    )
    return keras.Model(inp, [a(inp), b(inp)])


def missing_grad_loss(model, xb, yb, uses_b):
    pa, pb = model(xb)
    return mse(yb, pa + pb) if uses_b else mse(yb, pa)


# Which micro-steps of each window use branch b (N = 4). Window 0: never (b
# must not move: no update, no weight decay, no constraint, no EMA); window
# 1: only the first micro-step; window 2: all but the last (a wrapper that
# drops the window when the last gradient is None loses this sum); window 3:
# all; window 4: never again, now that b, its moments and its EMA shadow are
# away from their initial values (slot decay, weight decay and an EMA step
# would all show).
MISSING_GRAD_PATTERN = [[False] * 4, [True, False, False, False], [True, True, True, False], [True] * 4, [False] * 4]
MISSING_GRAD_INNERS = {
    "adamw_ema": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.2, use_ema=True, ema_momentum=0.9),
    "sgd_momentum_ema_overwrite": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, weight_decay=0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=1
    ),
}


def missing_grad_reference(inner_fn, x, y, mb, n=4, pattern=MISSING_GRAD_PATTERN):
    """The plain optimizer on the hand-built large batch of each window of
    ``pattern``: one tape over the window's micro-batch losses, so branch b
    gets ``None`` where no micro-batch uses it."""
    model = missing_grad_model()
    opt = inner_fn()
    k = 0
    for w, window in enumerate(pattern):
        with tf.GradientTape() as tape:
            losses = [
                missing_grad_loss(model, x[(k + i) * mb : (k + i + 1) * mb], y[(k + i) * mb : (k + i + 1) * mb], u)
                for i, u in enumerate(window)
            ]
            loss = tf.add_n(losses) / n  # mean over the window's N*B samples
        k += n
        grads = tape.gradient(loss, model.trainable_variables)
        assert (grads[2] is None) == (not any(window))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if w == 0:
            assert np.any(model.get_layer("branch_b").kernel.numpy() < 0), "b must stay untouched in window 0"
    return model, opt


# ------------------------------------------------------ mixed precision
UpdateWeights = update_weights_recorder(keras)


