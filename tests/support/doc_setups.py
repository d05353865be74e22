"""What the documentation's code blocks take for granted, with tiny data.

A block's marker names one of these as ``setup`` (it fills the block's
namespace before the block runs) or as ``then`` (it runs what the block
only defines, and checks it). See :mod:`support.doc_blocks`.

The data: 64 samples of 8 features, 4 classes; ``micro_batches`` are its
four micro-batches of 16.
"""

from __future__ import annotations

import numpy as np

SAMPLES, FEATURES, CLASSES, MICRO_BATCH = 64, 8, 4, 16


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=SAMPLES).astype("int32")
    return x, y


def _classifier_namespace(keras, ns: dict) -> None:
    x, y = _data()
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    ns.update(
        keras=keras, np=np, x=x, y=y, model=model,
        loss_fn=keras.losses.SparseCategoricalCrossentropy(),
        micro_batches=[(x[i:i + MICRO_BATCH], y[i:i + MICRO_BATCH]) for i in range(0, SAMPLES, MICRO_BATCH)],
    )


def classifier(ns: dict) -> None:
    """Keras 3 (any backend): ``model`` (8 -> 16 -> 4, softmax), ``x``, ``y``,
    ``loss_fn``, ``micro_batches``."""
    import keras

    keras.utils.set_random_seed(0)
    _classifier_namespace(keras, ns)


def classifier_keras2(ns: dict) -> None:
    """The same with ``tf.keras`` (Keras 2), and ``tf``."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    _classifier_namespace(tf.keras, ns)
    ns["tf"] = tf


def regressor_tfa(ns: dict) -> None:
    """Keras 2 with tensorflow-addons: a regression ``model`` (mse), ``x``,
    ``y`` (float targets), ``tf``, ``tfa``, ``inner`` (legacy Adam), ``micro_batches``."""
    import tensorflow as tf
    import tensorflow_addons as tfa

    classifier_keras2(ns)
    ns["y"] = ns["x"][:, :CLASSES].sum(axis=1, keepdims=True).repeat(CLASSES, axis=1)
    ns.update(tfa=tfa, inner=tf.keras.optimizers.legacy.Adam(1e-3), loss_fn=tf.keras.losses.MeanSquaredError())
    ns["micro_batches"] = [(ns["x"][i:i + MICRO_BATCH], ns["y"][i:i + MICRO_BATCH])
                           for i in range(0, SAMPLES, MICRO_BATCH)]


def keras2_opt(ns: dict) -> None:
    """:func:`classifier_keras2` and ``opt``, an accumulating legacy Adam at N = 8."""
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    classifier_keras2(ns)
    ns["opt"] = AccumulatingOptimizer(tf.keras.optimizers.legacy.Adam(1e-3), gradient_accumulation_steps=8)


def trained_keras3(ns: dict) -> None:
    """:func:`classifier`, compiled with an accumulating Adam and trained one epoch."""
    from accum_optimizer import AccumulatingOptimizer

    classifier(ns)
    keras, model = ns["keras"], ns["model"]
    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3), 4),
                  loss="sparse_categorical_crossentropy")
    model.fit(ns["x"], ns["y"], batch_size=MICRO_BATCH, epochs=1, verbose=0)


def mixed_float16_fit(ns: dict) -> None:
    """After a callback class ``SkipCounters`` is defined: ``fit`` under
    ``"mixed_float16"`` with a skipping policy logs the two counters."""
    import keras

    from accum_optimizer import AccumulatingOptimizer

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        classifier(ns)
        model = ns["model"]
        model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3), 2, nonfinite="skip_window"),
                      loss="sparse_categorical_crossentropy")
        history = model.fit(ns["x"], ns["y"], batch_size=MICRO_BATCH, epochs=2, verbose=0,
                            callbacks=[ns["SkipCounters"]()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Finite data: nothing skipped, and the callback put both counters in the logs.
    assert history.history["skipped_micro_steps"] == [0, 0], history.history
    assert history.history["skipped_windows"] == [0, 0], history.history


def jax_loop(ns: dict) -> None:
    """Keras 3 on JAX: :func:`classifier`, ``jax`` and ``grad_fn`` as Keras'
    JAX custom-loop guide writes them (``stateless_call`` and ``jax.value_and_grad``)."""
    import jax

    from accum_optimizer import AccumulatingOptimizer

    classifier(ns)
    model, loss_fn = ns["model"], ns["loss_fn"]

    def compute_loss_and_updates(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, y_pred), non_trainable

    ns.update(jax=jax, AccumulatingOptimizer=AccumulatingOptimizer,
              grad_fn=jax.value_and_grad(compute_loss_and_updates, has_aux=True))


def jax_train_step_runs(ns: dict) -> None:
    """Runs the block's ``train_step`` over two windows of the micro-batches:
    the weights stay bitwise as they were for the first three micro-steps and
    move at the fourth (N = 4); ``iterations`` counts the two updates."""
    model, optimizer, train_step = ns["model"], ns["optimizer"], ns["train_step"]
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    start = [np.asarray(v) for v in state[0]]
    for i, (x, y) in enumerate(ns["micro_batches"] * 2, start=1):
        _, state = train_step(state, x, y)
        moved = any(not np.array_equal(a, np.asarray(b)) for a, b in zip(start, state[0]))
        if i < 4:
            assert not moved, f"the weights moved at micro-step {i} of a window of 4"
    assert moved
    for variable, value in zip(optimizer.variables, state[2]):
        variable.assign(value)
    assert int(optimizer.iterations) == 2 and int(optimizer.micro_steps) == 8


def tf1_graph(ns: dict) -> None:
    """TF1 graph mode: a two-layer model whose first layer is under a
    ``VGG`` scope (frozen by the block), ``loss`` over placeholders, and
    ``micro_batches`` as feed dicts."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    x, y = _data()
    loss, x_in, y_in = _tf1_model(tf1, frozen_scope="VGG")
    ns.update(tf=tf, np=np, loss=loss,
              micro_batches=[{x_in: x[i:i + MICRO_BATCH], y_in: y[i:i + MICRO_BATCH]}
                             for i in range(0, SAMPLES, MICRO_BATCH)])


def _tf1_model(tf1, frozen_scope: str = "frozen"):
    """A TF1 graph's two dense layers (the first under ``frozen_scope``) and
    softmax cross-entropy: ``(loss, x placeholder, y placeholder)``."""
    x_in = tf1.placeholder("float32", (None, FEATURES))
    y_in = tf1.placeholder("int32", (None,))
    init = tf1.glorot_uniform_initializer(seed=0)
    with tf1.variable_scope(frozen_scope):
        hidden = tf1.nn.relu(x_in @ tf1.get_variable("kernel", (FEATURES, 16), initializer=init))
    logits = hidden @ tf1.get_variable("head", (16, CLASSES), initializer=init)
    return tf1.losses.sparse_softmax_cross_entropy(y_in, logits), x_in, y_in


def tf1_saving(ns: dict) -> None:
    """TF1: ``plain_checkpoint`` written by the same model trained *without*
    accumulation (plain Adam, two steps, its own graph); then, in the default
    graph, the model with ``opt`` (accumulating Adam, N = 2), ``tf1`` and an
    open ``sess`` three micro-steps into training (mid-window)."""
    import os

    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    x, y = _data()

    def model_loss():
        loss, x_in, y_in = _tf1_model(tf1)
        return loss, {x_in: x, y_in: y}

    with tf.Graph().as_default(), tf1.Session() as sess:
        loss, feed = model_loss()
        train_op = tf1.train.AdamOptimizer(1e-3).minimize(loss, global_step=tf1.train.get_or_create_global_step())
        sess.run(tf1.global_variables_initializer())
        for _ in range(2):
            sess.run(train_op, feed_dict=feed)
        plain_checkpoint = tf1.train.Saver().save(sess, os.path.join("plain", "model"))
    loss, feed = model_loss()
    opt = AccumulatingOptimizer(tf1.train.AdamOptimizer(1e-3), gradient_accumulation_steps=2)
    train_op = opt.minimize(loss, global_step=tf1.train.get_or_create_global_step())
    sess = tf1.Session()
    sess.run(tf1.global_variables_initializer())
    for _ in range(3):  # one update and one micro-step into the next window
        sess.run(train_op, feed_dict=feed)
    ns.update(tf=tf, tf1=tf1, np=np, opt=opt, sess=sess, plain_checkpoint=plain_checkpoint)


def tf1_restored_at_zero(ns: dict) -> None:
    """After the saving block: the export holds no accumulator, and after the
    plain checkpoint's restore every accumulation variable is zero and the
    global step is the plain run's two steps (the accumulating run had made
    one update)."""
    tf, tf1, sess, opt = ns["tf"], ns["tf1"], ns["sess"], ns["opt"]
    exported = {name for name, _ in tf.train.list_variables("inference_model")}
    accumulation = {v.op.name for v in opt.accumulation_variables()}
    assert exported and not exported & accumulation, (exported, accumulation)
    for v in opt.accumulation_variables():
        assert not np.any(sess.run(v)), v.name
    assert sess.run(tf1.train.get_global_step()) == 2


def regressor_keras2(ns: dict) -> None:
    """:func:`classifier_keras2` with float targets of shape ``(64, 4)`` (for ``"mse"``)."""
    classifier_keras2(ns)
    x = ns["x"]
    ns["y"] = np.tanh(x[:, :CLASSES] + x[:, CLASSES:])


def distributed(ns: dict) -> None:
    """Keras 3 on TensorFlow under a strategy: ``make_model`` (8 -> 4,
    regression), ``make_dataset`` (256 samples of ``(x, y)``, unbatched),
    ``dataset``, ``loss_fn`` (mean squared error per example,
    ``reduction=None``) and ``B = 64``, the global micro-batch."""
    import keras
    import tensorflow as tf

    from accum_optimizer import AccumulatingOptimizer

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * 64, FEATURES)).astype("float32")
    y = np.tanh(x[:, :CLASSES] + x[:, CLASSES:])

    def make_model():
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])

    def make_dataset():
        return tf.data.Dataset.from_tensor_slices((x, y))

    ns.update(tf=tf, keras=keras, np=np, AccumulatingOptimizer=AccumulatingOptimizer, make_model=make_model,
              make_dataset=make_dataset, dataset=make_dataset(), B=64,
              loss_fn=keras.losses.MeanSquaredError(reduction=None))


def torch_loop(ns: dict) -> None:
    """Keras 3 on torch: :func:`classifier` with ``micro_batches`` as torch
    tensors, and ``epochs = 2``."""
    import torch

    classifier(ns)
    ns["micro_batches"] = [(torch.from_numpy(x), torch.from_numpy(y).long()) for x, y in ns["micro_batches"]]
    ns["epochs"] = 2
