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
The training code of each case is ``tests/support/caveats.py``, which
``experiments/caveats.py`` runs at its own sizes to measure them.
"""

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import pytest

from support.caveats import Caveats, gan_data
from support.reference import make_data, max_abs_diff

N, B = 4, 4
EXACT = 1e-6   # float32 rounding over a few Adam updates is ~1e-7
NAIVE = 1e-4   # a different window moves weights by ~lr = 1e-2
# Eager fits, like every run in this module: no tracing, seconds saved.
CASES = Caveats(n=N, lr=1e-2, hidden=5, run_eagerly=True)
adam, acc = CASES.adam, CASES.acc


# -------------------------------------- 1. several apply_gradients calls
def test_several_apply_gradients_calls_per_batch():
    x, y = make_data(N * B * 3)

    def run(mode, make_opt, batch):
        return CASES.two_part(mode, make_opt, batch, x, y, epochs=1)[0]

    ref = run("one_call", adam, N * B)
    # Each call is a micro-step: the window closes after N/2 batches.
    assert max_abs_diff(run("two_calls", acc, B), ref) > NAIVE
    # Exact: one call with all gradients, or one wrapper per part.
    assert max_abs_diff(run("one_call", acc, B), ref) <= EXACT
    assert max_abs_diff(run("two_optimizers", acc, B), ref) <= EXACT


# ---------------------------------------------- 2. alternating updates (GAN)
def test_alternating_updates_in_one_step():
    data = gan_data(N * B * 3)

    def run(order, make_opt, batch):
        return CASES.gan(order, make_opt, batch, data, epochs=1)[0]

    ref_alternating = run("alternating", adam, N * B)
    # Only the window's last micro-batch sees the new D.
    assert max_abs_diff(run("alternating", acc, B), ref_alternating) > NAIVE
    # Exact: both gradients first (against the large batch trained that way) ...
    assert max_abs_diff(run("simultaneous", acc, B), run("simultaneous", adam, N * B)) <= EXACT
    # ... or the guide's order in two passes over each window.
    assert max_abs_diff(CASES.gan_two_passes(B, data, epochs=1), ref_alternating) <= EXACT


# --------------------------------------------- 3. resuming an interrupted fit
def test_resuming_mid_epoch_is_exact_from_epoch_checkpoints():
    # 6 micro-batches per epoch: epoch 0 ends mid-window, so the restored
    # accumulators matter. Interrupted after 3 micro-batches of epoch 1.
    x, y = make_data(6 * B)
    ref, _ = CASES.uninterrupted(acc, B, x, y, epochs=2)

    # BackupAndRestore(save_freq="epoch"): resumes at the start of epoch 1.
    backup = CASES.resumed(acc, B, x, y, 2, "backup", interrupt=(1, 3), save_freq="epoch")
    assert backup["backup_metadata"]["epoch"] == 1
    assert max_abs_diff(backup["weights"], ref) <= EXACT

    # ModelCheckpoint every epoch, then load_model and fit(initial_epoch=...).
    checkpoint = CASES.resumed(acc, B, x, y, 2, "checkpoint", interrupt=(1, 3))
    assert checkpoint["checkpoints"] == ["epoch1.keras"] and checkpoint["checkpoint_epochs_done"] == 1
    assert max_abs_diff(checkpoint["weights"], ref) <= EXACT


# ------------------------------------------------ 4. numpy fit, ragged end
def test_numpy_fit_needs_len_a_multiple_of_n_times_b():
    def run(make_opt, batch, x, y):
        return CASES.fit_numpy(make_opt, batch, x, y, epochs=2)[0]

    x, y = make_data(50)  # 13 micro-batches of B per epoch, the last of 2 samples
    ref = run(adam, N * B, x, y)
    # The small last micro-batch counts as a full one, windows straddle epochs.
    assert max_abs_diff(run(acc, B, x, y), ref) > NAIVE
    # Exact: len(x) a multiple of N*B.
    x, y = x[:48], y[:48]
    assert max_abs_diff(run(acc, B, x, y), run(adam, N * B, x, y)) <= EXACT


# ------------------------------------------------- 5. TensorBoard's rates
def test_tensorboard_epoch_steps_per_second_counts_updates(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tf.summary needs the tensorboard package")
    import keras
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
    model, scalars = CASES.tensorboard_fit(acc, B, x, y, epochs, str(tmp_path), callbacks=[Tick()])
    # Epoch level: updates per second (iterations is the wrapper's update count).
    assert scalars["epoch_steps_per_second"] == [(e, 1.0 / N) for e in range(epochs)]
    assert int(model.optimizer.iterations) * N == int(model.optimizer.micro_steps) == micro_per_epoch * epochs
    # Batch level: one summary per micro-step, at micro-step numbers, 1 micro-step/s.
    assert scalars["batch_steps_per_second"] == [(s, 1.0) for s in range(1, micro_per_epoch * epochs + 1)]
