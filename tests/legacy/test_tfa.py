"""tensorflow-addons: what is its own (every tfa optimizer against the
batch-N·B reference, its wrappers that count ``iterations``, missing
gradients: the tfa cells of tests/contract/).

A tfa wrapper (Lookahead, MovingAverage, SWA) around the accumulating
optimizer is refused before anything moves; reference: the model's
weights before the call (bitwise).

A model compiled with the wrapper around a tfa optimizer, saved as ``.h5``
mid-window, loads in a fresh process with no ``custom_objects`` and resumes
bitwise; reference: the same model trained on, uninterrupted, in this
process (issue 17, bug 1).
"""

from support.families import require

require("tfa")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import tensorflow_addons as tfa  # noqa: E402

from support import reference as R  # noqa: E402
import accum_optimizer  # noqa: E402
from accum_optimizer import AccumulatingOptimizer  # noqa: E402

L = tf.keras.optimizers.legacy
T = tfa.optimizers


@pytest.mark.parametrize("outer", ["Lookahead", "MovingAverage", "SWA"])
def test_tfa_wrapper_around_accumulating_optimizer_is_refused_before_any_weight_moves(outer):
    model = R.dense_model()
    before = [w.numpy() for w in model.weights]
    acc = AccumulatingOptimizer(L.Adam(0.05), gradient_accumulation_steps=2)
    opt = {"Lookahead": T.Lookahead, "MovingAverage": T.MovingAverage, "SWA": T.SWA}[outer](acc)
    step = R.make_train_step(model, opt)
    x, y = R.dense_data(2)
    with pytest.raises(RuntimeError, match=r"AccumulatingOptimizer\(tfa.optimizers.Lookahead\(inner\)"):
        step(tf.constant(x), tf.constant(y))
    for b, w in zip(before, model.weights):
        np.testing.assert_array_equal(b, w.numpy())
    assert not acc.built  # not even the accumulators were made




# The inner optimizers of the issue (AdamW: decoupled weight decay; LazyAdam:
# lazy sparse updates) and a tfa wrapper around a tfa optimizer (two
# registered names, one inside the other's config).
H5_INNERS = {
    "AdamW": lambda: T.AdamW(weight_decay=0.01, learning_rate=0.05),
    "LazyAdam": lambda: T.LazyAdam(0.05),
    "Lookahead(AdamW)": lambda: T.Lookahead(T.AdamW(weight_decay=0.01, learning_rate=0.05), sync_period=2),
}
H5_N, H5_BEFORE, H5_AFTER = 3, 5, 4  # saved mid-window (5 % 3 == 2); the rest crosses an update

# Run by a fresh interpreter: what a user does (import tensorflow_addons and
# accum_optimizer, load_model with no custom_objects), then the continuation.
_LOAD_AND_CONTINUE = """
import json, sys
import numpy as np
import tensorflow as tf
import tensorflow_addons as tfa
import accum_optimizer

data, out = sys.argv[1], sys.argv[2]
with np.load(data) as d:
    x, y = d["x"], d["y"]
results = {}
for i, path in enumerate(sys.argv[3:]):
    model = tf.keras.models.load_model(path)
    opt = model.optimizer
    config = json.loads(json.dumps(opt.get_config()))
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    results[path] = [type(opt).__module__, type(opt.inner_optimizer).__module__, config]
    np.savez(f"{out}_{i}.npz", *model.get_weights(), *opt.get_weights())
print(json.dumps(results))
"""


def test_tfa_h5_model_loads_in_a_fresh_process_and_resumes_bitwise(tmp_path):
    x, y = R.embedding_data(2 * (H5_BEFORE + H5_AFTER))
    cut = 2 * H5_BEFORE
    data = str(tmp_path / "continuation.npz")
    np.savez(data, x=x[cut:], y=y[cut:])
    uninterrupted, configs, paths = [], [], []
    for name, make in H5_INNERS.items():
        model = R.embedding_model()
        model.compile(AccumulatingOptimizer(make(), H5_N), loss="mse")
        model.fit(x[:cut], y[:cut], batch_size=2, epochs=1, verbose=0, shuffle=False)
        paths.append(str(tmp_path / f"{name}.h5"))
        model.save(paths[-1])
        configs.append(json.loads(json.dumps(model.optimizer.get_config())))
        model.fit(x[cut:], y[cut:], batch_size=2, epochs=1, verbose=0, shuffle=False)
        assert int(model.optimizer.iterations.numpy()) == (H5_BEFORE + H5_AFTER) // H5_N
        uninterrupted.append(model.get_weights() + model.optimizer.get_weights())
    root = os.path.dirname(os.path.dirname(os.path.abspath(accum_optimizer.__file__)))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_CONTINUE, data, str(tmp_path / "resumed"), *paths],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for i, (name, path) in enumerate(zip(H5_INNERS, paths)):
        wrapper_module, inner_module, config = results[path]
        assert wrapper_module == "accum_optimizer.families.legacy", name
        assert inner_module.startswith("tensorflow_addons."), (name, inner_module)
        assert config == configs[i], name
        with np.load(str(tmp_path / f"resumed_{i}.npz")) as resumed:
            arrays = [resumed[f"arr_{k}"] for k in range(len(resumed.files))]
        assert len(arrays) == len(uninterrupted[i]), name
        for k, (a, e) in enumerate(zip(arrays, uninterrupted[i])):
            np.testing.assert_array_equal(a, e, err_msg=f"{name}: array {k} after resuming")


# --------------------------------- issue 22: what tfa's own tests find
MP_INNERS = {
    "legacy_adam": lambda: L.Adam(1e-2),
    "tfa_adamw": lambda: T.AdamW(weight_decay=1e-4, learning_rate=1e-2),
    "tfa_sgdw": lambda: T.SGDW(weight_decay=1e-4, learning_rate=0.05, momentum=0.9),
}
MP_B, MP_UPDATES = 8, 10


@pytest.fixture
def mixed_float16():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", sorted(MP_INNERS))
def test_mixed_float16_fit_with_the_loss_scale_optimizer_outside(name, n, mixed_float16):
    """Issue 22, item 2: ``compile`` puts Keras 2's ``LossScaleOptimizer``
    outside the wrapper, and its ``cond`` needs an op from both branches (the
    step failed to build: "Lengths of branch outputs of cond must match").

    Reference: the plain optimizer under the same policy, at batch B (N = 1:
    bitwise) or at batch N·B. Tolerance for N = 2:
    :func:`support.reference.mixed_precision_tolerance`, the first-order
    effect on the weights of gradients that differ by float16 rounding
    (eps = 2**-10: each batch sum of a gradient is rounded to float16 once
    over N·B samples, or once per micro-batch and added in float32),
    accumulated through Adam's normalisation or SGD's momentum over the
    updates; tfa's decoupled weight decay multiplies a weight difference by
    ``1 - weight_decay`` per update, which only shrinks it."""
    make_inner = MP_INNERS[name]
    x, y = R.make_data(n * MP_B * MP_UPDATES)
    recorder = R.UpdateWeights()
    ref = R.make_mlp(0, hidden=16, dtype=None)
    ref.compile(optimizer=make_inner(), loss="mse")
    ref.fit(x, y, batch_size=n * MP_B, shuffle=False, verbose=0, callbacks=[recorder])
    acc = R.make_mlp(0, hidden=16, dtype=None)
    acc.compile(optimizer=AccumulatingOptimizer(make_inner(), n), loss="mse")
    acc.fit(x, y, batch_size=MP_B, shuffle=False, verbose=0)
    outer = acc.optimizer
    assert type(outer).__name__ == "LossScaleOptimizer" and isinstance(outer.inner_optimizer, AccumulatingOptimizer)
    assert acc.layers[0].compute_dtype == "float16" and acc.layers[0].kernel.dtype == "float32"
    wrapper = outer.inner_optimizer
    assert int(wrapper.micro_steps.numpy()) == n * MP_UPDATES
    assert int(wrapper.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == MP_UPDATES
    diff = R.max_abs_diff(R.weights(ref), R.weights(acc))
    if n == 1:
        assert diff == 0.0
        return
    tol = R.mixed_precision_tolerance(make_inner().get_config(), R.epsilon_16("mixed_float16"), recorder.history)
    assert R.max_abs_diff(R.weights(ref), R.weights(R.make_mlp(0, hidden=16))) > tol  # the comparison means something
    assert diff <= tol


def _decay_step(model, opt, decay_var_list, api):
    @tf.function
    def step(x, y):
        if api == "minimize":
            opt.minimize(lambda: R.mse(y, model(x, training=True)), model.trainable_variables,
                         decay_var_list=decay_var_list)
            return
        with tf.GradientTape() as tape:
            loss = R.mse(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables), decay_var_list=decay_var_list)

    return step


@pytest.mark.parametrize("api", ["apply_gradients", "minimize"])
@pytest.mark.parametrize("n", [1, 3])
def test_decay_var_list_decays_the_variables_it_names_once_per_update(n, api):
    """Issue 22, item 3 (``TypeError``: the wrapper's signature dropped it).
    Reference: the plain tfa optimizer's ``apply_gradients`` given the same
    ``decay_var_list``, at batch B (N = 1: bitwise) or batch N·B (within
    1e-5); without the list (every variable decays) the weights differ, so
    the list is honoured. (tfa 0.23's own ``minimize`` drops the list: its
    ``apply_gradients``, which ``minimize`` calls without it, resets it,
    tensorflow/addons#1903; the wrapper's ``minimize`` keeps it, as tfa
    documents.)"""
    updates, b = 3, 2
    x, y = R.dense_data(n * b * updates)

    def run(opt, batch, steps, decay_all=False, api=api):
        model = R.dense_model()
        decay = None if decay_all else [model.layers[0].kernel]
        step = _decay_step(model, opt, decay, api)
        for s in range(steps):
            step(tf.constant(x[s * batch:(s + 1) * batch]), tf.constant(y[s * batch:(s + 1) * batch]))
        return model.get_weights()

    def sgdw():
        return T.SGDW(weight_decay=0.1, learning_rate=0.05, momentum=0.5)

    ref = run(sgdw(), n * b, updates, api="apply_gradients")
    acc_opt = AccumulatingOptimizer(sgdw(), n)
    acc = run(acc_opt, b, n * updates)
    assert int(acc_opt.iterations.numpy()) == updates
    diff = R.max_abs_diff(ref, acc)
    assert diff == 0.0 if n == 1 else diff <= 1e-5
    assert R.max_abs_diff(ref, run(sgdw(), n * b, updates, decay_all=True, api="apply_gradients")) > 100 * 1e-5


def test_decay_var_list_for_an_inner_optimizer_without_decoupled_weight_decay_is_refused():
    model = R.dense_model()
    opt = AccumulatingOptimizer(L.Adam(0.05), 2)
    before = [w.numpy() for w in model.weights]
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    with pytest.raises(TypeError, match=r"decay_var_list.*tensorflow-addons.*Adam"):
        opt.apply_gradients(zip(grads, model.trainable_variables), decay_var_list=[model.layers[0].kernel])
    assert not opt.built and all(np.array_equal(b, w.numpy()) for b, w in zip(before, model.weights))


@pytest.mark.parametrize("update_weights", [True, False])
def test_average_model_checkpoint_saves_the_averages_of_the_moving_average_inside(tmp_path, update_weights):
    """Issue 22, item 6: tfa's ``AverageModelCheckpoint`` refuses a model whose
    optimizer is the documented ``AccumulatingOptimizer(MovingAverage(X), N)``;
    ``accum_optimizer.AverageModelCheckpoint`` is it for that composition.
    Reference: the plain ``MovingAverage`` at batch N·B with tfa's callback:
    the saved (averaged) weights and the model's weights after ``fit``,
    within 1e-5; the averages differ from the weights, so averaging was
    saved."""
    n, b, updates = 3, 2, 4
    x, y = R.dense_data(n * b * updates)

    def fit(opt, batch, callback_class):
        model = R.dense_model()
        model.compile(opt, loss="mse")
        path = str(tmp_path / f"{callback_class.__module__}_{update_weights}.h5")
        callback = callback_class(update_weights=update_weights, filepath=path, save_weights_only=True)
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
        saved = R.dense_model()
        saved.load_weights(path)
        return saved.get_weights(), model.get_weights()

    def moving_average():
        return T.MovingAverage(L.SGD(0.1, momentum=0.5), average_decay=0.5)

    ref_saved, ref_model = fit(moving_average(), n * b, tfa.callbacks.AverageModelCheckpoint)
    acc_saved, acc_model = fit(AccumulatingOptimizer(moving_average(), n), b, accum_optimizer.AverageModelCheckpoint)
    assert R.max_abs_diff(ref_saved, acc_saved) <= 1e-5 and R.max_abs_diff(ref_model, acc_model) <= 1e-5
    model = R.dense_model()
    model.compile(AccumulatingOptimizer(moving_average(), n), loss="mse")
    if not update_weights:
        assert R.max_abs_diff(acc_saved, acc_model) > 100 * 1e-5
    with pytest.raises(TypeError, match="MovingAverage"):  # tfa's own callback, unchanged
        model.fit(x[:b], y[:b], batch_size=b, verbose=0, callbacks=[
            tfa.callbacks.AverageModelCheckpoint(update_weights=True, filepath=str(tmp_path / "x.h5"))])


@pytest.mark.parametrize("average", ["MovingAverage", "SWA"])
def test_assign_average_vars_through_the_wrapper_gives_the_large_batch_averages(average):
    """tfa's documented end of training, ``opt.assign_average_vars(model.variables)``,
    on ``AccumulatingOptimizer(MovingAverage(X) or SWA(X), N)`` (it raised
    ``AttributeError``): the inner optimizer's public method, reached
    through the wrapper. Reference: the plain tfa optimizer trained on the
    large batch (N·B) and the same call: the model's variables within 1e-5;
    the averages differ from the trained weights, so the call assigned
    something."""
    n, b, updates = 3, 2, 4
    x, y = R.dense_data(n * b * updates)

    def averaged():
        if average == "MovingAverage":
            return T.MovingAverage(L.SGD(0.1, momentum=0.5), average_decay=0.5)
        return T.SWA(L.SGD(0.1, momentum=0.5), start_averaging=1, average_period=1)

    reference = averaged()
    ref_model = R.train(R.dense_model(), reference, x, y, n * b, updates)
    reference.assign_average_vars(ref_model.variables)

    wrapper = AccumulatingOptimizer(averaged(), n)
    model = R.train(R.dense_model(), wrapper, x, y, b, n * updates)
    trained = model.get_weights()
    wrapper.assign_average_vars(model.variables)
    assert R.max_abs_diff(ref_model.get_weights(), model.get_weights()) <= 1e-5
    assert R.max_abs_diff(trained, model.get_weights()) > 100 * 1e-5
