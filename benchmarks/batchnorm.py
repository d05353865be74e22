"""BatchNorm moving statistics under gradient accumulation, on a real image task.

A small BatchNorm CNN (Conv2D(16, 3) -> BN -> ReLU -> MaxPool -> Conv2D(32, 3)
-> BN -> ReLU -> GlobalAveragePooling -> Dense(10); convolutions without bias,
BN momentum 0.9, channels_last) learns scikit-learn's ``load_digits`` (1,797
8x8 grayscale digits, nothing downloaded), upsampled to 16x16 and split 80/20
with a fixed seed. It trains the same number of updates at the same effective
batch N·B = 8·16 = 128, from the same initial weights, in the same sample order
(one fixed permutation per epoch, the remainder dropped, so a window's
micro-batches are exactly the rows of the large batch), four ways:

1. ``large``: Adam on batches of N·B, ``keras.layers.BatchNormalization``
   (the reference);
2. ``accum-plain-bn``: ``AccumulatingOptimizer(Adam, N)`` on micro-batches of
   B, ``keras.layers.BatchNormalization``: the moving statistics take a
   momentum step on every micro-batch, N per window;
3. ``accum-pooled-bn``: the same with ``accum_optimizer.layers.BatchNormalization``
   (``convert_batch_norm``): one step per window with the window's pooled
   (Chan-merged) moments;
4. ``accum-andreped``: the rule of andreped/GradientAccumulator's
   ``AccumBatchNormalization`` (written here as a ``keras.layers.BatchNormalization``
   subclass): one step per window with the average of the micro-batch means
   and the average of the micro-batch variances, which leaves out the spread
   of the micro-batch means.

Each is a custom loop (``tf.function``, ``GradientTape``, ``apply_gradients``).
Reported per way, at the end of training: the error of every BN's
``moving_mean`` and ``moving_variance`` against the ``large`` run, and the test
accuracy in inference mode (``model(x_test, training=False)``).

Ways 2-4 train the same weights (the forward pass normalises each micro-batch
by its own moments whatever the rule), ``large`` slightly different ones (it
normalises by the moments of N·B rows), so the end-of-training error mixes the
rule with that drift; and the end-of-training accuracy depends on how far the
moving statistics lag the weights (way 2 steps N times per window, so it
forgets faster). A second measurement isolates the rule: fresh copies of each
way get the final trainable weights of ``large``, their moving statistics
reset to (0, 1), and train 15 epochs over the same windows in training mode
with a learning rate of 0 (``SGD(0)``; ``AccumulatingOptimizer(SGD(0), N)``
for way 3, whose windows follow the optimizer), so only the moving statistics
move, long enough for every rule to forget (0, 1). Their test accuracy is
reported, and their moving statistics are compared with

* ``vs large``: the same pass of way 1 (plain BN on batches of N·B);
* ``vs rule``: the large batch's rule applied to what each BN saw: per window,
  the moments (float64, NumPy) of the window's inputs of that layer, one
  momentum step. The first BN sees the same inputs in every way; the second
  sees its input normalised by the first BN with the micro-batch's moments
  (B rows) rather than the large batch's (N·B rows), a difference no moving-
  statistics rule can remove, which ``vs large`` includes and ``vs rule`` does
  not.

Error: the max over layers and channels of |a - b| / (|b| + 1e-3), with b the
reference. Usage, from the repository root::

    python -m benchmarks.batchnorm [--quick] [--out DIR]

(``.venv/bin/python -m benchmarks.batchnorm``, about 90 s on 2 busy CPU cores).
``--quick`` is a smoke run of seconds (2 epochs; a frozen pass of 1 epoch,
too short to converge). Writes ``<out>/batchnorm.json`` (all figures,
settings, versions, load averages), ``<out>/batchnorm.png`` (moving-variance
errors on a log scale, test accuracies) and ``<out>/batchnorm.md`` (the table
and the command); ``--out`` defaults to ``docs/benchmarks``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/batchnorm.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from benchmarks._env import load_average, static_env, tf_env  # noqa: E402
from benchmarks._output import Progress, format_table, print_and_write, pyplot, save_figure  # noqa: E402
from benchmarks._profiles import benchmark_parser  # noqa: E402
from benchmarks._training import make_train_step  # noqa: E402

N, B = 8, 16             # accumulation steps, micro-batch size: the large batch is N*B = 128
EPOCHS, QUICK_EPOCHS = 30, 2
# The frozen pass starts from moving statistics (0, 1); after 15 epochs (165
# windows) 0.9**165 ~ 3e-8 of them is left, far below the smallest moving
# variance of this model (~3e-3): every rule has converged.
FROZEN_EPOCHS, QUICK_FROZEN_EPOCHS = 15, 1
LR, MOMENTUM, SEED = 3e-3, 0.9, 0
SIDE, TEST_FRACTION = 16, 0.2
EPS = 1e-3               # floor of the relative error's denominator
WAYS = ("large", "accum-plain-bn", "accum-pooled-bn", "accum-andreped")
WAY_TITLES = {
    "large": f"Adam, batch N·B={N * B}, keras BN",
    "accum-plain-bn": f"AccumulatingOptimizer(Adam, {N}), B={B}, keras BN",
    "accum-pooled-bn": f"AccumulatingOptimizer(Adam, {N}), B={B}, accum_optimizer BN",
    "accum-andreped": f"AccumulatingOptimizer(Adam, {N}), B={B}, andreped's rule",
}

# TensorFlow and Keras are imported by _import_tf(), after the arguments are
# parsed (so that --help is instant).
tf = keras = np = None


def _import_tf() -> None:
    global tf, keras, np
    import keras as _keras
    import numpy as _np
    import tensorflow as _tf

    tf, keras, np = _tf, _keras, _np


# ----------------------------------------------------------- andreped's rule
@functools.lru_cache(maxsize=None)
def _andreped_class():
    class AndrepedBatchNormalization(keras.layers.BatchNormalization):
        """andreped/GradientAccumulator's ``AccumBatchNormalization`` rule on
        Keras' layer: in training, each micro-batch is normalised by its own
        moments (as the parent does); its mean / N and variance / N are added
        to ``accum_mean`` and ``accum_variance``, and on the N-th training
        call (``accum_step_counter`` reaches ``accum_steps``) the moving
        statistics take one momentum step with those averages (Keras'
        expression) and the accumulators empty. Masks are not supported (the
        benchmark's model has none)."""

        def __init__(self, accum_steps: int, **kwargs):
            super().__init__(**kwargs)
            self.accum_steps = accum_steps

        def build(self, input_shape):
            super().build(input_shape)
            shape = (input_shape[self.axis],)
            self.accum_mean = self.add_weight(shape=shape, name="accum_mean", initializer="zeros",
                                              trainable=False, autocast=False)
            self.accum_variance = self.add_weight(shape=shape, name="accum_variance", initializer="zeros",
                                                  trainable=False, autocast=False)
            self.accum_step_counter = self.add_weight(shape=(), name="accum_step_counter", initializer="zeros",
                                                      dtype="int32", trainable=False)

        def call(self, inputs, training=None, mask=None):
            if not (training and self.trainable):
                return super().call(inputs, training=training, mask=mask)
            ops = keras.ops
            inputs = ops.cast(inputs, "float32")
            mean, variance = ops.moments(inputs, axes=self._reduction_axes)
            counter = self.accum_step_counter + 1
            accum_mean = self.accum_mean + mean / self.accum_steps
            accum_variance = self.accum_variance + variance / self.accum_steps
            update = ops.equal(counter, self.accum_steps)
            m = self.momentum
            self.moving_mean.assign(ops.where(update, self.moving_mean * m + accum_mean * (1.0 - m),
                                              self.moving_mean))
            self.moving_variance.assign(ops.where(update, self.moving_variance * m + accum_variance * (1.0 - m),
                                                  self.moving_variance))
            self.accum_mean.assign(ops.where(update, ops.zeros_like(accum_mean), accum_mean))
            self.accum_variance.assign(ops.where(update, ops.zeros_like(accum_variance), accum_variance))
            self.accum_step_counter.assign(ops.where(update, 0, counter))
            outputs = ops.batch_normalization(inputs, mean, variance, axis=self.axis, offset=self.beta,
                                              scale=self.gamma, epsilon=self.epsilon)
            return ops.cast(outputs, self.compute_dtype)

    return AndrepedBatchNormalization


# ------------------------------------------------------------- data, models
def load_data() -> dict:
    """``load_digits`` in [0, 1], upsampled to SIDE x SIDE (pixel repeat),
    channels_last, split with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    scale = SIDE // digits.images.shape[1]
    x = np.kron(digits.images / 16.0, np.ones((1, scale, scale)))[..., None].astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=TEST_FRACTION, random_state=SEED,
                                                        stratify=y)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def build_model(way: str):
    """The CNN with the BN layers of ``way`` (seeded: the same initial
    weights for every way; ``accum-pooled-bn`` via ``convert_batch_norm``)."""
    from accum_optimizer.layers import convert_batch_norm

    if way == "accum-andreped":
        cls = _andreped_class()
        bn = lambda name: cls(N, momentum=MOMENTUM, name=name)  # noqa: E731
    else:
        bn = lambda name: keras.layers.BatchNormalization(momentum=MOMENTUM, name=name)  # noqa: E731
    keras.utils.set_random_seed(SEED)
    L = keras.layers
    inp = keras.Input((SIDE, SIDE, 1))
    x = L.ReLU()(bn("bn1")(L.Conv2D(16, 3, padding="same", use_bias=False)(inp)))
    x = L.MaxPooling2D()(x)
    x = L.ReLU()(bn("bn2")(L.Conv2D(32, 3, padding="same", use_bias=False)(x)))
    out = L.Dense(10)(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out, name=f"digits_cnn_{way}")
    return convert_batch_norm(model) if way == "accum-pooled-bn" else model


def _bns(model) -> list:
    return [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]


def _stats(model) -> dict:
    return {bn.name: (bn.moving_mean.numpy().astype("float64"), bn.moving_variance.numpy().astype("float64"))
            for bn in _bns(model)}


def _errors(stats: dict, ref: dict) -> dict:
    """Per layer, max over channels of |a - b| / (|b| + EPS), mean and variance."""
    rel = lambda a, b: float(np.max(np.abs(a - b) / (np.abs(b) + EPS)))  # noqa: E731
    return {name: {"mean": rel(m, ref[name][0]), "variance": rel(v, ref[name][1])}
            for name, (m, v) in stats.items()}


def _worst(errors: dict, stat: str) -> float:
    return max(e[stat] for e in errors.values())


def _batches(x, y, orders, size: int):
    for order in orders:
        for lo in range(0, len(order), size):
            rows = order[lo:lo + size]
            yield x[rows], y[rows]


def _optimizer(way: str, lr: float, inner):
    from accum_optimizer import AccumulatingOptimizer

    return inner(lr) if way == "large" else AccumulatingOptimizer(inner(lr), gradient_accumulation_steps=N)


def _batch_size(way: str) -> int:
    return N * B if way == "large" else B


def _accuracy(model, data: dict) -> float:
    """Test accuracy in inference mode (the moving statistics)."""
    logits = model(data["x_test"], training=False)
    return float(np.mean(np.argmax(logits, axis=-1) == data["y_test"]))


def _run(model, optimizer, batches) -> list[float]:
    """Train on ``batches`` with a ``tf.function`` custom-loop step; the losses."""
    step = make_train_step(model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return [float(step(x, y)) for x, y in batches]


# -------------------------------------------------------------- measurement
def _with_weights(way: str, weights: list):
    """A fresh model of ``way`` (initial moving statistics) with ``weights``
    as its trainable variables."""
    model = build_model(way)
    for v, w in zip(model.trainable_variables, weights, strict=True):
        v.assign(w)
    return model


def train(way: str, data: dict, orders) -> tuple:
    """Train ``way`` from the seeded initial weights on ``orders`` (Adam,
    learning rate LR): the model and its figures."""
    model = build_model(way)
    t0 = time.perf_counter()
    losses = _run(model, _optimizer(way, LR, keras.optimizers.Adam),
                  _batches(data["x_train"], data["y_train"], orders, _batch_size(way)))
    seconds = time.perf_counter() - t0
    per_epoch = len(losses) // len(orders)
    return model, {"title": WAY_TITLES[way], "micro_steps": len(losses), "seconds": seconds,
                   "test_accuracy": _accuracy(model, data), "last_epoch_loss": float(np.mean(losses[-per_epoch:]))}


def frozen_pass(way: str, weights: list, data: dict, orders) -> tuple:
    """A fresh model of ``way`` with ``weights`` (trainable) and initial
    moving statistics, trained on ``orders`` at learning rate 0: its moving
    statistics, its test accuracy, and the largest change of a weight (0:
    only the moving statistics moved)."""
    model = _with_weights(way, weights)
    _run(model, _optimizer(way, 0.0, keras.optimizers.SGD),
         _batches(data["x_train"], data["y_train"], orders, _batch_size(way)))
    moved = max(float(np.max(np.abs(v.numpy() - w))) for v, w in zip(model.trainable_variables, weights))
    return _stats(model), _accuracy(model, data), moved


def rule_reference(weights: list, data: dict, orders, batch: int) -> dict:
    """The large batch's rule on what each BN sees when the frozen model runs
    in training mode on batches of ``batch`` rows: per window of N·B rows, the
    float64 moments of the layer's inputs and one momentum step, starting from
    (0, 1)."""
    model = _with_weights("large", weights)
    bns = _bns(model)
    probe = keras.Model(model.inputs, [bn.input for bn in bns])  # (its BN updates are not read)
    forward = tf.function(lambda x: probe(x, training=True))
    stats = {bn.name: (np.zeros(bn.moving_mean.shape), np.ones(bn.moving_variance.shape)) for bn in bns}
    per_window = N * B // batch
    window: list = []
    for x, _ in _batches(data["x_train"], data["y_train"], orders, batch):
        window.append([a.numpy().astype("float64") for a in forward(x)])
        if len(window) < per_window:
            continue
        for i, bn in enumerate(bns):
            inputs = np.concatenate([outs[i] for outs in window])
            axes = tuple(range(inputs.ndim - 1))
            mean, var = stats[bn.name]
            stats[bn.name] = (mean * MOMENTUM + inputs.mean(axes) * (1 - MOMENTUM),
                              var * MOMENTUM + inputs.var(axes) * (1 - MOMENTUM))
        window = []
    return stats


def measure_training(data: dict, orders, prog) -> tuple:
    """Train the four ways; per way its figures and the errors of its moving
    statistics against ``large``, and the final trainable weights of ``large``."""
    models, ways = {}, {}
    for way in WAYS:
        models[way], ways[way] = train(way, data, orders)
        prog.step(f"train {way}", f"test accuracy {ways[way]['test_accuracy']:.3f}", ways[way]["seconds"])
    large = models["large"]
    for way, model in models.items():
        errors = _errors(_stats(model), _stats(large))
        ways[way].update(
            max_abs_weight_diff_vs_large=max(float(np.max(np.abs(a.numpy() - b.numpy())))
                                             for a, b in zip(model.trainable_variables, large.trainable_variables,
                                                             strict=True)),
            per_layer=errors, mean_error=_worst(errors, "mean"), variance_error=_worst(errors, "variance"))
    return ways, [v.numpy() for v in large.trainable_variables]


def measure_frozen(weights: list, data: dict, orders, prog) -> dict:
    """The frozen passes of the four ways at ``weights``, their errors against
    the pass of ``large`` and against the large batch's rule on what each BN
    saw, and their test accuracies."""
    rules = {}
    for batch in (N * B, B):
        t = time.perf_counter()
        rules[batch] = rule_reference(weights, data, orders, batch)
        prog.step(f"large batch's rule on the inputs of batches of {batch}", seconds=time.perf_counter() - t)
    passes = {}
    for way in WAYS:
        t = time.perf_counter()
        passes[way] = frozen_pass(way, weights, data, orders)
        prog.step(f"frozen pass {way}", seconds=time.perf_counter() - t)
    frozen = {}
    for way, (stats, accuracy, moved) in passes.items():
        vs_large, vs_rule = _errors(stats, passes["large"][0]), _errors(stats, rules[_batch_size(way)])
        frozen[way] = {"test_accuracy": accuracy, "max_abs_weight_change": moved,
                       "per_layer_vs_large": vs_large, "per_layer_vs_rule": vs_rule,
                       "mean_error_vs_large": _worst(vs_large, "mean"),
                       "variance_error_vs_large": _worst(vs_large, "variance"),
                       "mean_error_vs_rule": _worst(vs_rule, "mean"),
                       "variance_error_vs_rule": _worst(vs_rule, "variance")}
    return frozen


# ------------------------------------------------------------------- output
def _e(x: float) -> str:
    return f"{x:.1e}"


def table(data: dict, markdown: bool = False) -> str:
    headers = ["way", "moving-stat steps", "max|w - w_large|", "trained: mean err", "trained: var err",
               "test acc", "frozen: mean vs large", "frozen: var vs large", "frozen: mean vs rule",
               "frozen: var vs rule", "frozen: test acc"]
    if markdown:
        headers[2] = "max\\|w - w_large\\|"
    rows = []
    for way, r in data["ways"].items():
        t, f = r["trained"], r["frozen"]
        rows.append([way, r["moving_stat_steps"], _e(t["max_abs_weight_diff_vs_large"]), _e(t["mean_error"]),
                     _e(t["variance_error"]), f"{t['test_accuracy']:.3f}", _e(f["mean_error_vs_large"]),
                     _e(f["variance_error_vs_large"]), _e(f["mean_error_vs_rule"]), _e(f["variance_error_vs_rule"]),
                     f"{f['test_accuracy']:.3f}"])
    s = data["settings"]
    legend = (f"N={s['N']}, B={s['B']} (large batch {s['N'] * s['B']}), {s['epochs']} epochs of "
              f"{s['windows_per_epoch']} windows ({s['updates']} updates), Adam({s['lr']}), BN momentum "
              f"{s['momentum']}, seed {s['seed']}; load_digits upsampled to {SIDE}x{SIDE}, "
              f"{s['train_size']} train / {s['test_size']} test images. Errors: {s['error']}. "
              f"'trained' and 'test acc': at the end of training, errors against the `large` run. 'frozen': "
              f"{s['frozen_epochs']} epoch(s) at learning rate 0 from the final weights of `large`, moving statistics "
              f"from (0, 1) (only they move): 'vs large' against the same pass of `large`, 'vs rule' against the "
              f"large batch's rule (float64 moments of each window's N·B rows, one momentum step) on what each BN "
              f"saw (under accumulation the second BN's input is normalised by the first BN with the moments of B "
              f"rows, not N·B: no rule removes that), 'test acc' with those moving statistics.")
    out = format_table(headers, rows, markdown) + "\n\n" + legend
    if markdown:
        env = data["env"]
        load = lambda la: ", ".join(f"{x:.1f}" for x in la or [])  # noqa: E731
        out = (f"Produced by `{data['command']}` in {data['wall_seconds']:.0f} s on {env['date_utc']}: "
               f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, {env['device']}, {env['cpus_usable']} "
               f"CPUs, load average at start {load(env['load_average_at_start'])}, at end "
               f"{load(env['load_average_at_end'])}.\n\n" + out + "\n\n![BatchNorm moving statistics under "
               "gradient accumulation](batchnorm.png)")
    return out


def _grouped_bars(ax, ways: list, series: dict, fmt: str, floor: float = 0.0) -> None:
    """One bar per way and series, its value written on top (``0`` for an
    exact 0, drawn at ``floor``)."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(ways))]
        heights = [max(v, floor) for v in values]
        bars = ax.bar(xs, heights, width, label=label)
        for bar, v, h in zip(bars, values, heights):
            ax.text(bar.get_x() + bar.get_width() / 2, h, "0" if v == 0 else format(v, fmt), ha="center",
                    va="bottom", fontsize=6)
    ax.set_xticks(range(len(ways)), ways, fontsize=7, rotation=15, ha="right")


def plot(data: dict, path: Path) -> Path:
    plt = pyplot()
    ways = list(data["ways"])
    trained = [data["ways"][w]["trained"] for w in ways]
    frozen = [data["ways"][w]["frozen"] for w in ways]
    fig, (ax, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [2, 1]})
    floor = 1e-9
    _grouped_bars(ax, ways, {
        "end of training, vs large": [t["variance_error"] for t in trained],
        "frozen pass, vs large": [f["variance_error_vs_large"] for f in frozen],
        "frozen pass, vs rule": [f["variance_error_vs_rule"] for f in frozen],
    }, ".0e", floor)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 10)
    ax.set_ylabel("max |a - b| / (|b| + 1e-3) of moving_variance")
    ax.set_title(f"Moving-variance error (log scale; 0 drawn at {floor:.0e})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3)
    accuracies = {"end of training": [t["test_accuracy"] for t in trained],
                  "frozen pass (large's weights)": [f["test_accuracy"] for f in frozen]}
    _grouped_bars(ax_acc, ways, accuracies, ".3f")
    ax_acc.set_ylim(max(0.0, min(min(v) for v in accuracies.values()) - 0.1), 1.04)
    ax_acc.set_title("Test accuracy, inference mode")
    ax_acc.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2)
    s = data["settings"]
    fig.suptitle(f"load_digits CNN, N={s['N']}, B={s['B']}, {s['epochs']} epochs, BN momentum {s['momentum']}")
    return save_figure(fig, path)


# --------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, profiles=False)
    parser.add_argument("--quick", action="store_true", help=f"smoke run (seconds): {QUICK_EPOCHS} epochs, "
                        f"a frozen pass of {QUICK_FROZEN_EPOCHS} epoch")
    parser.add_argument("--out", default="docs/benchmarks", help="output folder (default: docs/benchmarks)")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    epochs, frozen_epochs = (QUICK_EPOCHS, QUICK_FROZEN_EPOCHS) if args.quick else (EPOCHS, FROZEN_EPOCHS)
    env = static_env()
    t_start = time.perf_counter()
    _import_tf()
    env.update(tf_env())
    data = load_data()
    windows = len(data["x_train"]) // (N * B)
    rng = np.random.default_rng(SEED)
    orders = [rng.permutation(len(data["x_train"]))[:windows * N * B] for _ in range(epochs)]
    prog = Progress("batchnorm", 2 * len(WAYS) + 2)
    ways, weights = measure_training(data, orders, prog)
    frozen = measure_frozen(weights, data, orders[:frozen_epochs], prog)
    steps_per_window = {"large": 1, "accum-plain-bn": N, "accum-pooled-bn": 1, "accum-andreped": 1}
    env["load_average_at_end"] = load_average()
    result = {
        "benchmark": "batchnorm",
        "command": " ".join([".venv/bin/python -m benchmarks.batchnorm", *argv]),
        "env": env,
        "settings": {
            "N": N, "B": B, "epochs": epochs, "frozen_epochs": frozen_epochs, "seed": SEED, "lr": LR,
            "optimizer": "Adam", "momentum": MOMENTUM, "image_side": SIDE, "train_size": len(data["x_train"]),
            "test_size": len(data["x_test"]), "windows_per_epoch": windows, "updates": windows * epochs,
            "model": "Conv2D(16,3,no bias)-BN-ReLU-MaxPool-Conv2D(32,3,no bias)-BN-ReLU-GAP-Dense(10), channels_last",
            "error": f"max over BN layers and channels of |a - b| / (|b| + {EPS:g}), b the reference",
        },
        "ways": {way: {"moving_stat_steps": steps_per_window[way] * windows * epochs, "trained": ways[way],
                       "frozen": frozen[way]}
                 for way in WAYS},
        "wall_seconds": time.perf_counter() - t_start,
    }
    return print_and_write(args.out, "batchnorm", result, table(result), table(result, markdown=True), plot, prog)


if __name__ == "__main__":
    sys.exit(main())
