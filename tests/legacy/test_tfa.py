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
