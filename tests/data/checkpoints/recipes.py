"""How each checkpoint fixture's model, data, optimizer and training are built.

Shared by ``generate.py`` (which wrote the fixtures of every leg with the
package at commit b72c6b1) and ``tests/contract/test_saved_checkpoints.py`` (which
resumes them with the package under test). A case is a JSON-able dict (see
``generate.py``'s ``CASES`` and each leg's ``manifest.json``); the functions
here turn it into a model, data, an optimizer, training and a state snapshot.

**Frozen with the fixtures.** The expected continuations in the ``.npz``
files were computed by this code: changing how a model, its data, its
optimizer or its training loop is built changes the numbers and breaks the
fixtures on purpose. Only the package's public API is used
(``accum_optimizer.AccumulatingOptimizer``, ``CountedLoss``,
``FlushPartialWindow`` and the wrappers' public attributes), so that a
reshaped package can be tested against fixtures saved by the old one.

Import only after ``tests/support/families.py`` says the case's families are usable
(the Keras that a family needs is imported on first use).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

# Where each format's file (or checkpoint prefix) lives inside a case's directory.
FORMAT_FILES = {
    "keras": "model.keras",  # model.save(".keras") + load_model
    "h5": "model.h5",  # model.save(".h5") + load_model
    "weights_h5": "weights.weights.h5",  # save_weights / load_weights, Keras v3 weights file
    "weights_tf": "weights_tf/ckpt",  # save_weights / load_weights, TF checkpoint format (Keras 2)
    "tf_checkpoint": "tf_checkpoint/ckpt",  # tf.train.Checkpoint(...).write / .read
    "saver": "saver/model.ckpt",  # tf.compat.v1.train.Saver (TF1 graph)
}
# Formats whose loading rebuilds and restores the optimizer at once: the
# restored state is compared with the state at the save before continuing.
RESTORED_ON_LOAD = ("keras", "h5", "saver")
EXPECTED_FILE = "expected.npz"

# Attributes the wrappers expose by name (read when present; compared by name).
NAMED_SCALARS = ("micro_steps", "iterations", "mini_step", "window_weight", "grad_received",
                 "skipped_micro_steps", "skipped_windows", "window_poisoned")
NAMED_LISTS = ("acc_grads", "touched_rows")


# ----------------------------------------------------------------- modules
def keras_of(family: str) -> Any:
    """The Keras a family trains with: Keras 3 (``import keras``) for
    ``keras3``, ``tf.keras`` (Keras 2) for ``keras2``/``legacy``."""
    if family == "keras3":
        import keras

        return keras
    return tf.keras


def accumulating_optimizer() -> Any:
    from accum_optimizer import AccumulatingOptimizer

    return AccumulatingOptimizer


@contextlib.contextmanager
def on_cpu_with_policy(case: dict):
    """Every fixture is computed on the CPU (so a visible GPU does not change
    the numbers), under the case's Keras 3 dtype policy (reset afterwards)."""
    policy = case["model"].get("dtype_policy")
    keras = keras_of(case["family"]) if policy else None
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        with tf.device("/CPU:0"):
            yield
    finally:
        if policy:
            keras.mixed_precision.set_global_policy("float32")


# -------------------------------------------------------------------- data
def make_data(case: dict) -> dict:
    """``x``, ``y`` (and ``sample_weight``) for ``case["data"]``, from numpy
    seeds; micro-batch ``k`` is samples ``[k*B, (k+1)*B)``."""
    spec, b = case["data"], case["micro_batch"]
    rng = np.random.default_rng(spec["seed"])
    n = spec["n"]
    if spec["kind"] == "dense":
        x = rng.normal(size=(n, spec["in"])).astype("float32")
        y = rng.normal(size=(n, spec["out"])).astype("float32")
    elif spec["kind"] == "ids":  # ids from the first `used` rows of the table only
        x = rng.integers(0, spec["used"], size=(n, spec["ids"])).astype("int32")
        y = rng.normal(size=(n, spec["out"])).astype("float32")
    elif spec["kind"] == "classes":  # TF1 softmax regression: one-hot targets
        x = rng.normal(size=(n, spec["in"])).astype("float32")
        y = np.eye(spec["out"], dtype="float32")[rng.integers(0, spec["out"], size=n)]
    else:
        raise ValueError(f"unknown data kind {spec['kind']!r}")
    for k in spec.get("nan_micro_batches", []):  # one NaN input in micro-batch k
        x[k * b, 0] = np.nan
    for k in spec.get("huge_target_micro_batches", []):  # float16 gradients overflow on micro-batch k
        y[k * b:(k + 1) * b] *= 1000.0
    out = {"x": x, "y": y}
    if "sample_weight" in spec:
        sw = spec["sample_weight"]
        weights = np.random.default_rng(sw["seed"]).choice(np.array(sw["values"], "float32"), size=n)
        for k in sw.get("zero_micro_batches", []):
            weights[k * b:(k + 1) * b] = 0.0
        out["sample_weight"] = weights.astype("float32")
    return out


# ------------------------------------------------------------------ models
def make_model(case: dict, seed: int) -> Any:
    """The case's Keras model, initial weights from ``seed``."""
    spec, family = case["model"], case["family"]
    keras = keras_of(family)
    keras.utils.set_random_seed(seed)
    if spec["kind"] == "mlp":  # Dense(hidden, tanh) -> Dense(out)
        layers = [keras.layers.Dense(spec["hidden"], activation="tanh", name="hidden"),
                  keras.layers.Dense(spec["out"], name="out")]
        shape = (spec["in"],)
    elif spec["kind"] == "embedding":  # Embedding(vocab, dim) -> mean over ids -> Dense(out)
        layers = [keras.layers.Embedding(spec["vocab"], spec["dim"], name="table"),
                  keras.layers.GlobalAveragePooling1D(name="pool"),
                  keras.layers.Dense(spec["out"], name="out")]
        shape = (spec["ids"],)
    else:
        raise ValueError(f"unknown model kind {spec['kind']!r}")
    dtype = "int32" if spec["kind"] == "embedding" else "float32"
    if family == "keras3":
        return keras.Sequential([keras.Input(shape, dtype=dtype), *layers], name=spec["kind"])
    return keras.Sequential([keras.layers.InputLayer(input_shape=shape, dtype=dtype), *layers], name=spec["kind"])


# -------------------------------------------------------------- optimizers
def make_inner(case: dict, spec: dict | None = None) -> Any:
    """The inner optimizer of ``case["optimizer"]["inner"]`` (``module``:
    ``keras`` = the family's Keras, ``legacy`` = ``tf.keras.optimizers.legacy``,
    ``tfa`` = ``tensorflow_addons.optimizers``, ``tf1`` = ``tf.compat.v1.train``;
    a nested ``inner`` is passed as ``optimizer``, for tfa's ``Lookahead``)."""
    spec = case["optimizer"]["inner"] if spec is None else spec
    kwargs = dict(spec.get("kwargs", {}))
    if "inner" in spec:
        kwargs["optimizer"] = make_inner(case, spec["inner"])
    module = spec["module"]
    if module == "keras":
        namespace = keras_of(case["family"]).optimizers
    elif module == "legacy":
        namespace = tf.keras.optimizers.legacy
    elif module == "tfa":
        import tensorflow_addons as tfa

        namespace = tfa.optimizers
    elif module == "tf1":
        namespace = tf1.train
    else:
        raise ValueError(f"unknown optimizer module {module!r}")
    return getattr(namespace, spec["class"])(**kwargs)


def accumulation_steps(case: dict) -> Any:
    """``gradient_accumulation_steps``: an int, or ``{"schedule": [[u, N], ...]}``
    for the dict schedule ``{u: N, ...}``."""
    steps = case["optimizer"]["gradient_accumulation_steps"]
    if isinstance(steps, dict):
        return {int(u): int(n) for u, n in steps["schedule"]}
    return steps


def make_optimizer(case: dict) -> Any:
    return accumulating_optimizer()(make_inner(case), accumulation_steps(case),
                                    **case["optimizer"].get("kwargs", {}))


def make_loss(case: dict) -> Any:
    spec = case.get("loss", {"kind": "mse"})
    if spec["kind"] == "mse":
        return "mse"
    if spec["kind"] == "counted_mse":  # accum_optimizer.CountedLoss (Keras 3)
        from accum_optimizer import CountedLoss

        keras = keras_of(case["family"])
        return CountedLoss(keras.losses.MeanSquaredError(reduction=spec["reduction"]))
    raise ValueError(f"unknown loss kind {spec['kind']!r}")


def compiled_model(case: dict, seed: int) -> Any:
    """A fresh model compiled with a fresh (unbuilt) optimizer."""
    model = make_model(case, seed)
    kwargs = {"jit_compile": False} if case["family"] == "keras3" else {}
    model.compile(optimizer=make_optimizer(case), loss=make_loss(case), **kwargs)
    return model


# ---------------------------------------------------------------- training
def _mse(y: Any, p: Any) -> Any:
    return tf.reduce_mean(tf.square(tf.cast(y, p.dtype) - p))


def _loop_step(model: Any, opt: Any) -> Callable:
    """A custom-loop micro-step in a ``tf.function``: tape, gradients of the
    mean squared error, ``opt.apply_gradients``. Traced without AutoGraph,
    as Keras' own ``fit`` traces its train step (converting the optimizers'
    code costs ~10 s per process and changes nothing they compute)."""

    @tf.function(autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _mse(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _callback(case: dict, batch: int, hook: Callable) -> Any:
    keras = keras_of(case["family"])

    class AtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            if b == batch:
                hook(self.model)

    return AtBatch()


def total_micro_steps(case: dict) -> int:
    return case["plan"][-1]["stop"]


def train(case: dict, model: Any, data: dict, start: int = 0, hook: Callable | None = None) -> None:
    """Run the case's plan from micro-step ``start`` on (0: from the
    beginning). ``hook(model)`` runs after micro-step ``case["save_after"]``
    (inside the segment that holds it: a ``fit`` callback, or between two
    loop steps). Plan segments: ``{"start", "stop", "flush"}``, trained by
    ``case["driver"]``: ``"fit"`` (one ``model.fit`` per segment, micro-batch
    ``B``, no shuffling; ``flush``: ``FlushPartialWindow()``) or ``"loop"``
    (the custom step above; ``flush``: ``opt.flush()`` at the segment end)."""
    b, save_after = case["micro_batch"], case["save_after"]
    step = None
    for segment in case["plan"]:
        first, stop = max(segment["start"], start), segment["stop"]
        if first >= stop:
            continue
        assert not (hook and save_after == stop), "save points lie strictly inside a segment"
        if case["driver"] == "fit":
            callbacks = []
            if segment.get("flush"):
                from accum_optimizer import FlushPartialWindow

                callbacks.append(FlushPartialWindow())  # first: Keras runs callbacks in order
            if hook is not None and first < save_after < stop:
                callbacks.append(_callback(case, save_after - first - 1, hook))
            kwargs = {}
            if "sample_weight" in data:
                kwargs["sample_weight"] = data["sample_weight"][first * b:stop * b]
            model.fit(data["x"][first * b:stop * b], data["y"][first * b:stop * b], batch_size=b, epochs=1,
                      shuffle=False, verbose=0, callbacks=callbacks, **kwargs)
        elif case["driver"] == "loop":
            if step is None:
                step = _loop_step(model, model.optimizer)
            for k in range(first, stop):
                step(tf.constant(data["x"][k * b:(k + 1) * b]), tf.constant(data["y"][k * b:(k + 1) * b]))
                if hook is not None and k + 1 == save_after:
                    hook(model)
            if segment.get("flush"):
                model.optimizer.flush()
        else:
            raise ValueError(f"unknown driver {case['driver']!r}")


# ------------------------------------------------------------------- saving
def save(case: dict, fmt: str, model: Any, path: str) -> None:
    if fmt in ("keras", "h5"):
        model.save(path)
    elif fmt in ("weights_h5", "weights_tf"):
        model.save_weights(path)
    elif fmt == "tf_checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(path)
    else:
        raise ValueError(f"cannot save {case['family']} in format {fmt!r}")


def custom_objects(case: dict, spec: dict | None = None) -> dict:
    """``{class name: class}`` of the case's tensorflow-addons optimizers: the
    workaround ``load_model(..., custom_objects=...)`` where a version could
    not resolve them by itself (see ``load_failures`` in the manifest)."""
    spec = case["optimizer"]["inner"] if spec is None else spec
    found = {}
    if spec["module"] == "tfa":
        import tensorflow_addons as tfa

        found[spec["class"]] = getattr(tfa.optimizers, spec["class"])
    if "inner" in spec:
        found.update(custom_objects(case, spec["inner"]))
    return found


def load(case: dict, fmt: str, path: str, objects: dict | None = None) -> tuple[Any, Any]:
    """``(model, checkpoint status or None)``: ``load_model`` for the model
    formats (with ``objects`` as ``custom_objects``); otherwise a fresh model
    (other initial weights) compiled with a fresh, unbuilt optimizer, loaded
    from ``path`` (``load_weights`` of a ``.weights.h5`` file builds it and
    restores at once; checkpoints are restored when it builds, in the first
    micro-step). Imports ``accum_optimizer`` first, as a user must: that
    registers its classes with the active Keras."""
    import accum_optimizer  # noqa: F401

    keras = keras_of(case["family"])
    if fmt in ("keras", "h5"):
        return keras.models.load_model(path, custom_objects=objects), None
    model = compiled_model(case, case["model"]["resume_seed"])
    if fmt in ("weights_h5", "weights_tf"):
        model.load_weights(path)
        return model, None
    if fmt == "tf_checkpoint":
        return model, tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path)
    raise ValueError(f"cannot load {case['family']} from format {fmt!r}")


# -------------------------------------------------------------------- state
def _array(v: Any) -> np.ndarray:
    return np.array(v.numpy())


def _list(variables: Any) -> list:
    """``optimizer.variables`` of any Keras: a list (Keras 3), a
    ``CallableList`` (Keras 2), or a method (``OptimizerV2``)."""
    return list(variables) if isinstance(variables, (list, tuple)) else list(variables())


def _variable_name(v: Any) -> str:
    return str(getattr(v, "path", None) or v.name)


def keras_state(case: dict, model: Any) -> tuple[dict, dict]:
    """``(arrays, names)`` of a Keras model and its optimizer.

    ``weight.NN``: ``model.weights`` in order. ``var.NN``: the variables of
    ``model.optimizer`` (the ``LossScaleOptimizer`` that ``compile`` put
    outside, if any) in its order, the saved layout. ``named.*``: the
    wrapper's state read by attribute name (``micro_steps``, ``iterations``,
    ``mini_step``, ``window_weight``, ``grad_received``, the skip counters,
    ``acc_grads.i``, ``touched_rows.i``), ``named.inner.NN`` the inner
    optimizer's variables and ``named.outer.*`` the ``LossScaleOptimizer``'s
    ``step_counter`` and ``dynamic_scale``. ``names``: the name or path of
    each ``weight``, ``var`` and ``named.inner`` entry."""
    cls = accumulating_optimizer()
    arrays, names = {}, {}
    for i, w in enumerate(model.weights):
        arrays[f"weight.{i:02d}"], names[f"weight.{i:02d}"] = _array(w), _variable_name(w)
    opt = model.optimizer
    wrapper = opt if isinstance(opt, cls) else opt.inner_optimizer
    assert isinstance(wrapper, cls), type(wrapper)
    for i, v in enumerate(_list(opt.variables)):
        arrays[f"var.{i:02d}"], names[f"var.{i:02d}"] = _array(v), _variable_name(v)
    for name in NAMED_SCALARS:
        v = getattr(wrapper, name, None)
        if v is not None:
            arrays[f"named.{name}"] = _array(v)
    for name in NAMED_LISTS:
        for i, v in enumerate(getattr(wrapper, name, None) or []):
            if v is not None:
                arrays[f"named.{name}.{i}"] = _array(v)
    for i, v in enumerate(_list(wrapper.inner_optimizer.variables)):
        arrays[f"named.inner.{i:02d}"], names[f"named.inner.{i:02d}"] = _array(v), _variable_name(v)
    if opt is not wrapper:
        for name in ("step_counter", "dynamic_scale"):
            v = getattr(opt, name, None)
            if v is not None:
                arrays[f"named.outer.{name}"] = _array(v)
    return arrays, names


# ------------------------------------------------------------------- TF1
def tf1_init(case: dict, seed: int) -> dict:
    """Initial values of the softmax regression ``dense/kernel``, ``dense/bias``."""
    spec = case["model"]
    rng = np.random.default_rng(seed)
    return {"dense/kernel": (rng.normal(size=(spec["in"], spec["out"])) * 0.7).astype("float32"),
            "dense/bias": (rng.normal(size=(spec["out"],)) * 0.1).astype("float32")}


def tf1_loss(variables: dict, x: Any, y: Any) -> Any:
    logits = tf.matmul(x, variables["dense/kernel"]) + variables["dense/bias"]
    return tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(labels=y, logits=logits))


class Tf1Graph:
    """The TF1 graph case, built in the current graph: variables with numpy
    initial values, placeholders, mean softmax cross-entropy, global_step,
    the wrapper's ``minimize`` train op."""

    def __init__(self, case: dict, seed: int):
        self.case = case
        self.variables = {k: tf1.Variable(v, name=k) for k, v in tf1_init(case, seed).items()}
        self.x = tf1.placeholder(tf.float32, [None, case["model"]["in"]], name="x")
        self.y = tf1.placeholder(tf.float32, [None, case["model"]["out"]], name="y")
        self.global_step = tf1.train.get_or_create_global_step()
        self.inner = make_inner(case)
        self.opt = accumulating_optimizer()(self.inner, accumulation_steps(case))
        self.train_op = self.opt.minimize(tf1_loss(self.variables, self.x, self.y), global_step=self.global_step)

    def run(self, sess: Any, data: dict, start: int, stop: int, hook: Callable | None = None) -> None:
        b = self.case["micro_batch"]
        for k in range(start, stop):
            sess.run(self.train_op, {self.x: data["x"][k * b:(k + 1) * b], self.y: data["y"][k * b:(k + 1) * b]})
            if hook is not None and k + 1 == self.case["save_after"]:
                hook()

    def state(self, sess: Any) -> tuple[dict, dict]:
        return tf1_state(self.variables, self.global_step, self.opt, sess.run)


class Tf1Eager:
    """The TF1 eager case: ``tf.Variable``s, an int64 global_step and the
    wrapper, stepped eagerly by ``minimize(loss_fn, var_list, global_step)``;
    ``checkpoint``: ``tf.train.Checkpoint(kernel, bias, global_step, optimizer)``."""

    def __init__(self, case: dict, seed: int):
        self.case = case
        self.variables = {k: tf.Variable(v, name=k) for k, v in tf1_init(case, seed).items()}
        self.global_step = tf.Variable(0, dtype=tf.int64, name="global_step")
        self.inner = make_inner(case)
        self.opt = accumulating_optimizer()(self.inner, accumulation_steps(case))
        self.checkpoint = tf.train.Checkpoint(kernel=self.variables["dense/kernel"], bias=self.variables["dense/bias"],
                                              global_step=self.global_step, optimizer=self.opt)

    def run(self, data: dict, start: int, stop: int, hook: Callable | None = None) -> None:
        b = self.case["micro_batch"]
        for k in range(start, stop):
            xb, yb = tf.constant(data["x"][k * b:(k + 1) * b]), tf.constant(data["y"][k * b:(k + 1) * b])
            self.opt.minimize(lambda: tf1_loss(self.variables, xb, yb), var_list=list(self.variables.values()),
                              global_step=self.global_step)
            if hook is not None and k + 1 == self.case["save_after"]:
                hook()

    def state(self) -> tuple[dict, dict]:
        return tf1_state(self.variables, self.global_step, self.opt, lambda vs: [v.numpy() for v in vs])


def tf1_state(variables: dict, global_step: Any, opt: Any, fetch: Callable) -> tuple[dict, dict]:
    """As :func:`keras_state` for TF1: ``weight.NN`` the model's variables,
    ``var.NN`` ``opt.variables()`` in order, ``named.*`` ``global_step``,
    ``micro_steps``, ``mini_step``, ``window_weight``, ``acc_grads.i``
    (``opt.get_slot(v, "acc_grad")``) and ``named.inner.NN`` the inner
    optimizer's ``variables()``."""
    entries = [(f"weight.{i:02d}", v) for i, v in enumerate(variables.values())]
    entries += [(f"var.{i:02d}", v) for i, v in enumerate(opt.variables())]
    entries.append(("named.global_step", global_step))
    for name in ("micro_steps", "mini_step", "window_weight"):
        v = getattr(opt, name, None)
        if v is not None:
            entries.append((f"named.{name}", v))
    for i, v in enumerate(variables.values()):
        slot = opt.get_slot(v, "acc_grad")
        if slot is not None:
            entries.append((f"named.acc_grads.{i}", slot))
    entries += [(f"named.inner.{i:02d}", v) for i, v in enumerate(opt.inner_optimizer.variables())]
    values = fetch([v for _, v in entries])
    arrays = {key: np.array(value) for (key, _), value in zip(entries, values)}
    names = {key: v.name for key, v in entries if key.startswith(("weight.", "var.", "named.inner."))}
    return arrays, names


CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
"""The instruction sets a manifest records (the kernels oneDNN picks depend on them)."""


def cpu() -> tuple:
    """``(model name, sorted flags among CPU_FLAGS)`` of this machine's CPU
    (``(None, [])`` without ``/proc/cpuinfo``)."""
    import os

    flags, model_name = set(), None
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and model_name is None:
                    model_name = line.split(":", 1)[1].strip()
    return model_name, sorted(flags & set(CPU_FLAGS))
