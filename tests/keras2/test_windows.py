"""Keras 2 new API: weighted windows, flush, accumulation schedules (issue 9).

Each check (tests/windows_keras2.py) compares against the plain inner
optimizer on the large batch the window stands for, or hand-computed SGD
values; see that module for the references and tolerances. The Keras 2
specifics here: the ``.keras`` store layout of state saved without the
window's variables (``load_own_variables``).
"""

from support.families import require

require("keras2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from support import windows_keras2 as W  # noqa: E402

o = tf.keras.optimizers


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


@pytest.mark.parametrize("fmt", ["checkpoint", "weights", "store"])
def test_resume_mid_window_after_a_flush_is_exact(fmt, tmp_path):
    W.check_resume_after_a_flush_is_exact(o, *_saver(fmt, tmp_path))


@pytest.mark.parametrize("fmt", ["weights", "store"])
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

    # "store": save_own_variables/load_own_variables, what the .keras and
    # .weights.h5 formats call.
    def save(model, opt):
        store = {}
        opt.save_own_variables(store)
        if drop_window:
            store = {str(i): store[str(i)] for i in range(len(store) - 2)}
        return model.get_weights(), store

    def restore(model, opt, saved):
        model.set_weights(saved[0])
        opt.load_own_variables(saved[1])

    return save, restore


def test_weighted_windows_and_flush_under_mirrored_strategy_equal_the_single_device_large_batch(strategy):
    W.check_weighted_windows_and_flush_under_mirrored_strategy(o, strategy)
