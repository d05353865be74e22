"""Gradient all-reduces per window under ``keras.distribution.DataParallel`` (JAX), read from the optimized HLO.

    KERAS_BACKEND=jax python -m benchmarks.jax_reduction               # tables, docs/benchmarks/jax_reduction.{json,png,md}
    KERAS_BACKEND=jax python -m benchmarks.jax_reduction --quick       # fewer timing rounds
    KERAS_BACKEND=jax python -m benchmarks.jax_reduction --check       # one JSON line, no timing (what the test reads)

Four CPU devices (``--xla_force_host_platform_device_count=4``, set here before
JAX starts: run it as a fresh process), ``DataParallel`` over them, an MLP
and ``N`` micro-batches of ``B`` samples per window. For each way to train:

* ``plain``: ``Adam``, no accumulation (one all-reduce per step: the reference
  of what a step costs);
* ``builtin``: Keras' ``Adam(gradient_accumulation_steps=N)``;
* ``today``: ``AccumulatingOptimizer(Adam, N)`` with Keras' own train step;
* ``new``: the same optimizer in a model with
  :class:`accum_optimizer.OneReductionPerWindow`.

the train step is compiled as ``model.fit`` compiles it (``jax.jit`` of
``model.train_step``) and its optimized HLO (``lowered.compile().as_text()``)
is read: every ``all-reduce`` (its count and the elements it moves, summed
over the tensors of a tuple all-reduce), split into those that run on every
call (reachable from the entry computation without entering a
``conditional``'s branch) and those inside a conditional's branch (run only
when that branch is taken: the window's update). An accumulate-only
micro-step moves the every-call elements; an update at most every-call plus
branch elements.

Also (on a narrower MLP, width 32): the largest absolute weight difference
of ``new`` (``fit``; the custom ``jax.jit`` loop with
:func:`accum_optimizer.device_value_and_grad`; ``fit`` with a
``CountedLoss`` over sample weights; ``fit`` with a ``LossScaleOptimizer``
outside the wrapper) from one device's ``fit(batch_size=N*B)``
with plain Adam (no distribution), and a model with ``Dropout`` and
``BatchNormalization`` under the mixin and under Keras' step (their seed
state and moving statistics). Unless ``--check``: the time per micro-step
of ``new``, ``today``, ``builtin`` and ``plain`` in interleaved rounds (each
round times 5 windows of each, in turn), reported as the per-round ratios
new/today, new/builtin and today/builtin, median with a 95%
percentile-bootstrap interval (``benchmarks._common``); written to
``<out>/jax_reduction.{json,png,md}``. Needs Keras 3 on JAX (the k3-jax
environment; matplotlib for the figure).
"""

from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

N = 4  # micro-steps per window
B = 32  # samples per micro-batch (8 per device)
WIDTH = 1024  # hidden width of the timed MLP
FEATURES, OUTPUTS = 64, 8
CONFIDENCE = 0.95


# ----------------------------------------------------------------- the HLO
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
def _data(samples: int, seed: int = 0):
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


def _built(kind: str, width: int, x, y):
    """A model of ``kind`` under DataParallel, compiled and trained one window."""
    import keras

    cls = _sequential_with_mixin() if kind == "new" else keras.Sequential
    model = _model(cls, width)
    model.compile(_optimizer(kind), "mse")
    model.fit(x[:N * B], y[:N * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model


def _state(model):
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables], [v.value for v in model.metrics_variables])


def _distributed_batch(x, y):
    import jax
    import keras

    sharding = keras.distribution.distribution().get_data_layout(x.shape).backend_layout
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


def _step(model):
    """The train step as ``fit`` compiles it (``jax.jit`` of ``train_step``,
    the state donated)."""
    import jax

    return jax.jit(model.train_step, donate_argnums=0)


def hlo_of(model, batch) -> str:
    return _step(model).lower(_state(model), batch).compile().as_text()


def _parameters(model) -> int:
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
            xb, yb = _distributed_batch(x[start:start + B], y[start:start + B])
            _, trainable, opt_vars = micro_step(trainable, non_trainable, opt_vars, xb, yb)
    return [jax.device_get(t) for t in trainable]


def measure_hlo(width: int, kinds=("plain", "builtin", "today", "new")) -> dict:
    """The all-reduce summary of each kind's compiled train step."""
    x, y = _data(N * B)
    batch = _distributed_batch(x[:B], y[:B])
    out = {}
    for kind in kinds:
        model = _built(kind, width, x, y)
        out[kind] = summary(hlo_of(model, batch), _parameters(model))
    return out


def exactness(width: int, epochs: int = 2) -> dict:
    """Largest weight difference of ``new`` (``fit``; the custom loop) from
    the single-device large batch, 3 windows per epoch."""
    import keras

    x, y = _data(3 * N * B, seed=2)
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


TIMED = ("new", "today", "builtin", "plain")
RATIOS = (("new", "today"), ("new", "builtin"), ("today", "builtin"))


def measure_time(width: int, rounds: int, windows: int) -> dict:
    """Seconds per micro-step of each kind of :data:`TIMED`, in interleaved
    rounds (each round times ``windows`` windows of each kind in turn); the
    per-round ratios of :data:`RATIOS`, median with a 95% percentile-bootstrap
    interval."""
    import jax

    from benchmarks import _common as C

    x, y = _data(N * B)
    batches = [_distributed_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(N)]
    runs = {}
    for kind in TIMED:
        model = _built(kind, width, x, y)
        step = _step(model)
        state = _state(model)
        for batch in batches:  # (compile, warm up)
            state = step(state, batch)[1]
        jax.block_until_ready(state)
        runs[kind] = [step, state]
    times = {k: [] for k in TIMED}
    for _ in range(rounds):
        for kind in TIMED:
            step, state = runs[kind]
            start = time.perf_counter()
            for _ in range(windows):
                for batch in batches:
                    state = step(state, batch)[1]
            jax.block_until_ready(state)
            times[kind].append((time.perf_counter() - start) / (windows * N))
            runs[kind][1] = state
    return {
        "rounds": rounds, "micro_steps_per_round": windows * N,
        "seconds_per_micro_step": {k: C.summarize(v) for k, v in times.items()},
        "ratios": {f"{a}/{b}": C.summarize_with_ci([p / q for p, q in zip(times[a], times[b])], CONFIDENCE)
                   for a, b in RATIOS},
    }


def per_kind(s: dict) -> dict:
    """All-reduces (count, elements) of an accumulate-only micro-step (the
    every-call ones) and of an update (every-call plus the branch's)."""
    return {"accumulate": (s["every_call_count"], s["every_call_elements"]),
            "update": (s["every_call_count"] + s["branch_count"], s["every_call_elements"] + s["branch_elements"])}


LABELS = {"plain": "plain Adam (no accumulation)", "builtin": "Keras' built-in (gradient_accumulation_steps)",
          "today": "AccumulatingOptimizer, Keras' train step", "new": "AccumulatingOptimizer + OneReductionPerWindow"}


def markdown(result: dict) -> str:
    from benchmarks import _common as C

    params = result["hlo"]["new"]["parameters"]
    lines = [
        "# Gradient all-reduces per window: DataParallel on JAX",
        "",
        f"{result['devices']} simulated CPU devices (`--xla_force_host_platform_device_count=4`), "
        f"`DataParallel`, MLP {FEATURES}-{result['width']}-{result['width']}-{OUTPUTS} ({params} "
        f"parameters), Adam, N = {N} micro-batches of B = {B} ({B // result['devices']} per device), Keras "
        f"{result['env']['keras']}, JAX {result['env']['jax']}. Command: `{result['command']}`.",
        "",
        "All-reduces in the optimized HLO of the compiled train step (`jax.jit(model.train_step)`, as `fit` "
        "compiles it; `lower(...).compile().as_text()`): an accumulate-only micro-step runs those reachable "
        "without entering a `conditional`'s branch, an update also those inside the branch (the window's "
        "update). Elements: summed over the tensors of a tuple all-reduce.",
        "",
    ]
    rows = []
    for kind, s in result["hlo"].items():
        k = per_kind(s)
        rows.append([LABELS[kind], *k["accumulate"], f"{100 * s['every_call_fraction_of_parameters']:.3g}%",
                     *k["update"], ", ".join(s["other_collectives"]) or "none"])
    lines.append(C.format_table(["train step", "accumulate-only: all-reduces", "elements", "of parameters",
                                 "update: all-reduces", "elements", "other collectives"], rows, markdown=True))
    e = result["exactness"]
    lines += ["", f"Against one device's `fit(batch_size={N * B})` with plain Adam ({e['updates']} updates, "
              f"width {result['check_width']}): max |Δw| {e['fit_max_abs_diff']:.2e} (`fit` with the mixin), "
              f"{e['custom_loop_max_abs_diff']:.2e} (custom loop, `device_value_and_grad`), "
              f"{e['counted_loss_max_abs_diff']:.2e} (`CountedLoss`, sample weights), "
              f"{e['loss_scale_optimizer_max_abs_diff']:.2e} (a `LossScaleOptimizer` outside); accumulator of the first "
              f"kernel: shape {tuple(e['accumulator_shape_of_first_kernel'])}, sharding "
              f"{e['accumulator_spec_of_first_kernel']}."]
    t = result.get("time")
    if t:
        per = t["seconds_per_micro_step"]
        lines += ["", f"Time per micro-step, {t['rounds']} interleaved rounds of {t['micro_steps_per_round']} "
                  "micro-steps each (windows of N; median [IQR] ms): "
                  + ", ".join(f"{k} {1e3 * v['median']:.3f} [{1e3 * v['q1']:.3f}, {1e3 * v['q3']:.3f}]"
                              for k, v in per.items()),
                  "", C.format_table(["ratio of times per micro-step", "median [95% interval]"], [
                      [name, C.fmt_ratio(r["median"], r["ci_low"], r["ci_high"])] for name, r in t["ratios"].items()
                  ], markdown=True)]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    from benchmarks import _common as C

    plt = C.pyplot()
    fig, (ax_h, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = list(result["hlo"])
    for offset, (which, color) in enumerate((("accumulate", "tab:blue"), ("update", "tab:orange"))):
        values = [max(per_kind(result["hlo"][k])[which][1], 1) for k in kinds]
        ax_h.bar([i + 0.4 * offset for i in range(len(kinds))], values, width=0.4, color=color,
                 label=f"{which}{'-only' if which == 'accumulate' else ''} micro-step")
    ax_h.axhline(result["hlo"]["new"]["parameters"], color="gray", linestyle="--", linewidth=1, label="parameters")
    ax_h.set_xticks([i + 0.2 for i in range(len(kinds))])
    ax_h.set_xticklabels(kinds)
    ax_h.set_yscale("log")
    ax_h.set_ylabel("elements all-reduced (HLO)")
    ax_h.set_title("all-reduce per micro-step kind")
    ax_h.legend(fontsize=8, loc="lower left")
    t = result.get("time")
    if t:
        names = list(t["ratios"])
        med = [t["ratios"][n]["median"] for n in names]
        err = [[m - t["ratios"][n]["ci_low"] for m, n in zip(med, names)],
               [t["ratios"][n]["ci_high"] - m for m, n in zip(med, names)]]
        ax_t.errorbar(range(len(names)), med, yerr=err, fmt="o", capsize=4)
        ax_t.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax_t.set_xticks(range(len(names)))
        ax_t.set_xticklabels(names)
        ax_t.set_ylabel("ratio of times per micro-step (median, 95% interval)")
        ax_t.set_title("step time")
    fig.suptitle(f"DataParallel over {result['devices']} simulated CPU devices, N = {N}, B = {B}")
    return C.save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="HLO and exactness only, one JSON line")
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default="docs/benchmarks", help="where the JSON, PNG and Markdown go")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import jax
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    check_width = 32
    width = check_width if args.check else WIDTH
    result = {
        "benchmark": "jax_reduction",
        "command": " ".join(["KERAS_BACKEND=jax python -m benchmarks.jax_reduction",
                             *(argv if argv is not None else sys.argv[1:])]),
        "devices": len(jax.devices()),
        "width": width,
        "check_width": check_width,
        "hlo": measure_hlo(width, ("today", "new") if args.check else ("plain", "builtin", "today", "new")),
        "exactness": exactness(check_width),
    }
    if args.check:
        result["env"] = {"keras": keras.__version__, "jax": jax.__version__}
        print(json.dumps(result))
        return 0
    from benchmarks import _common as C

    result["env"] = {**C.static_env(), "jax": jax.__version__}
    prog = C.Progress("jax_reduction", 1)
    rounds = args.rounds or (10 if args.quick else 30)
    result["time"] = measure_time(width, rounds, windows=5)
    prog.step("timed", f"{rounds} rounds")
    text = markdown(result)
    print(text)
    C.write_outputs(Path(args.out), "jax_reduction", result, text, plot, prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
