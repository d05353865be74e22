"""`class Mine(accum_optimizer.AccumulatingOptimizer)`: the public class is
subclassable for Keras 3 users (issue 16, item 4).

A subclass of the public, dispatching class is a subclass of the Keras 3
family's class (where `tf.keras` is Keras 3), so Keras' serialization
registers it and `get_config`/`load_model` rebuild it. References: the family
class itself, trained on the same data (bitwise), and the dispatch of the
public class, which a subclass must leave unchanged.
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras  # noqa: E402
import numpy as np  # noqa: E402

import accum_optimizer  # noqa: E402
from accum_optimizer.families import keras3 as keras3_family  # noqa: E402


@keras.saving.register_keras_serializable(package="test_subclass")
class CountingAccumulator(accum_optimizer.AccumulatingOptimizer):
    """Counts its micro-steps in Python (eagerly: one call per micro-step)."""

    def apply(self, grads, trainable_variables=None, weight=None):
        self.__dict__["python_calls"] = self.__dict__.get("python_calls", 0) + 1
        return super().apply(grads, trainable_variables, weight)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _data(n=24):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def _fit(opt, epochs=1, model=None):
    model = model or _model()
    model.compile(opt, "mse", run_eagerly=True)
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)
    return model


def test_subclass_is_the_keras3_family_class_and_an_accumulating_optimizer():
    assert issubclass(CountingAccumulator, keras3_family.AccumulatingOptimizer)
    assert issubclass(CountingAccumulator, keras.optimizers.Optimizer)
    assert issubclass(CountingAccumulator, accum_optimizer.AccumulatingOptimizer)
    opt = CountingAccumulator(keras.optimizers.Adam(1e-2), 3)
    assert type(opt) is CountingAccumulator
    assert isinstance(opt, accum_optimizer.AccumulatingOptimizer)
    assert CountingAccumulator.__doc__.startswith("Counts its micro-steps")


def test_the_public_class_still_dispatches_to_the_family_class():
    opt = accum_optimizer.AccumulatingOptimizer(keras.optimizers.Adam(1e-2), 3)
    assert type(opt) is keras3_family.AccumulatingOptimizer


def test_subclass_hook_runs_each_micro_step_and_trains_bitwise_like_the_family_class():
    mine = CountingAccumulator(keras.optimizers.Adam(1e-2, use_ema=True), 3)
    trained = _fit(mine)
    plain = _fit(keras3_family.AccumulatingOptimizer(keras.optimizers.Adam(1e-2, use_ema=True), 3))
    assert mine.python_calls == 6 == int(mine.micro_steps.numpy())
    assert int(mine.iterations.numpy()) == 2
    for a, b in zip(trained.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_registered_subclass_round_trips_through_config_and_a_keras_file(tmp_path):
    mine = CountingAccumulator(keras.optimizers.Adam(1e-2), {0: 2, 2: 3}, reduction="sum")
    again = CountingAccumulator.from_config(mine.get_config())
    assert type(again) is CountingAccumulator
    assert again.gradient_accumulation_steps == {0: 2, 2: 3} and again.reduction == "sum"

    model = _fit(CountingAccumulator(keras.optimizers.Adam(1e-2), 4))  # 6 micro-steps: mid-window
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is CountingAccumulator
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
