"""One worker of the multi-worker tests (``tests/keras3/test_multiworker.py``).

Started by :class:`support.cluster.Cluster` with a ``TF_CONFIG`` naming
two workers on ``127.0.0.1``; each worker has one CPU device, so the
``MultiWorkerMirroredStrategy`` has 2 replicas, one per process. One launch
runs several scenarios in a row (each worker imports TensorFlow once) and
writes ``<out>/<scenario>.worker<i>.json``: final weights, inner-optimizer
variables, counters and the collective all-reduces counted per step. The
test process compares them with its own single-process reference.

    python tests/support/multiworker_worker.py --out DIR --scenarios fit_acc_adam,custom_plain_sgd,...

The preemption runs (``--uninterrupted``, ``--replay``, ``--resume``,
``--start``; ``multiworker_setup.PREEMPT_RUNS``) train with ``model.fit``
and ``BackupAndRestore``; ``--strategy mirrored`` runs them in one process
with ``MirroredStrategy`` over 2 logical CPUs instead. See
``tests/keras3/test_multiworker.py``.

Setting (shared with the test through :mod:`multiworker_setup`): global
micro-batch ``B`` (``B / 2`` per worker), ``N`` micro-steps per update.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/support
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # tests/: the support package
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from support import multiworker_setup as S  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from support.families import available  # noqa: E402

keras = S.keras  # Keras 3, or tf.keras where it is Keras 2 (the Keras 2 families' runs)

from accum_optimizer import AccumulatingOptimizer  # noqa: E402
from multiworker import keras_fit_workaround  # noqa: E402  (examples/multiworker.py)
from support.cluster import run_worker  # noqa: E402
from support.collectives import CollectiveCounter, deltas  # noqa: E402
from support.reference import make_data, make_mlp  # noqa: E402


# ------------------------------------------------------------- training
def per_example_loss(y, p):
    return tf.reduce_mean(tf.square(y - p), axis=-1)


def custom_loop(strategy, counter, optimizer_fn, accumulate: bool, steps: int, data_seed: int,
                eager: bool = False):
    """``strategy.run`` loop; each worker reads its shard of the data
    (``distribute_datasets_from_function``); the loss is
    ``compute_average_loss(global_batch_size=B)``: B is the global MICRO-batch
    (the wrapper's ``reduction="mean"`` divides by N itself)."""
    x, y = make_data(steps * S.B, seed=data_seed)
    with strategy.scope():
        model = make_mlp(seed=0)
        inner = optimizer_fn()
        opt = AccumulatingOptimizer(inner, S.N) if accumulate else inner
        if hasattr(opt, "build"):  # (a plain legacy OptimizerV2 builds on its first step)
            opt.build(model.trainable_variables)

    def dataset_fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(S.B))

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_loss(yb, model(xb, training=True)),
                                              global_batch_size=S.B)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def train_step(batch):
        strategy.run(step_fn, args=batch)

    if not eager:
        train_step = tf.function(train_step)
    snaps = [counter.read()]
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        train_step(batch)
        snaps.append(counter.read())
    return model, opt, {"per_step": deltas(snaps)}


class CountPerBatch(keras.callbacks.Callback):
    def __init__(self, counter):
        super().__init__()
        self.counter, self.snaps = counter, []

    def on_train_begin(self, logs=None):
        self.snaps = [self.counter.read()]

    def on_train_batch_end(self, batch, logs=None):
        self.snaps.append(self.counter.read())


def fit(strategy, counter, optimizer_fn, accumulate: bool, steps: int, data_seed: int, epochs: int = 1):
    """``model.fit`` on the global dataset batched by the global micro-batch
    ``B``; ``tf.data`` auto-sharding gives each worker its half."""
    x, y = make_data(steps * S.B, seed=data_seed)
    with strategy.scope():
        model = make_mlp(seed=0)
        inner = optimizer_fn()
        opt = AccumulatingOptimizer(inner, S.N) if accumulate else inner
        model.compile(optimizer=opt, loss="mse")
    count = CountPerBatch(counter)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(S.B), epochs=epochs, verbose=0,
              callbacks=[count])
    return model, opt, {"per_step": deltas(count.snaps)}


def summary(model, opt, extra: dict) -> dict:
    accumulating = isinstance(opt, AccumulatingOptimizer)
    inner = opt.inner_optimizer if accumulating else opt
    variables = inner.weights if callable(getattr(type(inner), "variables", None)) else list(inner.variables)
    out = {
        "weights": [v.numpy().tolist() for v in model.weights],
        "inner_variables": [v.numpy().tolist() for v in variables],
        "inner_variable_paths": [getattr(v, "path", None) or v.name for v in variables],
        "iterations": int(inner.iterations.numpy()),
        "num_params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        **extra,
    }
    if accumulating:
        out["micro_steps"] = int(opt.micro_steps.numpy())
    return out


# ------------------------------------------------------------- scenarios
LOOPS = {
    "custom": custom_loop,
    "eager": lambda *args, **kw: custom_loop(*args, **kw, eager=True),  # strategy.run, no tf.function
    "fit": fit,
}


def run_scenario(strategy, counter, name: str) -> dict:
    """``<loop>_<variant>_<optimizer>``, e.g. ``fit_acc_adamw``:

    * loop: ``custom`` (``strategy.run`` in a ``tf.function``), ``eager``
      (``strategy.run`` eagerly), ``fit``;
    * variant: ``acc`` (``AccumulatingOptimizer(inner, N)``), ``plain`` (the
      inner optimizer alone: N separate steps per window), ``builtin``
      (Keras' ``gradient_accumulation_steps=N``; the error is recorded if it
      raises), ``nomerge`` (``acc`` on tf.distribute's no-merge-call path,
      which TF takes with XLA on GPUs, forced here as TF's own
      ``strategy_combinations`` do: ``extended._use_merge_call = lambda: False``).

    Every run takes ``N * WINDOWS`` micro-batches of the global batch ``B``.
    """
    loop, variant, opt_name = name.split("_")
    run = LOOPS[loop]
    optimizer_fn = {**S.OPTIMIZERS, **S.LEGACY_OPTIMIZERS}[opt_name]
    steps, seed = S.N * S.WINDOWS, S.DATA_SEED[loop]
    if variant == "builtin":
        def builtin_fn():
            opt = optimizer_fn()
            return opt.__class__.from_config({**opt.get_config(), "gradient_accumulation_steps": S.N})
        try:
            # Not an AccumulatingOptimizer: accumulate=False hands it over as is.
            model, opt, extra = run(strategy, counter, builtin_fn, False, steps, seed)
        except Exception as e:  # record what Keras raises
            return {"runs": False, "error": f"{type(e).__name__}: {_first_line(e)}"}
        return {"runs": True, **summary(model, opt, extra)}
    if variant == "nomerge":
        strategy.extended._use_merge_call = lambda: False
        try:
            model, opt, extra = run(strategy, counter, optimizer_fn, True, steps, seed)
        finally:
            del strategy.extended._use_merge_call
        return summary(model, opt, extra)
    model, opt, extra = run(strategy, counter, optimizer_fn, variant == "acc", steps, seed)
    return summary(model, opt, extra)


def _first_line(e: Exception) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # no terminal colours
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    # TF's errors start with "in user code:" and a traceback; keep the message.
    keep = [l for l in lines if "Error" in l or "merge_call" in l] or lines
    return keep[-1][:400] if keep else ""


def run_scenarios(strategy, counter, names: list[str], out: Path, index: int) -> None:
    for name in names:
        t0 = time.perf_counter()
        result = run_scenario(strategy, counter, name)
        result["seconds"] = time.perf_counter() - t0
        (out / f"{name}.worker{index}.json").write_text(json.dumps(result))
        print(f"[worker {index}] {name}: {result['seconds']:.1f} s", flush=True)


# ------------------------------------------------------------- preemption
class Interrupted(Exception):
    pass


class Preempt(keras.callbacks.Callback):
    """After the backup at ``kill``: write ``<out>/<run>.backed_up.worker<i>``;
    then the victim waits to be SIGKILLed by the launcher (``mode="kill"``),
    or every worker raises :class:`Interrupted` (``mode="raise"``: an
    interruption in the process, for plain Keras' reference behaviour)."""

    def __init__(self, run, kill, out: Path, index: int, victim: bool, mode: str = "kill"):
        super().__init__()
        self.run, self.kill, self.out, self.index, self.victim = run, kill, out, index, victim
        self.mode = mode
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _backed_up(self):
        (self.out / f"{self.run}.backed_up.worker{self.index}").write_text(
            json.dumps({"micro_steps": _micro_steps(self.model.optimizer),
                        "iterations": int(self.model.optimizer.iterations.numpy())}))
        if self.mode == "raise":
            raise Interrupted(self.run)
        if self.victim:
            while True:  # until the launcher's SIGKILL
                time.sleep(1)

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == tuple(self.kill):
            self._backed_up()

    def on_epoch_end(self, epoch, logs=None):
        if (epoch, "end") == tuple(self.kill):
            self._backed_up()


class RecordRestore(keras.callbacks.Callback):
    """What BackupAndRestore restored (runs after it in on_train_begin)."""

    def __init__(self):
        super().__init__()
        self.restored, self.first_batches = None, []
        self._epoch = None

    def on_train_begin(self, logs=None):
        opt = self.model.optimizer
        self.restored = {"micro_steps": _micro_steps(opt), "iterations": int(opt.iterations.numpy()),
                         "initial_epoch": self.model._initial_epoch}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if len(self.first_batches) < 1:
            self.first_batches.append([self._epoch, batch])


def _micro_steps(opt):
    return int(opt.micro_steps.numpy()) if isinstance(opt, AccumulatingOptimizer) else None


def preempt_fit(strategy, run: str, out: Path, index: int, kill: bool, victim: bool = False,
                mode: str = "kill") -> dict | None:
    """``model.fit`` with ``BackupAndRestore`` (one backup directory per
    worker: Keras 3 writes the backup from every worker). ``kill``: stop after
    the run's backup point and wait for SIGKILL; otherwise train to the end
    (resuming from the backup if there is one)."""
    cfg = S.PREEMPT_RUNS[run]
    x, y = make_data(S.STEPS_PER_EPOCH * S.B, seed=S.PREEMPT_DATA_SEED)
    with strategy.scope():
        model = make_mlp(seed=0)
        inner = S.OPTIMIZERS[S.PREEMPT_OPTIMIZER]()
        opt = AccumulatingOptimizer(inner, S.N) if cfg["accumulate"] else inner
        model.compile(optimizer=opt, loss="mse")
    backup = keras.callbacks.BackupAndRestore(str(out / "backup" / run / f"worker{index}"),
                                              save_freq=cfg["save_freq"])
    record = RecordRestore()
    callbacks = [backup, record]
    if kill:
        callbacks.append(Preempt(run, cfg["kill"], out, index, victim=victim, mode=mode))
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(S.B), epochs=S.PREEMPT_EPOCHS,
              verbose=0, callbacks=callbacks)
    result = summary(model, opt, {"restored": record.restored, "first_batch": record.first_batches[0]})
    if isinstance(opt, AccumulatingOptimizer):
        # Read in cross-replica context an ON_READ slot is the sum over all
        # replicas (a collective under MWMS: every worker reads).
        result["acc_grads_sum"] = [v.numpy().tolist() for v in opt.acc_grads]
    return result


def parameter_server_check(out: Path) -> None:
    """Build a ``ParameterServerStrategy`` over an in-process cluster (one
    worker and one parameter server, gRPC servers on 127.0.0.1, this process
    the coordinator) and record whether ``AccumulatingOptimizer`` refuses it,
    at construction under the scope and at build under it."""
    from support.cluster import free_ports

    ports = free_ports(3)
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
                                 "chief": [f"127.0.0.1:{ports[2]}"]})
    servers = [tf.distribute.Server(spec, job_name=job, task_index=0, protocol="grpc", start=True)
               for job in ("worker", "ps")]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0,
                                                                    rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    result = {"strategy": type(strategy).__name__, "servers": len(servers)}
    # Keras 3, or Keras 2's new API; and, where tf.keras is Keras 2, its
    # legacy OptimizerV2 (results "legacy_construction", "legacy_build").
    inners = {"": keras.optimizers.Adam}
    if not available("keras3"):
        inners["legacy_"] = keras.optimizers.legacy.Adam
    with strategy.scope():
        model = make_mlp(seed=0)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")  # plain Keras accepts it
    for prefix, inner in inners.items():
        with strategy.scope():
            try:
                AccumulatingOptimizer(inner(1e-2), S.N)
                result[prefix + "construction"] = None
            except ValueError as e:
                result[prefix + "construction"] = str(e)
        opt = AccumulatingOptimizer(inner(1e-2), S.N)  # outside the scope: fine
        with strategy.scope():
            try:
                opt.build(model.trainable_variables)
                result[prefix + "build"] = None
            except ValueError as e:
                result[prefix + "build"] = str(e)
    (out / "parameter_server.json").write_text(json.dumps(result))


def make_strategy(kind: str):
    if kind == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        if available("keras3"):  # (Keras 2's fit runs under MWMS as it is)
            keras_fit_workaround(strategy)
        assert len(strategy.extended.worker_devices) == 1
        return strategy, strategy.cluster_resolver.task_id
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * S.WORKERS)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(S.WORKERS)]), 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--strategy", choices=("mwms", "mirrored"), default="mwms")
    parser.add_argument("--scenarios", default="", help="comma list, run first (mwms)")
    parser.add_argument("--uninterrupted", default="", help="comma list of preemption runs to train without a kill")
    parser.add_argument("--replay", default="",
                        help="comma list of preemption runs to interrupt (an exception after the backup) "
                             "and resume in this process, with a new model and optimizer")
    parser.add_argument("--resume", default=None, help="preemption run to restart and finish")
    parser.add_argument("--parameter-server", action="store_true",
                        help="check that ParameterServerStrategy is refused (after the runs above; one process)")
    parser.add_argument("--start", default=None, help="preemption run to start; stops for SIGKILL")
    args = parser.parse_args()
    if not (args.scenarios or args.uninterrupted or args.replay or args.resume or args.start):
        if args.parameter_server:
            parameter_server_check(args.out)
        return 0
    strategy, index = make_strategy(args.strategy)
    assert strategy.num_replicas_in_sync == S.WORKERS, strategy.num_replicas_in_sync
    if args.scenarios:
        run_scenarios(strategy, CollectiveCounter(), args.scenarios.split(","), args.out, index)
    for run in filter(None, args.uninterrupted.split(",")):
        result = preempt_fit(strategy, run, args.out / "uninterrupted", index, kill=False)
        (args.out / f"uninterrupted_{run}.worker{index}.json").write_text(json.dumps(result))
    for run in filter(None, args.replay.split(",")):
        try:
            preempt_fit(strategy, run, args.out, index, kill=True, mode="raise")
            raise AssertionError("the interrupted run finished")
        except Interrupted:
            pass
        result = preempt_fit(strategy, run, args.out, index, kill=False)
        (args.out / f"preempt_{run}.worker{index}.json").write_text(json.dumps(result))
    if args.resume:
        result = preempt_fit(strategy, args.resume, args.out, index, kill=False)
        (args.out / f"preempt_{args.resume}.worker{index}.json").write_text(json.dumps(result))
    if args.parameter_server:
        parameter_server_check(args.out)
    if args.start:
        # Under MWMS worker VICTIM is SIGKILLed (the other one is stopped
        # after it); on one host the only process is.
        victim = index == S.VICTIM or args.strategy == "mirrored"
        preempt_fit(strategy, args.start, args.out, index, kill=True, victim=victim)
        raise AssertionError("a preempted run must not finish")
    return 0


if __name__ == "__main__":
    run_worker(main)
