"""Gradient accumulation under MultiWorkerMirroredStrategy: custom loop and fit.

    python examples/multiworker.py            # starts 2 workers on 127.0.0.1, trains, compares

Run without ``TF_CONFIG`` it is the launcher: it starts two copies of itself
as workers (``TF_CONFIG`` with free loopback ports, one CPU each) and waits.
Each worker trains the same small model twice with
``AccumulatingOptimizer(Adam, N=4)`` on its shard of the data: once with a
custom loop (``strategy.run``) and once with ``model.fit``, then prints its
weights' checksum; both workers print the same numbers.

On a real cluster, set ``TF_CONFIG`` on each host as usual and run the
worker part (:func:`worker`) there.

``model.fit`` needs :func:`keras_fit_workaround` under
MultiWorkerMirroredStrategy in Keras 3 (keras-team/keras#20585); the custom
loop needs nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

N = 4            # micro-steps per update
B = 8            # GLOBAL micro-batch: B / num_workers samples per worker per micro-step
UPDATES = 5


def keras_fit_workaround(strategy):
    """Let Keras 3's ``model.fit`` run under ``MultiWorkerMirroredStrategy``.

    Keras 3 (3.15 and earlier, keras-team/keras#20585) calls
    ``strategy.reduce`` in two ways that ``MultiWorkerMirroredStrategy``
    rejects, for every optimizer: on the ``(x, y)`` tuple of the first batch
    (``_maybe_symbolic_build``; only single values are accepted) and with
    ``axis=0`` on the scalar losses and metrics of each step
    (``reduce_per_replica``). This wraps ``strategy.reduce`` of THIS strategy
    object so that it reduces each value of a nested structure separately and
    treats ``axis=0`` of a scalar as the plain mean over replicas (what Keras
    means). Nothing in Keras or TensorFlow is modified; call it once, right
    after creating the strategy. Custom loops need no workaround.
    """
    import tensorflow as tf

    reduce = strategy.reduce

    def reduce_each(reduce_op, value, axis=None):
        def one(v):
            local = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
            scalar = getattr(getattr(local, "shape", None), "rank", None) == 0
            return reduce(reduce_op, v, axis=None if scalar else axis)

        return tf.nest.map_structure(one, value)

    strategy.reduce = reduce_each
    return strategy


def worker() -> None:
    import numpy as np
    import tensorflow as tf
    import keras

    from accum_optimizer import AccumulatingOptimizer

    strategy = keras_fit_workaround(tf.distribute.MultiWorkerMirroredStrategy())
    task = strategy.cluster_resolver.task_id
    rng = np.random.default_rng(0)
    x = rng.normal(size=(UPDATES * N * B, 6)).astype("float32")
    y = rng.normal(size=(UPDATES * N * B, 1)).astype("float32")

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])

    # 1. Custom loop. Each worker reads its shard; the loss is averaged over
    # the GLOBAL micro-batch B (not N*B: reduction="mean" divides by N).
    with strategy.scope():
        model = make_model()
        opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=N)
        opt.build(model.trainable_variables)  # build in the scope, before strategy.run

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(B))

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(yb - model(xb, training=True)), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=B)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(batch):
        strategy.run(step_fn, args=batch)

    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        train_step(batch)
    custom = model.get_weights()

    # 2. model.fit: the global dataset, batched by the global micro-batch B;
    # tf.data auto-sharding gives each worker its half of every batch.
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-2), N), loss="mse")
    backup = os.path.join(os.environ.get("EXAMPLE_BACKUP_ROOT", tempfile.gettempdir()), f"worker{task}")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0,
              # One backup directory per worker: Keras 3 writes from every worker.
              callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=3, double_checkpoint=True)])
    fitted = model.get_weights()

    # 3. Reference: one process, no strategy, plain Adam, batch N*B.
    ref = make_model()
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ref.fit(x, y, batch_size=N * B, epochs=1, shuffle=False, verbose=0)
    diff = lambda a, b: max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))  # noqa: E731
    print(f"worker {task}: iterations={int(opt.iterations.numpy())} micro_steps={int(opt.micro_steps.numpy())} "
          f"checksum={sum(float(np.sum(w)) for w in custom):.6f} "
          f"max|custom - reference|={diff(custom, ref.get_weights()):.2e} "
          f"max|fit - reference|={diff(fitted, ref.get_weights()):.2e}", flush=True)


def main() -> int:
    if "TF_CONFIG" in os.environ:
        worker()
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from support.cluster import Cluster  # tests/support/cluster.py: the multi-worker tests' launcher

    with tempfile.TemporaryDirectory() as tmp:
        with Cluster([__file__], Path(tmp), num_workers=2, pythonpath=[str(ROOT)],
                     env={"EXAMPLE_BACKUP_ROOT": tmp}) as cluster:
            try:
                cluster.wait(timeout=600)
            finally:
                for i in range(cluster.num_workers):
                    log = cluster.log_path(i).read_text(errors="replace")
                    print("\n".join(l for l in log.splitlines() if l.startswith("worker ")) or log[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
