"""Shardings and bytes per device of the wrapper's state under ``keras.distribution.ModelParallel`` (JAX).

    KERAS_BACKEND=jax python -m experiments.jax_layouts          # a table per layout
    KERAS_BACKEND=jax python -m experiments.jax_layouts --json   # one JSON line (what the test reads)

Four CPU devices (``--xla_force_host_platform_device_count=4``, set here before
JAX starts: run it as a fresh process), a 2x2 ``DeviceMesh`` with axes
``("data", "model")``, an MLP 8-8-4 (two Dense layers ``d1``, ``d2``) and two
``LayoutMap`` s:

* ``tensor_parallel``: ``.*d1/kernel`` ``(None, "model")``, ``.*d2/kernel``
  ``("model", None)`` (Megatron-style column then row split);
* ``fsdp``: every kernel (``.*kernel``) ``("data", "model")``, sharded over both axes.

For each: ``fit`` with ``AccumulatingOptimizer(Adam(0.01), 3)`` on
micro-batches of 4 under the distribution, against one device's
``fit(batch_size=12)`` with ``Adam(0.01)`` (the large batch, no distribution),
2 epochs of 48 samples. Reported per variable: the sharding spec of the
variable, of its accumulator and of its row tracker; per device: the bytes of
the trainable variables, of the wrapper's own state (accumulators, row
trackers, counters; the inner Adam's slots left out) and of its counters; and
the largest absolute weight difference from the large batch. Needs Keras 3 on
JAX (the k3-jax environment).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import json  # noqa: E402

LAYOUTS = {
    "tensor_parallel": {".*d1/kernel": (None, "model"), ".*d2/kernel": ("model", None)},
    "fsdp": {".*kernel": ("data", "model")},
}
"""The ``LayoutMap`` entries (path regex -> axes) of each run."""


def _per_device_bytes(variables) -> int:
    """The largest, over devices, of the bytes of ``variables`` held on one device."""
    held: dict = {}
    for v in variables:
        for shard in v.value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def _spec(variable) -> str:
    sharding = variable.value.sharding
    return str(tuple(getattr(sharding, "spec", ()))) if not sharding.is_fully_replicated else "replicated"


def _first_axis(sharding):
    """``sharding`` (a ``NamedSharding``) of a variable, restricted to its first axis."""
    import jax

    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[:1]))


def run(layout: str) -> dict:
    """Train under ``LAYOUTS[layout]`` and the large batch; the measures in the module docstring."""
    import jax
    import keras
    import numpy as np

    from accum_optimizer import AccumulatingOptimizer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 8)).astype("float32")
    y = rng.normal(size=(48, 4)).astype("float32")

    def fit(optimizer, batch_size, distribution):
        keras.distribution.set_distribution(distribution)  # before any variable (the optimizer's too)
        try:
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh", name="d1"),
                                      keras.layers.Dense(4, name="d2")])
            model.compile(optimizer(), "mse")
            model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        finally:
            keras.distribution.set_distribution(None)
        return model

    mesh = keras.distribution.DeviceMesh((2, 2), ("data", "model"), devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in LAYOUTS[layout].items():
        layout_map[key] = axes
    reference = fit(lambda: keras.optimizers.Adam(0.01), 12, None)
    model = fit(lambda: AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3), 4,
                keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data"))
    opt = model.optimizer
    inner = {id(v) for v in opt.inner_optimizer.variables}
    own = [v for v in opt.variables if id(v) not in inner]
    per_variable = {id(v) for v in list(opt.acc_grads) + list(opt.touched_rows)}
    counters = [v for v in own if id(v) not in per_variable]
    rows = []
    for v, acc, tracker in zip(opt._build_order, opt.acc_grads, opt._row_trackers):
        rows.append({
            "variable": v.path, "shape": list(v.shape), "variable_spec": _spec(v), "acc_grad_spec": _spec(acc),
            "acc_grad_same_sharding": bool(acc.value.sharding.is_equivalent_to(v.value.sharding, len(v.shape))),
            "touched_rows_spec": None if tracker is None else _spec(tracker),
            "touched_rows_same_first_axis": None if tracker is None else
            bool(tracker.value.sharding.is_equivalent_to(_first_axis(v.value.sharding), 1)),
        })
    return {
        "layout": layout,
        "devices": len(jax.devices()),
        "rows": rows,
        "counters_replicated": all(c.value.sharding.is_fully_replicated for c in counters),
        "counter_bytes": sum(c.value.nbytes for c in counters),
        "trainable_bytes_per_device": _per_device_bytes(model.trainable_variables),
        "acc_grad_bytes_per_device": _per_device_bytes(opt.acc_grads),
        "touched_rows_bytes_per_device": _per_device_bytes(opt.touched_rows),
        "own_bytes_per_device": _per_device_bytes(own),
        "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), model.get_weights())),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = [run(name) for name in LAYOUTS]
    if "--json" in argv:
        print(json.dumps(results))
        return 0
    for r in results:
        print(f"\n{r['layout']} ({r['devices']} devices, mesh 2x2 ('data', 'model'))")
        print(f"{'variable':<24} {'shape':<8} {'variable':<22} {'acc_grad':<22} touched_rows")
        for row in r["rows"]:
            print(f"{row['variable']:<24} {str(tuple(row['shape'])):<8} {row['variable_spec']:<22} "
                  f"{row['acc_grad_spec']:<22} {row['touched_rows_spec']}")
        print(f"bytes per device: trainable {r['trainable_bytes_per_device']}, wrapper's state "
              f"{r['own_bytes_per_device']} (accumulators {r['acc_grad_bytes_per_device']}, row trackers "
              f"{r['touched_rows_bytes_per_device']}, counters {r['counter_bytes']}); "
              f"max |w - w_large_batch| {r['max_abs_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
