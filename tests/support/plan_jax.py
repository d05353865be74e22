"""Independent measurements for the planner's tests on JAX
(``tests/plan/test_plan_jax.py``), written without the planner's code.

:func:`compiled_step` builds the model as a training script would
(``build()``, then ``compile`` with ``AccumulatingOptimizer(Adam, 2)`` and
its loss), builds its optimizer, puts one real batch of B on the devices (by
the active ``keras.distribution``'s data layout, if any) and compiles
``model.train_step`` with ``jax.jit(...).lower(state, data).compile()``, as
Keras' JAX trainer jits it for ``fit``. :func:`figures` reads
``memory_analysis()`` of that, and :func:`device0_bytes` adds up the bytes
the state and the batch hold on the first device (a replicated array whole,
a sharded one its shard): what XLA's ``argument`` figure should be.

Run as ``python -m support.plan_jax KIND ARG`` (``tests/`` on the path),
it prints one JSON line for the test, in a process of its own where JAX
starts with 4 CPU devices (``XLA_FLAGS`` set here before JAX is imported):

* ``first_step B``: the planner's figure for the MLP at B, and the resident
  memory the process gained over the first execution of an independently
  compiled step (``VmHWM`` after, less ``VmRSS`` before, from
  ``/proc/self/status``, the high-water mark reset through
  ``/proc/self/clear_refs``); one B per process, so that no earlier step's
  freed memory is reused;
* ``device_step B``: on a GPU, the planner's figure at B against the
  device allocator's peak over the first execution of an independently
  compiled step (``memory_stats()``);
* ``model_parallel M`` / ``data_parallel M``: the plan of the MLP (multiple
  of M) under that ``keras.distribution``
  (``support.plan_models.set_mlp_distribution``, a 2 x 2 mesh or 4-way data
  parallel), each trial's independent per-device figures, the figure of the
  chosen B on one device without a distribution, and the refusal of
  ``replicas`` under the distribution.
"""

from __future__ import annotations

import json
import os
import sys


def compiled_step(build, make_batch, micro_batch_size: int):
    """``(compiled, state, data)`` for one B (see the module docstring)."""
    import jax
    import keras

    from accum_optimizer import AccumulatingOptimizer

    model = build()
    model.compile(optimizer=AccumulatingOptimizer(keras.optimizers.Adam(1e-3), 2), loss=model.loss)
    model.optimizer.build(model.trainable_variables)
    state = tuple([v.value for v in group] for group in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    distribution = keras.distribution.distribution()
    out_shardings = None
    data = []
    for array in make_batch(micro_batch_size):
        if distribution is None:
            data.append(jax.device_put(array))
        else:
            data.append(jax.device_put(array, distribution.get_data_layout(array.shape).backend_layout))
    if distribution is not None:
        out_shardings = (None, jax.tree.map(lambda a: a.sharding, state))
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=out_shardings)
    return step.lower(state, tuple(data)).compile(), state, tuple(data)


def figures(compiled) -> dict:
    """XLA's memory analysis of ``compiled`` and the peak it implies."""
    m = compiled.memory_analysis()
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
           "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
           "generated_code": m.generated_code_size_in_bytes}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


def device0_bytes(*trees) -> int:
    """Bytes the arrays of ``trees`` hold on the first device."""
    import jax

    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(trees):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def independent(build, make_batch, sizes) -> dict:
    """``{B: figures + {"device0_bytes": ...}}`` for each B."""
    out = {}
    for size in sizes:
        compiled, state, data = compiled_step(build, make_batch, size)
        out[size] = {**figures(compiled), "device0_bytes": device0_bytes(state, data)}
    return out


def _status() -> dict:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values


def first_step(micro_batch_size: int) -> dict:
    """The planner's figure at B and the resident memory the first
    execution of an independently compiled step added."""
    import jax

    from accum_optimizer.plan._jax import JaxProbe
    from support import plan_models

    planned = JaxProbe(plan_models.build_mlp, plan_models.batch_mlp).measure(micro_batch_size)["memory"]
    compiled, state, data = compiled_step(plan_models.build_mlp, plan_models.batch_mlp, micro_batch_size)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    before = _status()
    jax.block_until_ready(compiled(state, data))
    after = _status()
    return {"micro_batch_size": micro_batch_size, "planned": planned,
            "rss_before": before["VmRSS"], "hwm_after": after["VmHWM"]}


def device_step(micro_batch_size: int) -> dict:
    """On a device that keeps allocator statistics (a GPU's
    ``memory_stats()``): the planner's figure at B, the bytes in use before
    the first execution of an independently compiled step and the
    allocator's peak after it."""
    import jax

    from accum_optimizer.plan._jax import JaxProbe
    from support import plan_models

    planned = JaxProbe(plan_models.build_mlp, plan_models.batch_mlp).measure(micro_batch_size)["memory"]
    compiled, state, data = compiled_step(plan_models.build_mlp, plan_models.batch_mlp, micro_batch_size)
    device = jax.devices()[0]
    before = device.memory_stats()
    jax.block_until_ready(compiled(state, data))
    after = device.memory_stats()
    return {"micro_batch_size": micro_batch_size, "planned": planned, "platform": device.platform,
            "in_use_before": before["bytes_in_use"], "peak_after": after["peak_bytes_in_use"]}


def sharded(kind: str, multiple_of: int) -> dict:
    """The plan under ``kind``'s distribution and the independent figures."""
    import keras

    from accum_optimizer.plan import plan_accumulation
    from support import plan_models

    lines = []
    plan = plan_accumulation(f"support.plan_models:build_mlp_{kind}", "support.plan_models:batch_mlp",
                             target_batch_size=4096, memory_limit="12MiB", multiple_of=multiple_of, start=256,
                             log=lines.append)
    sizes = [t["micro_batch_size"] for t in plan.trials]
    reference = independent(plan_models.build_mlp, plan_models.batch_mlp, sizes)
    try:
        plan_accumulation(f"support.plan_models:build_mlp_{kind}", "support.plan_models:batch_mlp",
                          target_batch_size=4096, memory_limit="12MiB", replicas=2, verbose=False)
        refused = None
    except ValueError as e:
        refused = str(e)
    keras.distribution.set_distribution(None)
    single = independent(plan_models.build_mlp, plan_models.batch_mlp, [plan.micro_batch_size])
    return {"plan": plan.__dict__, "table": plan.table(), "log": lines, "independent": reference,
            "single_device": single[plan.micro_batch_size], "replicas_refused": refused,
            "devices_seen": len(__import__("jax").devices())}


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind in ("first_step", "device_step"):
        result = (first_step if kind == "first_step" else device_step)(int(argv[1]))
    else:
        result = sharded(kind, int(argv[1]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["KERAS_BACKEND"] = "jax"
    sys.exit(main(sys.argv[1:]))
