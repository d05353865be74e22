"""The setting shared by the multi-worker tests and their worker script.

Two workers, one replica (CPU device) each. ``B`` is the GLOBAL micro-batch
(``B / WORKERS`` samples per worker per micro-step); one update sees
``N * B`` samples, so the single-process reference trains with batch
``N * B``.
"""

from support.families import keras_module

keras = keras_module()  # Keras 3, or tf.keras where that is Keras 2 (tf_keras under TF_USE_LEGACY_KERAS=1)

WORKERS = 2
N = 4  # gradient_accumulation_steps
B = 8  # global micro-batch: 4 samples per worker
WINDOWS = 3  # updates per run
TOL = 1e-5
DATA_SEED = {"custom": 4, "eager": 4, "fit": 5}


def _adamw_ema_schedule():
    return keras.optimizers.AdamW(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(2e-2, decay_steps=2, decay_rate=0.5),
        weight_decay=0.05,
        use_ema=True,
        ema_momentum=0.9,
    )


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": _adamw_ema_schedule,
}
# Keras 2's legacy OptimizerV2 (the legacy family), for the Keras 2 scenarios.
LEGACY_OPTIMIZERS = {
    "legacysgd": lambda: keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "legacyadam": lambda: keras.optimizers.legacy.Adam(1e-2),
}


# ------------------------------------------------------------ preemption
# model.fit over EPOCHS epochs of STEPS_PER_EPOCH micro-batches of B, with
# BackupAndRestore; the run is SIGKILLed right after the backup at KILL
# (epoch, batch) -- or after the backup at the end of epoch KILL[0] when the
# batch is "end" -- and restarted.
PREEMPT_DATA_SEED = 6
STEPS_PER_EPOCH = 8  # a multiple of N: epochs end on an update
PREEMPT_EPOCHS = 2
PREEMPT_RUNS = {
    # save_freq=3 is not a multiple of N: backups after batches 2 and 5 of
    # epoch 0 and 0, 3, 6 of epoch 1 (Keras counts batches across epochs);
    # the one after batch 6 of epoch 1 holds micro_steps = 8 + 7 = 15, a
    # partial window of 15 % 4 = 3 micro-batches.
    "plain_mid": dict(accumulate=False, save_freq=3, kill=(1, 6)),
    "acc_mid": dict(accumulate=True, save_freq=3, kill=(1, 6)),
    # A backup at the end of epoch 0: where plain Keras resumes exactly.
    "acc_epoch": dict(accumulate=True, save_freq="epoch", kill=(0, "end")),
}
PREEMPT_OPTIMIZER = "adam"
VICTIM = 1  # the worker that is SIGKILLed (0 on one host: the only process)
