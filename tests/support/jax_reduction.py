"""The all-reduce check of one gradient reduction per window on JAX, and the
exactness of :class:`accum_optimizer.OneReductionPerWindow` against one
device's large batch: what ``tests/backends/test_jax_reduction.py`` asserts
and ``benchmarks/jax_reduction.py`` reports beside its timings.

    KERAS_BACKEND=jax python -m support.jax_reduction    # (from tests/) one JSON line: check()

Four CPU devices (``--xla_force_host_platform_device_count=4``, set before JAX
starts: run it as a fresh process), ``DataParallel`` over them, an MLP and
``N`` micro-batches of ``B`` samples per window. For each way to train
(``plain``: ``Adam``, no accumulation; ``builtin``: Keras'
``Adam(gradient_accumulation_steps=N)``; ``today``:
``AccumulatingOptimizer(Adam, N)`` with Keras' own train step; ``new``: the
same optimizer in a model with ``OneReductionPerWindow``) the train step is
compiled as ``model.fit`` compiles it (``jax.jit`` of ``model.train_step``)
and its optimized HLO (``lowered.compile().as_text()``) is read: every
``all-reduce`` (its count and the elements it moves, summed over the tensors
of a tuple all-reduce), split into those that run on every call (reachable
from the entry computation without entering a ``conditional``'s branch) and
those inside a conditional's branch (run only when that branch is taken: the
window's update). An accumulate-only micro-step moves the every-call
elements; an update at most every-call plus branch elements.

The exactness (an MLP of width :data:`CHECK_WIDTH`): the largest absolute
weight difference of ``new`` (``fit``; the custom ``jax.jit`` loop with
:func:`accum_optimizer.device_value_and_grad`; ``fit`` with a
``CountedLoss`` over sample weights; ``fit`` with a ``LossScaleOptimizer``
outside the wrapper) from one device's ``fit(batch_size=N*B)`` with plain
Adam (no distribution), and a model with ``Dropout`` and
``BatchNormalization`` under the mixin and under Keras' step (their seed
state and moving statistics). Keras 3 on JAX (the k3-jax environment).
"""

from __future__ import annotations

import json
import os
import re
import sys

N = 4  # micro-steps per window
B = 32  # samples per micro-batch (8 per device)
FEATURES, OUTPUTS = 64, 8
CHECK_WIDTH = 32  # hidden width of the MLP the exactness is checked on
DEVICES = 4


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_REFERENCE = re.compile(r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations)"
                        r"=(\{[^}]*\}|%?[\w.\-]+)")
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(-start)?\(")
_OTHER_COLLECTIVE = re.compile(r"\s(all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


def _elements(type_text: str) -> int:
    total = 0
    for dims in _SHAPE.findall(type_text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count
    return total


def all_reduces(hlo: str) -> list[dict]:
    """Every all-reduce of an optimized HLO module's text.

    Returns one dict per ``all-reduce`` (or ``all-reduce-start``)
    instruction (and one, with ``kind`` instead of ``elements``, per other
    collective: ``all-gather``, ``reduce-scatter``, ``all-to-all``,
    ``collective-permute``): ``computation`` (the one it is in), ``elements`` (summed
    over the tensors it reduces; for ``all-reduce-start`` its result's, the
    operands' and outputs' tuple halved), and ``every_call``: whether its
    computation is reachable from the entry computation without entering a
    ``conditional``'s branch (``branch_computations``, ``true_computation``,
    ``false_computation``); otherwise it runs only when a branch is taken.
    """
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            match = _HEADER.match(line)
            if match:
                current = match.group(1)
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
                continue
        if current is not None and line.startswith(" "):
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    edges: dict[str, list[tuple[str, bool]]] = {name: [] for name in computations}
    for name, lines in computations.items():
        for line in lines:
            for kind, target in _REFERENCE.findall(line):
                branch = kind in ("true_computation", "false_computation", "branch_computations")
                for callee in re.findall(r"%?([\w.\-]+)", target):
                    if callee in computations:
                        edges[name].append((callee, branch))
    every_call, stack = {entry}, [entry]
    while stack:
        for callee, branch in edges[stack.pop()]:
            if not branch and callee not in every_call:
                every_call.add(callee)
                stack.append(callee)
    found = []
    for name, lines in computations.items():
        for line in lines:
            match = _ALL_REDUCE.search(line)
            other = _OTHER_COLLECTIVE.search(line)
            if match:
                elements = _elements(match.group(1))
                if match.group(2):  # (async start: a tuple of operands and outputs)
                    elements //= 2
                found.append({"computation": name, "elements": elements, "every_call": name in every_call})
            elif other:
                found.append({"computation": name, "kind": other.group(1), "every_call": name in every_call})
    return found


def summary(hlo: str, parameters: int) -> dict:
    """Counts and elements of the all-reduces of ``hlo``, split into those
    that run on every call and those inside a conditional's branch, and the
    every-call elements as a fraction of ``parameters``."""
    found = all_reduces(hlo)
    reduces = [r for r in found if "kind" not in r]
    every = [r for r in reduces if r["every_call"]]
    branch = [r for r in reduces if not r["every_call"]]
    return {
        "parameters": parameters,
        "other_collectives": sorted(f"{r['kind']}{'' if r['every_call'] else ' (branch)'}" for r in found
                                    if "kind" in r),
        "every_call_count": len(every),
        "every_call_elements": sum(r["elements"] for r in every),
        "branch_count": len(branch),
        "branch_elements": sum(r["elements"] for r in branch),
        "largest_branch_all_reduce": max([r["elements"] for r in branch], default=0),
        "every_call_fraction_of_parameters": sum(r["elements"] for r in every) / parameters,
    }


# ------------------------------------------------------------------ models
def data(samples: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.normal(size=(samples, FEATURES)).astype("float32"),
            rng.normal(size=(samples, OUTPUTS)).astype("float32"))


def _model(cls, width: int):
    import keras

    keras.utils.set_random_seed(1)
    return cls([keras.Input((FEATURES,)), keras.layers.Dense(width, activation="tanh"),
                keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(OUTPUTS)])


def _sequential_with_mixin():
    import keras

    from accum_optimizer import OneReductionPerWindow

    class Model(OneReductionPerWindow, keras.Sequential):
        pass

    return Model


def _optimizer(kind: str):
    import keras

    from accum_optimizer import AccumulatingOptimizer

    if kind == "plain":
        return keras.optimizers.Adam(1e-3)
    if kind == "builtin":
        return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=N)
    return AccumulatingOptimizer(keras.optimizers.Adam(1e-3), N)


def built(kind: str, width: int, x, y):
    """A model of ``kind`` under DataParallel, compiled and trained one window."""
    import keras

    cls = _sequential_with_mixin() if kind == "new" else keras.Sequential
    model = _model(cls, width)
    model.compile(_optimizer(kind), "mse")
    model.fit(x[:N * B], y[:N * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model


def state(model):
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables], [v.value for v in model.metrics_variables])


def distributed_batch(x, y):
    import jax
    import keras

    sharding = keras.distribution.distribution().get_data_layout(x.shape).backend_layout
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


def train_step(model):
    """The train step as ``fit`` compiles it (``jax.jit`` of ``train_step``,
    the state donated)."""
    import jax

    return jax.jit(model.train_step, donate_argnums=0)


def hlo_of(model, batch) -> str:
    return train_step(model).lower(state(model), batch).compile().as_text()


def parameters(model) -> int:
    import numpy as np

    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def _large_batch(width: int, x, y, epochs: int):
    import keras

    model = _model(keras.Sequential, width)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x, y, batch_size=N * B, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _max_diff(a, b) -> float:
    import numpy as np

    return max(float(np.abs(np.asarray(p) - np.asarray(q)).max()) for p, q in zip(a, b))


def _custom_loop(width: int, x, y, epochs: int):
    """The documented custom-loop form: ``device_value_and_grad`` and
    ``stateless_apply`` in a ``jax.jit`` step."""
    import jax
    import keras

    from accum_optimizer import AccumulatingOptimizer, device_value_and_grad

    model = _model(keras.Sequential, width)
    opt = AccumulatingOptimizer(keras.optimizers.Adam(1e-3), N)
    opt.use_device_accumulators()
    opt.build(model.trainable_variables)

    def loss_fn(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return keras.ops.mean(keras.ops.square(y_pred - y)), non_trainable

    grad_fn = device_value_and_grad(loss_fn, has_aux=True, batch_argnums=(2, 3))

    @jax.jit
    def micro_step(trainable, non_trainable, opt_vars, x, y):
        (loss, _), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        return loss, trainable, opt_vars

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    opt_vars = [v.value for v in opt.variables]
    for _ in range(epochs):
        for start in range(0, len(x), B):
            xb, yb = distributed_batch(x[start:start + B], y[start:start + B])
            _, trainable, opt_vars = micro_step(trainable, non_trainable, opt_vars, xb, yb)
    return [jax.device_get(t) for t in trainable]


def measure_hlo(width: int, kinds=("plain", "builtin", "today", "new")) -> dict:
    """The all-reduce summary of each kind's compiled train step."""
    x, y = data(N * B)
    batch = distributed_batch(x[:B], y[:B])
    out = {}
    for kind in kinds:
        model = built(kind, width, x, y)
        out[kind] = summary(hlo_of(model, batch), parameters(model))
    return out


def exactness(width: int, epochs: int = 2) -> dict:
    """Largest weight difference of ``new`` (``fit``; the custom loop) from
    the single-device large batch, 3 windows per epoch."""
    import keras

    x, y = data(3 * N * B, seed=2)
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        reference = _large_batch(width, x, y, epochs)
    finally:
        keras.distribution.set_distribution(distribution)
    model = _model(_sequential_with_mixin(), width)
    model.compile(_optimizer("new"), "mse")
    model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    scaled = _model(_sequential_with_mixin(), width)  # (a LossScaleOptimizer outside the wrapper)
    scaled.compile(keras.optimizers.LossScaleOptimizer(_optimizer("new")), "mse")
    scaled.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return {
        "updates": int(model.optimizer.iterations),
        "fit_max_abs_diff": _max_diff(reference, model.get_weights()),
        "custom_loop_max_abs_diff": _max_diff(reference, _custom_loop(width, x, y, epochs)),
        "counted_loss_max_abs_diff": _counted(width, x, y, epochs),
        "loss_scale_optimizer_max_abs_diff": _max_diff(reference, scaled.get_weights()),
        "accumulator_shape_of_first_kernel": list(model.optimizer.acc_grads[0].shape),
        "accumulator_spec_of_first_kernel": str(model.optimizer.acc_grads[0].value.sharding.spec),
        "dropout_batchnorm": _dropout_batchnorm(x, y),
    }


def _counted(width: int, x, y, epochs: int) -> float:
    """Largest weight difference from the single-device large batch of a
    ``CountedLoss`` weighted by sample weights (``mean_with_sample_weight``:
    each device's share of the micro-batch's count differs)."""
    import keras
    import numpy as np

    from accum_optimizer import CountedLoss

    w = np.random.default_rng(3).uniform(0.1, 2.0, size=len(x)).astype("float32")
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        reference = _model(keras.Sequential, width)
        reference.compile(keras.optimizers.Adam(1e-3), keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"))
        reference.fit(x, y, sample_weight=w, batch_size=N * B, epochs=epochs, shuffle=False, verbose=0)
    finally:
        keras.distribution.set_distribution(distribution)
    model = _model(_sequential_with_mixin(), width)
    model.compile(_optimizer("new"), CountedLoss("mse", reduction="mean_with_sample_weight"))
    model.fit(x, y, sample_weight=w, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return _max_diff(reference.get_weights(), model.get_weights())


def _dropout_batchnorm(x, y) -> dict:
    """A model with ``Dropout`` and ``BatchNormalization`` under the mixin
    and under Keras' own step (``DataParallel`` both), one window each: the
    final loss, the seed generator's state (its counter advanced as Keras'
    own) and whether the moving statistics moved."""
    import keras
    import numpy as np

    def run(cls):
        keras.utils.set_random_seed(1)
        model = cls([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                     keras.layers.Dropout(0.5, seed=5), keras.layers.BatchNormalization(),
                     keras.layers.Dense(OUTPUTS)])
        model.compile(_optimizer("new"), "mse")
        history = model.fit(x[:N * B], y[:N * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        seeds = [np.asarray(v.value).tolist() for v in model.non_trainable_variables if v.name == "seed_generator_state"]
        moving = [v for v in model.non_trainable_variables if v.name == "moving_mean"][0]
        return {"loss": float(history.history["loss"][-1]), "seed_state": seeds,
                "moving_mean_moved": bool(np.abs(np.asarray(moving.value)).max() > 0)}

    return {"mixin": run(_sequential_with_mixin()), "keras": run(keras.Sequential)}


def check() -> dict:
    """Under ``DataParallel`` over this process' devices: the HLO summary of
    ``today`` and ``new`` (:func:`measure_hlo`) and :func:`exactness`, at
    :data:`CHECK_WIDTH`."""
    import jax
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    return {"devices": len(jax.devices()), "hlo": measure_hlo(CHECK_WIDTH, ("today", "new")),
            "exactness": exactness(CHECK_WIDTH), "env": {"keras": keras.__version__, "jax": jax.__version__}}


def simulated_devices() -> None:
    """Before JAX starts: :data:`DEVICES` CPU devices, Keras on JAX."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}").strip()
    os.environ["KERAS_BACKEND"] = "jax"


if __name__ == "__main__":
    simulated_devices()
    print(json.dumps(check()))
    sys.exit(0)
