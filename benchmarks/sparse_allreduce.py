"""Reducing a sparse window across replicas: ``IndexedSlices`` or dense?

Under ``MirroredStrategy`` each replica holds its own window of an
``Embedding(V, D)`` table's gradient: ``rows`` touched rows (values summed
per row). The inner optimizer reduces it once per update with
``ReplicaContext.all_reduce(SUM, ...)``. Handed ``tf.IndexedSlices`` (what
the wrapper hands plain SGD), that is a gather of every replica's slices;
densified first, a sum of two ``(V, D)`` tensors. This script times both,
in a traced ``strategy.run`` over 2 logical CPUs (medians over ``--reps``),
with the densification counted in the dense variant (the wrapper would have
to build that tensor), and prints and saves the figures.

    python -m benchmarks.sparse_allreduce                 # V = 10^6, D = 64, 2048 rows per replica
    python -m benchmarks.sparse_allreduce --vocab 100000 --rows 256 --out DIR

Writes ``<out>/sparse_allreduce.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/sparse_allreduce.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"


def measure(vocab: int, dim: int, rows: int, reps: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    # Each replica's window: `rows` distinct rows (sorted, as `touched_rows` gives them).
    per_replica = [np.sort(rng.choice(vocab, rows, replace=False)).astype("int64") for _ in range(2)]
    values = [rng.normal(size=(rows, dim)).astype("float32") for _ in range(2)]

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return tf.constant(per_replica[i]), tf.constant(values[i])

    indices, vals = strategy.experimental_distribute_values_from_function(
        lambda ctx: value_fn(ctx)[0]), strategy.experimental_distribute_values_from_function(
        lambda ctx: value_fn(ctx)[1])
    shape = tf.constant([vocab, dim], tf.int64)

    @tf.function
    def sparse(idx, val):
        def replica(i, v):
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.IndexedSlices(v, i, shape))
            return tf.reduce_sum(reduced.values[:1])
        return strategy.run(replica, args=(idx, val))

    @tf.function
    def dense(idx, val):
        def replica(i, v):
            full = tf.convert_to_tensor(tf.IndexedSlices(v, i, shape))  # the densification
            reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, full)
            return tf.reduce_sum(reduced[:1])
        return strategy.run(replica, args=(idx, val))

    out = {}
    for name, fn in (("indexed_slices", sparse), ("dense", dense)):
        for _ in range(3):
            tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(fn(indices, vals)))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(fn(indices, vals)))
            times.append(time.perf_counter() - t0)
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
    out["ratio_dense_over_slices"] = out["dense"]["median_s"] / out["indexed_slices"]["median_s"]
    out["bytes"] = {"indexed_slices_per_replica": rows * (dim * 4 + 8), "dense_per_replica": vocab * dim * 4}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2048,
                        help="touched rows per replica (default 2048: N=8 micro-batches of 256 ids)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="bench_output")
    args = parser.parse_args(argv)
    res = measure(args.vocab, args.dim, args.rows, args.reps)
    res["settings"] = vars(args)
    import tensorflow as tf

    res["env"] = {"tensorflow": tf.__version__, "cpu_count": os.cpu_count()}
    print(f"All-reduce of one sparse window, 2 replicas (MirroredStrategy, 2 logical CPUs), "
          f"V={args.vocab:,}, D={args.dim}, {args.rows} rows per replica:")
    print(f"  IndexedSlices (gather): {1e3 * res['indexed_slices']['median_s']:.2f} ms median "
          f"({res['bytes']['indexed_slices_per_replica'] / 2**20:.2f} MiB per replica)")
    print(f"  densified, then summed: {1e3 * res['dense']['median_s']:.2f} ms median "
          f"({res['bytes']['dense_per_replica'] / 2**20:.0f} MiB per replica)")
    print(f"  dense / IndexedSlices: {res['ratio_dense_over_slices']:.1f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse_allreduce.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'sparse_allreduce.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
