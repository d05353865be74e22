"""The Keras 2 families under ``MultiWorkerMirroredStrategy`` (MWMS): two
worker processes on 127.0.0.1, one CPU device each, as in
``keras3/test_multiworker.py`` (the same worker script,
``tests/support/multiworker_worker.py``, its setting
``support/multiworker_setup.py`` and launcher ``support/cluster.py``),
here with ``tf.keras`` = Keras 2: the new optimizer API (``keras2``) and
legacy ``OptimizerV2`` (``legacy``), in ``model.fit`` and a custom loop.

Reference: the plain inner optimizer in this process, no strategy, batch
``N * B`` (``B`` the global micro-batch). The collectives are counted as
they execute (``tests/support/collectives.py``): the gradient all-reduce runs
once per update, never on an accumulate-only micro-step. Beside it, a real
``ParameterServerStrategy`` on a loopback cluster is refused by both
families. One launch (about a minute on 2 CPU cores busy with other jobs);
the tfkeras leg runs it (.ci/legs.py leaves the multi-worker processes out
of tf215: time budget).
"""

from __future__ import annotations
from support.families import require

require("keras2", "legacy")  # first, before Keras is imported: skips the module elsewhere

import functools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from support import multiworker_setup as S
from support.cluster import Cluster, ClusterError, port_clash
from support.reference import make_data, make_mlp, max_abs_diff, train, weights

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiworker

WORKER = ROOT / "tests" / "support" / "multiworker_worker.py"
LAUNCH_TIMEOUT = 300  # seconds

# (scenario, its family); loops: fit and strategy.run in a tf.function (the
# legacy family's custom loop under MirroredStrategy: legacy/test_distribution.py;
# each scenario costs 5 to 20 s of the launch).
ACC = {
    "fit_acc_adam": "keras2",
    "custom_acc_sgd": "keras2",
    "fit_acc_legacyadam": "legacy",
}
CONTROL = "custom_plain_sgd"  # the plain optimizer: a gradient all-reduce every step
OPTIMIZERS = {**S.OPTIMIZERS, **S.LEGACY_OPTIMIZERS}


@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    """The MWMS launch (two workers), and beside it one process that checks
    the refusal of ``ParameterServerStrategy`` on an in-process loopback
    cluster (``multiworker_worker.parameter_server_check``)."""
    out = tmp_path_factory.mktemp("mwms_keras2")
    argv = [str(WORKER), "--out", str(out), "--strategy", "mwms", "--scenarios", ",".join([*ACC, CONTROL])]
    t0 = time.monotonic()
    with Cluster([str(WORKER), "--out", str(out), "--parameter-server"], out / "logs" / "parameter_server", 1,
                 pythonpath=[str(ROOT)]) as parameter_server:
        for attempt in range(2):
            with Cluster(argv, out / "logs" / f"launch.{attempt}", S.WORKERS, pythonpath=[str(ROOT)]) as cluster:
                try:
                    cluster.wait(LAUNCH_TIMEOUT)
                    break
                except ClusterError as e:
                    if attempt == 0 and port_clash(str(e)):
                        continue
                    raise
        parameter_server.wait(LAUNCH_TIMEOUT)
    (out / "launch.json").write_text(json.dumps({"seconds": time.monotonic() - t0, "attempt": attempt}))
    return out


def _results(out: Path, name: str) -> list[dict]:
    paths = [out / f"{name}.worker{i}.json" for i in range(S.WORKERS)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"missing results: {missing}"
    return [json.loads(p.read_text()) for p in paths]


def _arrays(values) -> list:
    return [np.asarray(v, dtype=np.float32) for v in values]


def _inner_variables(opt) -> list:
    return opt.weights if callable(getattr(type(opt), "variables", None)) else list(opt.variables)


# Each run's parameter carries its family's marker (the legacy runs prove
# the legacy cells of docs/features.md).
FAMILY_PARAMS = [pytest.param(n, id=f"{ACC[n]}-{n}", marks=getattr(pytest.mark, ACC[n])) for n in sorted(ACC)]


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    """The plain inner optimizer, one process, no strategy, batch ``N * B``:
    ``fit`` for a fit run, a custom loop otherwise."""
    loop, _, opt_name = name.split("_")
    x, y = make_data(S.N * S.B * S.WINDOWS, seed=S.DATA_SEED[loop])
    model, opt = make_mlp(seed=0), OPTIMIZERS[opt_name]()
    if loop == "fit":
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=S.N * S.B, epochs=1, shuffle=False, verbose=0)
    else:
        train(model, opt, x, y, S.N * S.B, S.WINDOWS)
    return model, opt


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_mwms_training_matches_single_process_large_batch(mwms, name):
    """Both workers end with the weights and every inner variable of the
    single-process large batch, bitwise the same on both."""
    results = _results(mwms, name)
    ref_model, ref_opt = _reference(name)
    ref_vars = weights(_inner_variables(ref_opt))
    for r in results:
        assert r["micro_steps"] == S.N * S.WINDOWS
        assert r["iterations"] == S.WINDOWS == int(ref_opt.iterations.numpy())
        assert max_abs_diff(_arrays(r["weights"]), weights(ref_model)) <= S.TOL
        assert [a.shape for a in _arrays(r["inner_variables"])] == [a.shape for a in ref_vars]
        assert max_abs_diff(_arrays(r["inner_variables"]), ref_vars) <= S.TOL
    assert max_abs_diff(weights(ref_model), weights(make_mlp(seed=0))) > 1e-2  # training moved the weights
    for key in ("weights", "inner_variables"):
        for a, b in zip(_arrays(results[0][key]), _arrays(results[1][key])):
            np.testing.assert_array_equal(a, b, err_msg=key)


def _grad(step: dict) -> tuple:
    return step["grad_launches"], step["grad_elements"]


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_one_gradient_all_reduce_per_update_per_worker(mwms, name):
    """On each worker, the gradient all-reduce executes once per update (one
    packed collective of every parameter) and never on the N - 1
    accumulate-only micro-steps; the plain optimizer (the control) reduces on
    every step, so the counter counts executions."""
    for r in _results(mwms, CONTROL):
        assert [_grad(s) for s in r["per_step"]] == [(1, r["num_params"])] * (S.N * S.WINDOWS)
    for w, r in enumerate(_results(mwms, name)):
        p, steps = r["num_params"], r["per_step"]
        expected = [(1, p) if (k + 1) % S.N == 0 else (0, 0) for k in range(S.N * S.WINDOWS)]
        assert [_grad(s) for s in steps] == expected, (name, w)


@pytest.mark.parametrize("family", ["keras2", "legacy"])
def test_parameter_server_strategy_is_refused(mwms, family):
    """A real ``ParameterServerStrategy`` (one worker and one parameter
    server on 127.0.0.1, in a worker process): plain Keras 2 compiles under
    it; the wrapper of either Keras 2 family refuses it with Keras 3's
    message (why, and what to use), at construction and at build under its
    scope."""
    result = json.loads((mwms / "parameter_server.json").read_text())
    assert result["strategy"].startswith("ParameterServerStrategy")
    prefix = "legacy_" if family == "legacy" else ""
    for when in ("construction", "build"):
        message = result[prefix + when]
        assert message is not None, when
        for words in ("does not support ParameterServerStrategy", "asynchronously",
                      "MirroredStrategy", "MultiWorkerMirroredStrategy"):
            assert words in message, (when, message)
