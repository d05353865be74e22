"""One process of the JAX multi-process test (``tests/backends/test_jax_multiprocess.py``).

Started twice at once (``--process-id 0`` and ``1``) by
:class:`jax_multiprocess_setup.Processes`, with two CPU devices each
(``XLA_FLAGS``): JAX's distributed runtime with process 0 the coordinator
on ``127.0.0.1:PORT``, gloo for the CPU collectives, and
``keras.distribution.DataParallel(auto_shard_dataset=False)`` over the four
devices. Each process feeds ``fit`` its own share of every global
micro-batch (``fit``'s ``batch_size`` is per process under JAX's
multi-process runtime), so every micro-step trains on the global
micro-batch ``B``.

    python tests/support/jax_multiprocess_worker.py --out DIR --run uninterrupted,start --process-id I --port P

Runs, in order, each writing ``<out>/<run>.process<i>.json`` (weights,
optimizer variables, counters):

``uninterrupted``
    ``fit`` over all ``MICRO_STEPS`` micro-batches.
``start``
    the same ``fit``, but after ``SAVE_AFTER`` micro-steps (mid-window)
    ``model.save_weights`` to ``<out>/ckpt/process<i>.weights.h5`` and
    ``<out>/saved.process<i>`` (the saved counters) are written, then the
    process waits for the launcher's SIGKILL.
``resume``
    a new model and optimizer, compiled, ``model.load_weights`` of that
    file, then ``fit`` over the micro-batches after ``SAVE_AFTER``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/support
sys.path.insert(0, str(HERE.parent))  # tests/: the support package
sys.path.insert(0, str(HERE.parents[1]))  # the repository: accum_optimizer

from support import jax_multiprocess_setup as S  # noqa: E402
from support.cluster import run_worker  # noqa: E402


def start_runtime(process_id: int, port: int):
    """JAX's distributed runtime, before any JAX computation; returns Keras."""
    import jax

    # Cross-process collectives on CPU devices: without gloo (or mpi) a
    # computation over several processes' CPU devices fails.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(job_addresses=f"{S.LOOPBACK}:{port}", num_processes=S.PROCESSES,
                                  process_id=process_id)
    assert jax.process_count() == S.PROCESSES and jax.process_index() == process_id
    assert jax.local_device_count() == S.DEVICES_PER_PROCESS, jax.local_devices()
    assert jax.device_count() == S.PROCESSES * S.DEVICES_PER_PROCESS, jax.devices()
    # Every device of every process, the batch split over all of them; the
    # data is already split between the processes (each feeds its share).
    keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
    return keras


def make_model(keras):
    """The model and its wrapped optimizer, compiled (set_distribution first:
    variables and optimizer state take its layouts)."""
    from accum_optimizer import AccumulatingOptimizer

    model = S.make_mlp(keras)
    optimizer = AccumulatingOptimizer(S.make_inner(keras), gradient_accumulation_steps=S.N)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def summary(keras, model) -> dict:
    import jax
    import numpy as np

    opt = model.optimizer
    return {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "batch_axis_devices": int(np.prod(keras.distribution.distribution().device_mesh.shape)),
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "optimizer_paths": [v.path for v in opt.variables],
        "optimizer_variables": [keras.ops.convert_to_numpy(v).tolist() for v in opt.variables],
        "micro_steps": int(keras.ops.convert_to_numpy(opt.micro_steps)),
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
    }


def write(path: Path, result: dict) -> None:
    """Whole or not at all: the launcher SIGKILLs the process as soon as
    ``saved.process<i>`` exists, so the file appears by a rename once written."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result))
    os.replace(part, path)


def fit(keras, model, process_id: int, first: int = 0, callbacks=()) -> None:
    """``fit`` on this process's share of micro-batches ``first`` onward,
    ``B / PROCESSES`` rows a step (per process), in order."""
    x, y = (S.process_share(a, process_id) for a in S.data())
    per = S.B // S.PROCESSES
    model.fit(x[first * per:], y[first * per:], batch_size=per, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def run(keras, name: str, out: Path, process_id: int) -> None:
    model = make_model(keras)
    if name == "uninterrupted":
        fit(keras, model, process_id)
    elif name == "resume":
        # The documented route (docs/saving.md): load into the compiled
        # model; the load builds the optimizer and restores its state.
        model.load_weights(out / "ckpt" / f"process{process_id}.weights.h5")
        restored = summary(keras, model)
        fit(keras, model, process_id, first=S.SAVE_AFTER)
        result = {**summary(keras, model), "restored": restored}
        write(out / f"resume.process{process_id}.json", result)
        return
    elif name == "start":
        class SaveMidWindowThenWait(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == S.SAVE_AFTER:
                    (out / "ckpt").mkdir(exist_ok=True)
                    self.model.save_weights(out / "ckpt" / f"process{process_id}.weights.h5")
                    saved = summary(keras, self.model)
                    write(out / f"saved.process{process_id}", saved)
                    while True:  # until the launcher's SIGKILL
                        time.sleep(1)

        fit(keras, model, process_id, callbacks=[SaveMidWindowThenWait()])
        raise AssertionError("the interrupted run must not finish")
    else:
        raise ValueError(f"unknown run {name!r}")
    write(out / f"{name}.process{process_id}.json", summary(keras, model))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--run", required=True, help="comma list of: uninterrupted, start, resume")
    parser.add_argument("--process-id", required=True, type=int)
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args()
    t0 = time.perf_counter()
    keras = start_runtime(args.process_id, args.port)
    print(f"[process {args.process_id}] runtime up in {time.perf_counter() - t0:.1f} s", flush=True)
    for name in args.run.split(","):
        t = time.perf_counter()
        run(keras, name, args.out, args.process_id)
        print(f"[process {args.process_id}] {name}: {time.perf_counter() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    run_worker(main)
