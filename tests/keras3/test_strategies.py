"""Which ``tf.distribute`` path each strategy takes, in this process
(``conftest.py`` splits the CPU into 2 logical devices).

* The no-merge-call path: TensorFlow runs ``MirroredStrategy`` and
  ``MultiWorkerMirroredStrategy`` without ``merge_call`` when the step is
  compiled with XLA and every device is a GPU
  (``tf.__internal__.distribute.strategy_supports_no_merge_call()``). It is
  forced here on CPUs the way TensorFlow's own tests force it
  (``strategy_combinations._mirrored_strategy_with_no_merge_call``:
  ``extended._use_merge_call = lambda: False``). The wrapper must still
  train like the large batch and reduce once per update. (Running the
  micro-step in each replica directly, as an earlier version did on that
  path, raised: the update ``cond`` then held ``merge_call``s.)
* ``CentralStorageStrategy`` is refused: it shares one copy of each
  variable between the replicas, which double-counts the window (measured
  before the refusal: exactly the update of twice the learning rate).
  ``ParameterServerStrategy`` needs a cluster: ``test_multiworker.py``.
* A partial window restored from a backup under ``MirroredStrategy`` is
  split evenly between the replicas (``sum / R`` each), and
  ``OneDeviceStrategy`` trains like the large batch.
"""


from __future__ import annotations
from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_optimizer import AccumulatingOptimizer
from support.reference import make_data, make_mlp, max_abs_diff, mse, train, weights

N, B, WINDOWS, REPLICAS, TOL = 4, 8, 3, 2, 1e-5


@pytest.fixture
def no_merge_call_strategy(strategy, monkeypatch):
    """The session's 2-replica MirroredStrategy (``conftest.py``: a second
    strategy over the same devices would share its collective keys), on the
    no-merge-call path for the test."""
    monkeypatch.setattr(strategy.extended, "_use_merge_call", lambda: False, raising=False)
    return strategy


@pytest.fixture
def replica_all_reduces(monkeypatch):
    """Executions (not traces) of ``ReplicaContext.all_reduce``, which Keras'
    optimizers call in each replica to all-reduce the gradients: one count
    per replica per reduction."""
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(*args, **kwargs):
        counter.assign_add(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", counting)
    return counter


def test_no_merge_call_custom_loop_matches_single_device_large_batch(no_merge_call_strategy, replica_all_reduces):
    strategy = no_merge_call_strategy
    x, y = make_data(N * B * WINDOWS, seed=4)
    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=N)
        opt.build(model.trainable_variables)
    paths = []

    def step_fn(xb, yb):
        paths.append(tf.__internal__.distribute.strategy_supports_no_merge_call())
        with tf.GradientTape() as tape:
            loss = mse(yb, model(xb, training=True)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(batch):
        strategy.run(step_fn, args=batch)

    counts = []
    for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(B)):
        train_step(batch)
        counts.append(int(replica_all_reduces.numpy()))
    assert paths and all(paths)  # traced on the no-merge-call path

    ref_model, ref_opt = make_mlp(seed=0), keras.optimizers.Adam(1e-2)
    train(ref_model, ref_opt, x, y, N * B, WINDOWS)
    assert int(opt.micro_steps.numpy()) == N * WINDOWS
    assert int(opt.iterations.numpy()) == WINDOWS
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL
    assert max_abs_diff(weights(opt.inner_optimizer.variables), weights(ref_opt.variables)) <= TOL
    # One reduction per update (counted in each replica), none in between.
    assert counts == [REPLICAS * ((k + 1) // N) for k in range(N * WINDOWS)]


def test_no_merge_call_fit_matches_single_device_large_batch(no_merge_call_strategy, replica_all_reduces):
    strategy = no_merge_call_strategy
    x, y = make_data(N * B * WINDOWS, seed=5)
    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=N)
        model.compile(optimizer=opt, loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)
    assert int(replica_all_reduces.numpy()) == REPLICAS * WINDOWS

    ref_model = make_mlp(seed=0)
    ref_model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref_model.fit(x, y, batch_size=N * B, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == WINDOWS
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL


def test_central_storage_strategy_is_refused():
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    match = r"does not support CentralStorageStrategy.*replica-local.*MirroredStrategy"
    with strategy.scope():
        with pytest.raises(ValueError, match=match):
            AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=N)
        model = make_mlp(seed=0)
    # Created outside the scope, built under it (model.compile, a custom
    # loop's opt.build): refused at build.
    opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=N)
    with strategy.scope():
        with pytest.raises(ValueError, match=match):
            opt.build(model.trainable_variables)
    # The pass-through (N = 1) is the inner optimizer: not refused.
    with strategy.scope():
        AccumulatingOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=1)


def test_restored_partial_window_is_split_evenly_between_replicas(strategy, tmp_path):
    """A partial window in a backup, restored under ``MirroredStrategy``:
    TensorFlow saves a replica-local (``ON_READ``) accumulator as its sum over
    the replicas and restores ``sum / R`` into each replica, so the window's
    all-reduce still counts the saved micro-batches once. The epoch has 6
    micro-batches (N = 4): the backup at its end holds 2 of a window. The
    resumed run equals the uninterrupted one up to float rounding -- not bit
    for bit, because the sum is regrouped (on one device it is bitwise)."""
    steps_per_epoch, epochs = 6, 2
    x, y = make_data(steps_per_epoch * B, seed=6)

    class Stop(Exception):
        pass

    class StopAfterEpoch0(keras.callbacks.Callback):
        # After BackupAndRestore's backup (it comes first in the list).
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                # Read in cross-replica context: the sum over the replicas,
                # which is what the backup holds.
                self.saved = [a.numpy() for a in self.model.optimizer.acc_grads]
                raise Stop()

    class Restored(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            opt = self.model.optimizer
            self.components = [[c.numpy() for c in a.value.values] for a in opt.acc_grads]
            self.micro_steps = int(opt.micro_steps.numpy())

    def run(backup, callbacks):
        with strategy.scope():
            model = make_mlp(seed=0)
            opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=N)
            model.compile(optimizer=opt, loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=epochs, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(backup), save_freq="epoch",
                                                              delete_checkpoint=False), *callbacks])
        return model, opt

    uninterrupted, _ = run(tmp_path / "u", [])
    stop = StopAfterEpoch0()
    with pytest.raises(Stop):
        run(tmp_path / "r", [stop])
    restored = Restored()
    resumed, opt = run(tmp_path / "r", [restored])

    assert restored.micro_steps == steps_per_epoch  # 6 = one update + 2 micro-batches
    for components, saved in zip(restored.components, stop.saved):
        assert len(components) == REPLICAS
        assert np.max(np.abs(saved)) > 0  # the partial window is there
        for c in components:
            np.testing.assert_array_equal(c, saved / REPLICAS)
    assert int(opt.micro_steps.numpy()) == steps_per_epoch * epochs
    assert max_abs_diff(weights(resumed), weights(uninterrupted)) <= TOL
    assert max_abs_diff(weights(resumed), weights(make_mlp(seed=0))) > 1e-2


def test_one_device_strategy_matches_single_device_large_batch():
    """``OneDeviceStrategy`` is a strategy too (``has_strategy()``): the
    micro-step goes through the same one ``merge_call``, with one replica."""
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    x, y = make_data(N * B * WINDOWS, seed=5)
    with strategy.scope():
        model = make_mlp(seed=0)
        opt = AccumulatingOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), gradient_accumulation_steps=N)
        model.compile(optimizer=opt, loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)
    ref_model = make_mlp(seed=0)
    ref_model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref_model.fit(x, y, batch_size=N * B, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations.numpy()) == WINDOWS
    assert max_abs_diff(weights(model), weights(ref_model)) <= TOL
