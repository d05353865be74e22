"""Legacy OptimizerV2 (and tensorflow-addons): weighted windows, flush, accumulation schedules (issue 9).

Each check (tests/windows_keras2.py) compares against the plain inner
optimizer on the large batch the window stands for, or hand-computed SGD
values; see that module for the references and tolerances. Legacy
specifics here: ``get_weights``/``set_weights`` (what Keras 2's ``.h5``
format stores) of state saved without the window's variables, and a
tensorflow-addons optimizer (LazyAdam) on sparse gradients with a weighted
flush, where the tfa package is installed.
"""

from support.families import require

require("legacy")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import windows_keras2 as W  # noqa: E402

o = tf.keras.optimizers.legacy


def test_unequal_micro_batches_with_sample_counts_equal_their_concatenation():
    W.check_unequal_micro_batches_equal_their_concatenation(o)


def test_sum_reduction_multiplies_each_micro_gradient_by_its_weight():
    W.check_sum_reduction_multiplies_each_micro_gradient(o)


def test_flush_normalises_by_what_the_window_holds_eagerly_and_in_tf_function():
    W.check_flush_normalises_by_what_the_window_holds(o)


def test_flush_before_any_step_and_on_an_empty_window_is_a_no_op():
    W.check_flush_before_any_step_is_a_no_op(o)


def test_window_of_zero_counts_applies_nothing():
    W.check_window_of_zero_counts_applies_nothing(o)


def test_dict_schedule_equals_growing_large_batches():
    W.check_dict_schedule_equals_growing_large_batches(o)


def test_callable_schedule_receives_the_update_index():
    W.check_callable_schedule_receives_the_update_index(o)


def test_schedule_config_round_trips_through_json():
    W.check_schedule_config_round_trips(o)


@pytest.mark.parametrize("bad, error, words", W.BAD_SCHEDULES)
def test_bad_schedule_gets_a_clear_error(bad, error, words):
    W.check_bad_schedule_gets_a_clear_error(o, bad, error, words)


@pytest.mark.parametrize("fmt", ["checkpoint", "weights"])
def test_resume_mid_window_after_a_flush_is_exact(fmt, tmp_path):
    W.check_resume_after_a_flush_is_exact(o, *_saver(fmt, tmp_path))


@pytest.mark.parametrize("fmt", ["weights"])
def test_state_saved_without_the_window_variables_resumes_at_micro_steps_mod_n(fmt, tmp_path):
    W.check_state_saved_without_the_window_variables_resumes(o, *_saver(fmt, tmp_path, drop_window=True))


@pytest.mark.parametrize("bad, error, words", W.BAD_WEIGHTS)
def test_bad_weight_gets_a_clear_error_and_changes_nothing(bad, error, words):
    W.check_bad_weight_gets_a_clear_error_and_changes_nothing(o, bad, error, words)


def test_negative_weight_inside_tf_function_stops_the_step_before_any_write():
    W.check_negative_weight_in_tf_function_stops_the_step_before_any_write(o)


def _saver(fmt, tmp_path, drop_window=False):
    if fmt == "checkpoint":
        return W.checkpoint_saver(tmp_path)
    if fmt == "weights":
        return W.weights_saver(drop_window)

    raise AssertionError(fmt)


def _lazy_adam():
    tfa = pytest.importorskip("tensorflow_addons", reason="tensorflow-addons: the tf215 leg")
    return tfa.optimizers.LazyAdam(0.05)


@pytest.mark.parametrize("inner_fn", [lambda: o.SGD(0.1, momentum=0.9), _lazy_adam], ids=["sgd_momentum", "lazy_adam"])
def test_sparse_weighted_windows_and_flush_equal_the_large_batches(inner_fn):
    """Embedding (IndexedSlices gradients), micro-batches of 3, 1, 4 (one
    window of N = 3, weights = sample counts) then 2, 2 and a flush: equal
    the plain inner optimizer on batches of 8 and 4, and the rows no sample
    looked up keep their value and slots bitwise (the sparse window reaches
    lazy optimizers as IndexedSlices over the touched rows)."""
    from support.reference_keras2 import OUT, SEQ, embedding_data, embedding_model, mse, weights

    # One trace for every micro-batch size.
    signature = [tf.TensorSpec([None, SEQ], tf.int32), tf.TensorSpec([None, OUT], tf.float32)]

    sizes, windows = [3, 1, 4, 2, 2], [8, 4]
    x, y = embedding_data(sum(sizes), vocab_used=8)
    ref, ref_opt = embedding_model(0), inner_fn()
    model, opt = embedding_model(0), W.AccumulatingOptimizer(inner_fn(), gradient_accumulation_steps=3)

    def grads(m, xs, ys):
        with tf.GradientTape() as tape:
            loss = mse(ys, m(xs, training=True))
        return tape.gradient(loss, m.trainable_variables)

    @tf.function(input_signature=signature)
    def ref_step(xs, ys):
        ref_opt.apply_gradients(zip(grads(ref, xs, ys), ref.trainable_variables))

    @tf.function(input_signature=signature + [tf.TensorSpec([], tf.float32)])
    def step(xs, ys, weight):
        g = grads(model, xs, ys)
        assert isinstance(g[0], tf.IndexedSlices)
        opt.apply_gradients(zip(g, model.trainable_variables), weight=weight)

    start = 0
    for n in windows:
        ref_step(x[start: start + n], y[start: start + n])
        start += n
    start = 0
    for b in sizes:
        step(x[start: start + b], y[start: start + b], tf.constant(float(b)))
        start += b
    opt.flush()
    assert int(opt.iterations.numpy()) == 2 and int(opt.micro_steps.numpy()) == 5
    assert W.max_abs_diff(weights(ref), weights(model)) <= W.TOL
    assert W.max_abs_diff(W.inner_state(ref_opt), W.inner_state(opt)) <= W.TOL
    table = model.trainable_variables[0].numpy()
    np.testing.assert_array_equal(table[8:], embedding_model(0).trainable_variables[0].numpy()[8:])


def test_weighted_windows_and_flush_under_mirrored_strategy_equal_the_single_device_large_batch(strategy):
    W.check_weighted_windows_and_flush_under_mirrored_strategy(o, strategy)
