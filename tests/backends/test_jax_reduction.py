"""One gradient reduction per window under ``keras.distribution.DataParallel`` on JAX.

The compiled train step's optimized HLO and the exactness over four
simulated CPU devices are measured by ``tests/support/jax_reduction.py``
(``python -m support.jax_reduction``) in a fresh process
(``--xla_force_host_platform_device_count=4`` must be set before JAX
starts); the test reads its JSON line. ``benchmarks/jax_reduction.py``
reports the same reading beside its timings. The reference for the weights is one device's
``fit(batch_size=N*B)`` with the plain inner optimizer (no distribution, no
accumulation). The in-process tests use one device (``DataParallel`` over
the single CPU device: the same code path, no reduction to count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3."):
    pytest.skip(f"Keras 3 only (this is Keras {keras.__version__})", allow_module_level=True)

BACKEND = keras.backend.backend()
on_jax = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.DataParallel with shard_map: JAX only")
TOL = 1e-5
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def measured() -> dict:
    """``support.jax_reduction.check()`` on 4 CPU devices (a fresh process:
    this one's JAX has started with 1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, TESTS, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "support.jax_reduction"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@on_jax
def test_accumulate_only_micro_steps_reduce_no_gradient_and_the_update_reduces_it_once(measured):
    """With ``OneReductionPerWindow``: the all-reduces that run on every call
    move < 1% of the parameters (the loss and metric scalars), no other
    collective runs, and the gradient's all-reduce, at least the parameters'
    size, sits inside a conditional's branch (the update). Today's route,
    read the same way, all-reduces the whole gradient on every call: what
    the reading catches."""
    assert measured["devices"] == 4
    new, today = measured["hlo"]["new"], measured["hlo"]["today"]
    assert new["every_call_fraction_of_parameters"] < 0.01, new
    assert new["largest_branch_all_reduce"] >= new["parameters"], new
    assert new["other_collectives"] == [], new
    assert today["every_call_elements"] >= today["parameters"], today


@on_jax
def test_one_reduction_per_window_trains_like_the_single_device_large_batch(measured):
    """``fit`` with the mixin, the custom ``jax.jit`` loop with
    ``device_value_and_grad``, ``fit`` with a ``CountedLoss`` over sample
    weights (``mean_with_sample_weight``: the devices' counts differ) and
    ``fit`` with a ``LossScaleOptimizer`` outside the wrapper (its reference
    plain Adam: float32, the scale only multiplies and divides): N micro-batches of B over 4 devices, against one device's
    ``fit(batch_size=N*B)``; the accumulators hold one slice per device,
    sharded over the batch axis."""
    e = measured["exactness"]
    assert e["updates"] == 6
    assert e["fit_max_abs_diff"] <= TOL, e
    assert e["custom_loop_max_abs_diff"] <= TOL, e
    assert e["counted_loss_max_abs_diff"] <= TOL, e
    assert e["loss_scale_optimizer_max_abs_diff"] <= TOL, e
    assert e["accumulator_shape_of_first_kernel"][0] == 4
    assert e["accumulator_spec_of_first_kernel"].startswith("P('batch'"), e


@on_jax
def test_dropout_and_batchnorm_train_with_their_state_kept_replicated(measured):
    """Dropout and BatchNormalization under the mixin: the seed generator's
    state ends as under Keras' own step (its counter advanced once per
    draw, the per-device offset undone), the moving statistics move, and
    the loss is finite."""
    d = measured["exactness"]["dropout_batchnorm"]
    assert d["mixin"]["seed_state"] == d["keras"]["seed_state"], d
    assert d["mixin"]["moving_mean_moved"], d
    assert np.isfinite(d["mixin"]["loss"]), d


# ------------------------------------------------------------- in-process
def _model(cls):
    keras.utils.set_random_seed(1)
    return cls([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def _mixed():
    from accum_optimizer import OneReductionPerWindow

    class Model(OneReductionPerWindow, keras.Sequential):
        pass

    return Model


class data_parallel:
    """``DataParallel`` over this process' devices (one CPU), reset after."""

    def __enter__(self):
        self.previous = keras.distribution.distribution()
        keras.distribution.set_distribution(keras.distribution.DataParallel())

    def __exit__(self, *exc):
        keras.distribution.set_distribution(self.previous)


@on_jax
def test_on_one_device_the_mixin_trains_like_the_large_batch():
    """``DataParallel`` over one device: the same route (shard_map, one
    slice per device), N = 3 micro-batches of 4 against ``fit(batch_size=12)``."""
    from accum_optimizer import AccumulatingOptimizer

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 5)).astype("float32"), rng.normal(size=(24, 1)).astype("float32")
    reference = _model(keras.Sequential)
    reference.compile(keras.optimizers.Adam(0.01), "mse")
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    with data_parallel():
        model = _model(_mixed())
        model.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3), "mse")
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert [tuple(a.shape) for a in model.optimizer.acc_grads] == [(1, *v.shape) for v in model.trainable_variables]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), model.get_weights()))
    assert diff <= TOL


@on_jax
def test_the_mixin_refuses_a_missing_distribution_and_an_optimizer_that_does_not_accumulate():
    from accum_optimizer import AccumulatingOptimizer

    with pytest.raises(ValueError, match=r"DataParallel.*current distribution is None"):
        _model(_mixed()).compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3), "mse")
    with data_parallel():
        with pytest.raises(TypeError, match=r"needs an accum_optimizer.AccumulatingOptimizer.*Adam"):
            _model(_mixed()).compile(keras.optimizers.Adam(0.01), "mse")


@on_jax
def test_device_accumulators_need_data_parallel_and_an_unbuilt_optimizer():
    from accum_optimizer import AccumulatingOptimizer

    opt = AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3)
    with pytest.raises(ValueError, match="DataParallel"):
        opt.use_device_accumulators()
    with data_parallel():
        model = _model(keras.Sequential)
        opt.build(model.trainable_variables)
        with pytest.raises(ValueError, match="before the optimizer is built"):
            opt.use_device_accumulators()


@pytest.mark.skipif(BACKEND == "jax", reason="the refusal on the other backends (k3-torch)")
def test_on_another_backend_the_mixin_and_the_custom_loop_form_refuse_naming_the_backend():
    from accum_optimizer import AccumulatingOptimizer, device_value_and_grad

    with pytest.raises(NotImplementedError, match=f"JAX backend only; this Keras runs '{BACKEND}'"):
        _model(_mixed()).compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3), "mse")
    with pytest.raises(NotImplementedError, match="JAX backend only"):
        device_value_and_grad(lambda p, x: x)
    with pytest.raises(NotImplementedError, match="JAX backend only"):
        AccumulatingOptimizer(keras.optimizers.Adam(0.01), 3).use_device_accumulators()


@on_jax
def test_the_jax_trainer_private_symbols_resolve_with_a_reason_and_the_versions_checked():
    """The pinning test of :mod:`accum_optimizer._compat.keras3_jax` (on
    TensorFlow, ``tests/core/test_compat.py`` does this for the others)."""
    from accum_optimizer import _compat
    from accum_optimizer._compat import keras3_jax

    entries = [e for e in _compat.REGISTRY if e.probe.__module__ == keras3_jax.__name__]
    assert len(entries) == 2
    for entry in entries:
        assert len(entry.reason) > 40 and "3.15" in entry.checked, entry.symbol
        try:
            entry.probe(keras)
        except Exception as e:  # noqa: BLE001 - the message is the point
            pytest.fail(_compat.message(entry, keras, e))
