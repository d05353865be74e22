"""keras-hub tasks trained with ``AccumulatingOptimizer`` through keras-hub's
own ``fit``, on whichever Keras 3 backend runs (TensorFlow in the k3 leg, JAX
in k3-jax, torch in k3-torch).

The tasks are built from config (tiny: 2 layers, hidden size 16, vocabulary
64, sequences of 8 tokens; no preset, no download, ``preprocessor=None``:
token ids, segment ids and padding masks are fed as arrays), with the data
generated here from a fixed seed:

* ``GPT2Backbone`` / ``GPT2CausalLM`` with padding masks: the loss is the
  mean over the unmasked tokens (``reduction="mean_with_sample_weight"``,
  the padding mask as sample weights), whose micro-batches of equal size
  hold different numbers of tokens. ``CountedLoss`` weights each by its
  count and the window is the large batch's; without it, the mean of the
  micro-batch means is not (the documented caveat, measured).
* ``BertBackbone`` / ``BertTextClassifier`` with keras-hub's own loss.
* AdamW with weight decay and the usual transformer exclusion (no decay on
  biases and layer-norm scales and offsets), set on the inner optimizer or
  through the wrapper (``AccumulatingOptimizer.exclude_from_weight_decay``).

Reference: the same task from the same seed (the same initial weights),
trained with ``fit(batch_size=N*B)`` and the plain inner optimizer; the
wrapper trains with ``fit(batch_size=B)`` and N micro-batches per update.

keras-hub's ``compile`` is its own (every task overrides it), so
``keras.saving.load_model`` does not compile a loaded task: the saved
optimizer is dropped. The recipe that resumes mid-window bitwise (also in
docs/saving.md, "keras-hub tasks") is tested last.

Where the leg pins keras-hub (``ACCUM_LEG_PINS``, set by ``make test``) it
must import at that version; elsewhere the module skips with the reason.
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3."):
    pytest.skip(f"keras-hub needs Keras 3 (this is Keras {keras.__version__})", allow_module_level=True)

if keras.backend.backend() == "tensorflow":
    from support.families import require

    require("keras3")

from packaging.requirements import Requirement  # noqa: E402

HUB_PINS = [Requirement(p) for p in os.environ.get("ACCUM_LEG_PINS", "").split() if Requirement(p).name == "keras-hub"]
if HUB_PINS:  # the leg installs it: it must import
    import keras_hub
else:
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (make test pins it in k3, "
                                                        "k3-jax and k3-torch)")

from keras import ops  # noqa: E402

from accum_optimizer import AccumulatingOptimizer, CountedLoss  # noqa: E402
from support.arrays import assert_bitwise_equal, max_abs_diff  # noqa: E402

BACKEND = keras.backend.backend()
N, B = 3, 4
UPDATES_PER_EPOCH, EPOCHS = 2, 2
SAMPLES = UPDATES_PER_EPOCH * N * B
VOCAB, SEQ = 64, 8
LR, WEIGHT_DECAY = 0.01, 0.1
# Not decayed: biases and the layer norms' scales and offsets (matched in the
# variables' names: "bias", "gamma", "beta").
NO_DECAY = ["bias", "gamma", "beta"]

# Tolerance. The accumulating run and the large batch compute every token's
# loss and gradient alike; they differ only in the order float32 adds those
# terms (per micro-batch, then across the window, weighted by the counts,
# against once over the large batch), a few unit roundoffs (2**-24) of the
# gradient sums. To first order that moves AdamW's step by at most about
# 2 * lr * (relative gradient error) per update (tests/support/precision.py),
# far below 1e-5; but where a gradient element nearly cancels (a sum of
# terms of both signs), the same absolute rounding is a large relative error
# that Adam's normalised step turns into up to lr per update, and a
# transformer's next forward pass spreads it. The suite's float32 tolerance,
# 1e-5 (tests/support/drivers/base.py), holds that with room: the runs here
# measure 1e-7 to 1.4e-6 after 4 updates of lr 1e-2 on the three backends
# (`-s` prints them: KERAS_HUB_TABLE). Each check also asserts that training moved the weights by more than
# 100 * TOL, and the unweighted window of the masked loss, a real error of
# the kind this suite must catch, is measured > 100 * TOL away.
TOL = 1e-5


def numpy(variables) -> list:
    return [np.array(ops.convert_to_numpy(v)) for v in variables]


def show(task: str, diff: float, moved: float) -> None:
    print(f"KERAS_HUB_TABLE {BACKEND} keras-hub {keras_hub.__version__} {task}: max|dw| {diff:.3g}, moved {moved:.3g}")


def test_keras_hub_is_the_pinned_version_and_imports_no_tensorflow_on_other_backends():
    """The leg has keras-hub at its pin; on JAX and torch without TensorFlow
    (keras-hub's TensorFlow-only dependency, tensorflow-text, left out)."""
    import importlib.util
    import sys

    for pin in HUB_PINS:
        assert pin.specifier.contains(keras_hub.__version__, prereleases=True), (pin, keras_hub.__version__)
    if BACKEND != "tensorflow" and os.environ.get("ACCUM_LEG") in ("k3-jax", "k3-torch"):
        assert importlib.util.find_spec("tensorflow") is None
        assert "tensorflow" not in sys.modules


# ------------------------------------------------------------------ GPT-2
def gpt2_data(samples: int = SAMPLES, seed: int = 0):
    """Token ids and padding masks of ``samples`` sequences of random length
    (2 to SEQ + 1 tokens, the rest padding id 0): inputs, next-token labels,
    and the labels' padding mask as sample weights."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(samples, SEQ + 1)).astype("int32")
    lengths = rng.integers(2, SEQ + 2, size=samples)
    mask = np.arange(SEQ + 1)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return x, ids[:, 1:], mask[:, 1:].astype("float32")


def gpt2(seed: int = 1):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
        max_sequence_length=2 * SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_mean():
    """Cross-entropy averaged over the unmasked tokens (the padding mask as
    sample weights, divided by their sum)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")


def adamw():
    optimizer = keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY)
    optimizer.exclude_from_weight_decay(var_names=NO_DECAY)
    return optimizer


def fit_gpt2(optimizer, loss, batch_size: int, epochs: int = EPOCHS, data=None, model=None):
    x, y, sample_weight = data or gpt2_data()
    model = model or gpt2()
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[])
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def resumable_optimizer():
    """The wrapper, the exclusion set through it (forwarded to the inner AdamW)."""
    optimizer = AccumulatingOptimizer(keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY), N)
    optimizer.exclude_from_weight_decay(var_names=NO_DECAY)
    return optimizer


@functools.cache
def gpt2_runs(name: str):
    """Each GPT-2 run's trained task (cached: tests share runs)."""
    if name == "start":
        return gpt2()
    if name == "large batch":
        return fit_gpt2(adamw(), token_mean(), N * B)
    if name == "accumulated, CountedLoss":
        return fit_gpt2(resumable_optimizer(), CountedLoss(token_mean()), B)
    if name == "accumulated, plain loss":
        return fit_gpt2(AccumulatingOptimizer(adamw(), N), token_mean(), B)
    raise KeyError(name)


def gpt2_weights(name: str) -> list:
    return gpt2_runs(name).get_weights()


def test_gpt2_micro_batches_hold_different_numbers_of_tokens():
    """The data the padding-mask tests rely on: equal micro-batches of B
    sequences with unequal token counts, and every run's same start."""
    _, _, mask = gpt2_data()
    counts = mask.reshape(-1, B, SEQ).sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1, counts
    # The reference and the wrapper's run start from the same weights (the seed).
    assert_bitwise_equal(gpt2_weights("start"), gpt2().get_weights(), "initial weights")


def test_gpt2_causal_lm_with_padding_masks_and_counted_loss_trains_like_the_large_batch():
    reference = gpt2_weights("large batch")
    diff = max_abs_diff(reference, gpt2_weights("accumulated, CountedLoss"))
    moved = max_abs_diff(reference, gpt2_weights("start"))
    show("GPT2CausalLM, padding masks, CountedLoss, AdamW exclusion through the wrapper", diff, moved)
    assert moved > 100 * TOL, "the reference must move for the comparison to mean anything"
    assert diff <= TOL, diff


def test_exclusion_set_through_the_wrapper_reaches_the_inner_adamw():
    """By hand, on the GPT-2 task's variables: a window of zero gradients
    makes Adam's step 0, so the update is AdamW's decay alone,
    ``w - w * weight_decay * lr`` (float32), on every variable but those the
    exclusion names, which stay bitwise as they were."""
    model = gpt2()
    variables = model.trainable_variables
    optimizer = AccumulatingOptimizer(keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY), N)
    optimizer.exclude_from_weight_decay(var_names=NO_DECAY)
    optimizer.build(variables)
    start = numpy(variables)
    for _ in range(N):
        optimizer.apply([ops.zeros(v.shape, v.dtype) for v in variables], variables)
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 1
    excluded = [any(name in v.name for name in NO_DECAY) for v in variables]
    assert any(excluded) and not all(excluded)
    decay = np.float32(WEIGHT_DECAY) * np.float32(LR)
    for v, w, after, keep in zip(variables, start, numpy(variables), excluded):
        if keep:
            assert_bitwise_equal([w], [after], v.path)
        else:
            np.testing.assert_allclose(after, w - w * decay, rtol=1e-6, atol=0, err_msg=v.path)
            assert np.any(after != w), v.path


def test_gpt2_without_counted_loss_the_token_mean_window_differs_measurably():
    """The documented caveat: the plain window is the mean of the
    micro-batches' token means, not the mean over the window's tokens."""
    reference = gpt2_weights("large batch")
    diff = max_abs_diff(reference, gpt2_weights("accumulated, plain loss"))
    show("GPT2CausalLM, padding masks, no CountedLoss (caveat)", diff, max_abs_diff(reference, gpt2_weights("start")))
    assert diff > 100 * TOL, diff


# ------------------------------------------------------------------- BERT
def bert_data(samples: int = SAMPLES, seed: int = 2):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(samples, SEQ)).astype("int32")
    lengths = rng.integers(2, SEQ + 1, size=samples)
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    segments = (np.arange(SEQ)[None, :] >= lengths[:, None] // 2).astype("int32") * mask
    x = {"token_ids": np.where(mask, ids, 0), "segment_ids": segments, "padding_mask": mask}
    return x, rng.integers(0, 3, size=samples).astype("int32")


def bert(seed: int = 1):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)


def no_decay_variables(model) -> list:
    return [v for v in model.trainable_variables if any(name in v.path for name in NO_DECAY)]


class DenseAdamW(keras.optimizers.AdamW):
    """AdamW on the dense gradient: on TensorFlow the token and segment
    embeddings' gradients are ``tf.IndexedSlices`` with repeated ids, which
    Keras' AdamW squares slice by slice before combining the repeats, while
    the window hands the inner AdamW the dense window gradient (each row
    once): the window equals the large batch on the dense gradient
    (docs/semantics.md, "Embedding gradients with repeated ids"). JAX and
    torch have dense gradients only."""

    def apply(self, grads, trainable_variables=None):
        import tensorflow as tf

        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return super().apply(grads, trainable_variables)


def fit_bert(accumulate: bool):
    """keras-hub's own loss and metrics (``compile(optimizer=...)`` only);
    the exclusion set on the inner AdamW, by variables. The reference is
    the large batch with AdamW on the dense gradient (:class:`DenseAdamW`
    on TensorFlow)."""
    model = bert()
    plain = DenseAdamW if BACKEND == "tensorflow" and not accumulate else keras.optimizers.AdamW
    inner = plain(LR, weight_decay=WEIGHT_DECAY)
    inner.exclude_from_weight_decay(var_list=no_decay_variables(model))
    model.compile(optimizer=AccumulatingOptimizer(inner, N) if accumulate else inner)
    x, y = bert_data()
    model.fit(x, y, batch_size=B if accumulate else N * B, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def test_bert_text_classifier_trains_like_the_large_batch():
    model = bert()
    assert no_decay_variables(model) and len(no_decay_variables(model)) < len(model.trainable_variables)
    reference = fit_bert(accumulate=False)
    accumulated = fit_bert(accumulate=True)
    assert isinstance(accumulated.loss, keras.losses.SparseCategoricalCrossentropy)  # keras-hub's default
    diff = max_abs_diff(reference.get_weights(), accumulated.get_weights())
    moved = max_abs_diff(reference.get_weights(), model.get_weights())
    show("BertTextClassifier, AdamW exclusion on the inner", diff, moved)
    assert moved > 100 * TOL
    assert diff <= TOL, diff
    assert int(ops.convert_to_numpy(accumulated.optimizer.iterations)) == UPDATES_PER_EPOCH * EPOCHS
    assert int(ops.convert_to_numpy(accumulated.optimizer.micro_steps)) == N * UPDATES_PER_EPOCH * EPOCHS


# ----------------------------------------------------------------- saving
def test_load_model_drops_the_optimizer_and_compile_then_load_weights_resumes_mid_window_bitwise(tmp_path):
    """``load_model`` rebuilds the task, whose constructor compiles it with
    keras-hub's defaults; Keras then skips the saved compile config (the
    task's ``compile`` is custom) and the saved optimizer state (it does not
    fit the default optimizer). Compiling with the wrapper and loading the
    same file's weights restores the window (accumulators, counts,
    ``mini_step``) and training resumes bitwise: against the uninterrupted
    run of the padding-mask test (2 epochs of 6 micro-batches), the first 5
    micro-batches, saved mid-window, then the other 7 (the 6th, and the
    second epoch's 6) after the load."""
    x, y, sample_weight = gpt2_data()
    head = slice(0, 5 * B)
    first = fit_gpt2(resumable_optimizer(), CountedLoss(token_mean()), B, epochs=1,
                     data=({k: v[head] for k, v in x.items()}, y[head], sample_weight[head]))
    assert int(ops.convert_to_numpy(first.optimizer.mini_step)) == 2
    path = str(tmp_path / "gpt2.keras")
    first.save(path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    messages = " ".join(str(w.message) for w in caught)
    assert "`compile()` was not called as part of model loading" in messages
    assert "Skipping variable loading for optimizer" in messages
    # keras-hub's default optimizer (CausalLM: Adam(2e-5)), not built: the saved state is not in it.
    assert isinstance(loaded.optimizer, keras.optimizers.Adam) and not loaded.optimizer.built
    assert not isinstance(loaded.optimizer, (AccumulatingOptimizer, keras.optimizers.AdamW))
    assert_bitwise_equal(first.get_weights(), loaded.get_weights(), "model weights")

    loaded.compile(optimizer=resumable_optimizer(), loss=CountedLoss(token_mean()), weighted_metrics=[])
    loaded.load_weights(path)
    assert int(ops.convert_to_numpy(loaded.optimizer.mini_step)) == 2
    assert_bitwise_equal(numpy(first.optimizer.variables), numpy(loaded.optimizer.variables), "optimizer state")
    rest = lambda a: np.concatenate([a[head.stop:], a])  # noqa: E731
    loaded.fit({k: rest(v) for k, v in x.items()}, rest(y), sample_weight=rest(sample_weight), batch_size=B,
               epochs=1, shuffle=False, verbose=0)
    straight = gpt2_runs("accumulated, CountedLoss")
    assert int(ops.convert_to_numpy(loaded.optimizer.micro_steps)) == N * UPDATES_PER_EPOCH * EPOCHS
    assert_bitwise_equal(straight.get_weights(), loaded.get_weights(), "weights")
    assert_bitwise_equal(numpy(straight.optimizer.variables), numpy(loaded.optimizer.variables), "state")
