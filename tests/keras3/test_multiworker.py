"""Accumulation across processes: ``MultiWorkerMirroredStrategy`` (MWMS) with
two worker processes on 127.0.0.1, and preemption with ``BackupAndRestore``.

Each worker is a separate Python process (``tests/support/multiworker_worker.py``)
with one CPU device, started by ``tests/support/cluster.py`` with a
``TF_CONFIG`` naming two free loopback ports; so the strategy has 2 replicas,
one per process. To keep the time down, one launch runs many scenarios and
writes one JSON file per scenario and worker; the tests below read them and
compare with a reference this process computes itself: the plain inner
optimizer, one process, no strategy, batch ``N * B`` (``B`` is the global
micro-batch, ``B / 2`` per worker). Every launch has a timeout, and every
worker process group is SIGKILLed when its launch ends, normally or not.

Launches (module fixtures; about 3 minutes in all, references included, on
2 CPU cores shared with other jobs):

* MWMS 1: the training scenarios (``fit`` and custom loops, SGD with
  momentum, Adam, AdamW with EMA and a schedule; plain and Keras' built-in
  accumulation for comparison; the no-merge-call path), then the wrapper's
  preempted run: worker 1 is SIGKILLed right after a mid-window backup and
  worker 0, left alone, must end by itself.
* MWMS 2: both workers restart and ``fit`` resumes from the backups.
* One host, ``MirroredStrategy`` over 2 logical CPUs, one process: the
  same mid-window preemption with SIGKILL and restart (2 launches), plain
  Keras and an epoch-boundary backup interrupted and resumed in the
  process, and ``ParameterServerStrategy`` on an in-process loopback
  cluster.

Keras 3.15's ``fit`` fails under MWMS for every optimizer
(keras-team/keras#20585); the workers apply ``keras_fit_workaround`` from
``examples/multiworker.py`` (a wrapper around that strategy object's
``reduce``), as users must.
"""

from __future__ import annotations
from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import functools
import json
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from support import multiworker_setup as S
from support.cluster import Cluster, ClusterError, port_clash
from support.reference import make_data, make_mlp, max_abs_diff, train, weights

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiworker

WORKER = ROOT / "tests" / "support" / "multiworker_worker.py"
LAUNCH_TIMEOUT = 420  # seconds per launch (a launch takes 20-120 s on 2 busy cores)
SURVIVOR_TIMEOUT = 120  # seconds the survivor of a SIGKILL may take to end by itself

OPTIMIZERS = sorted(S.OPTIMIZERS)
# fit with the three optimizers; custom loops with SGD (whose step scales
# with the gradient: the loss-scaling check) and AdamW + EMA + schedule.
ACC = [f"fit_acc_{o}" for o in OPTIMIZERS] + ["custom_acc_sgd", "custom_acc_adamw"]
SCENARIOS = ACC + [
    "eager_acc_adam",
    "custom_nomerge_adam", "fit_nomerge_adam",
    "custom_plain_sgd", "fit_plain_adam",
    "custom_builtin_adam", "fit_builtin_adam", "eager_builtin_adam",
]

# --------------------------------------------------------------- launching
def _launch(out: Path, name: str, args: list, num_workers: int, strategy: str,
            kill_after: str | None = None) -> dict:
    """One launch of the worker script. With ``kill_after=run``: wait until
    every worker has written ``<run>.backed_up.worker<i>``, SIGKILL the
    victim, give the survivor (MWMS) up to SURVIVOR_TIMEOUT s to end by
    itself, then SIGKILL whatever is left. Retried once with new ports if
    another process took one of them in between."""
    argv = [str(WORKER), "--out", str(out), "--strategy", strategy, *args]
    for attempt in range(2):
        info = {}
        with Cluster(argv, out / "logs" / f"{name}.{attempt}", num_workers, pythonpath=[str(ROOT)]) as cluster:
            try:
                t0 = time.monotonic()
                if kill_after is None:
                    cluster.wait(LAUNCH_TIMEOUT)
                else:
                    for i in range(num_workers):
                        cluster.wait_for_file(out / f"{kill_after}.backed_up.worker{i}", LAUNCH_TIMEOUT)
                    victim = S.VICTIM if num_workers > 1 else 0
                    cluster.kill(victim)
                    if num_workers > 1:
                        t_kill = time.monotonic()
                        survivor = 1 - victim
                        while cluster.returncode(survivor) is None and time.monotonic() - t_kill < SURVIVOR_TIMEOUT:
                            time.sleep(0.2)
                        info["survivor_exit"] = cluster.returncode(survivor)
                        info["survivor_seconds"] = time.monotonic() - t_kill
                        info["survivor_log"] = cluster.log_path(survivor).read_text(errors="replace")[-3000:]
                info["seconds"] = time.monotonic() - t0
                info["attempt"] = attempt
                return info
            except ClusterError as e:
                if attempt == 0 and port_clash(str(e)):
                    continue
                raise

@pytest.fixture(scope="module")
def mwms(tmp_path_factory):
    out = tmp_path_factory.mktemp("mwms")
    info = {
        "launch1": _launch(out, "launch1", ["--scenarios", ",".join(SCENARIOS), "--start", "acc_mid"],
                           2, "mwms", kill_after="acc_mid"),
        "launch2": _launch(out, "launch2", ["--resume", "acc_mid"], 2, "mwms"),
    }
    (out / "launches.json").write_text(json.dumps(info, indent=1))
    return out, info

@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrored")
    info = {
        "launch1": _launch(out, "launch1", ["--uninterrupted", "acc_epoch", "--replay", "plain_mid,acc_epoch",
                                            "--start", "acc_mid"], 1, "mirrored", kill_after="acc_mid"),
        "launch2": _launch(out, "launch2", ["--resume", "acc_mid", "--parameter-server"], 1, "mirrored"),
    }
    (out / "launches.json").write_text(json.dumps(info, indent=1))
    return out, info

def _results(out: Path, name: str, workers: int = S.WORKERS) -> list[dict]:
    """Every worker's results of one scenario or run."""
    paths = [out / f"{name}.worker{i}.json" for i in range(workers)]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"missing results: {missing}"
    return [json.loads(p.read_text()) for p in paths]

def _arrays(values) -> list:
    return [np.asarray(v, dtype=np.float32) for v in values]

def _assert_workers_identical(results: list[dict]) -> None:
    assert len(results) == S.WORKERS
    for key in ("weights", "inner_variables"):
        for a, b in zip(_arrays(results[0][key]), _arrays(results[1][key])):
            np.testing.assert_array_equal(a, b, err_msg=key)

def _kind_and_shape(path: str, array) -> tuple:
    # "adam/sequential_dense_kernel_momentum" -> ("momentum", shape)
    return path.split("/")[-1].rsplit("_", 1)[-1], np.shape(array)

# --------------------------------------------------------------- references
@functools.lru_cache(maxsize=None)
def _reference(loop: str, opt_name: str, batch: int, steps: int, seed: int):
    """The plain inner optimizer, one process, no strategy: ``steps`` steps of
    ``batch`` samples, through ``fit`` for a fit run (``fit`` ends by
    writing the EMA into the weights) or a custom loop otherwise."""
    x, y = make_data(steps * batch, seed=seed)
    model, opt = make_mlp(seed=0), S.OPTIMIZERS[opt_name]()
    if loop == "fit":
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    else:
        train(model, opt, x, y, batch, steps)
    return model, opt

def _large_batch_reference(name: str):
    loop, _, opt_name = name.split("_")
    return _reference(loop, opt_name, S.N * S.B, S.WINDOWS, S.DATA_SEED[loop])

# --------------------------------------------------------------------------
# 1. Training under MWMS == one process at the global batch N * B * workers
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ACC + ["eager_acc_adam", "custom_nomerge_adam", "fit_nomerge_adam"])
def test_mwms_training_matches_single_process_large_batch(mwms, name):
    out, _ = mwms
    results = _results(out, name)
    ref_model, ref_opt = _large_batch_reference(name)

    for r in results:
        assert r["micro_steps"] == S.N * S.WINDOWS
        assert r["iterations"] == S.WINDOWS == int(ref_opt.iterations.numpy())
        assert max_abs_diff(_arrays(r["weights"]), weights(ref_model)) <= S.TOL
        # The inner optimizer's state (moments, EMA shadows, iterations),
        # variable by variable.
        ref_vars = weights(ref_opt.variables)
        assert [_kind_and_shape(p, a) for p, a in zip(r["inner_variable_paths"], r["inner_variables"])] == [
            _kind_and_shape(v.path, a) for v, a in zip(ref_opt.variables, ref_vars)]
        assert max_abs_diff(_arrays(r["inner_variables"]), ref_vars) <= S.TOL
    # Training moved the weights, so the comparison means something.
    assert max_abs_diff(weights(ref_model), weights(make_mlp(seed=0))) > 1e-2
    _assert_workers_identical(results)

def test_custom_loop_loss_scaling_counts_each_sample_once(mwms):
    """``compute_average_loss(global_batch_size=B)`` with B the GLOBAL
    micro-batch, and the wrapper's ``reduction="mean"``: the gradient of the
    mean over the window's N * B samples. With SGD (whose step scales with
    the gradient, unlike Adam's) an effective learning rate off by the number
    of replicas R, by N or by R * N -- a global batch counted twice or not at
    all -- is far outside the tolerance."""
    out, _ = mwms
    r = _results(out, "custom_acc_sgd")[0]
    got = _arrays(r["weights"])
    ref_model, _ = _large_batch_reference("custom_acc_sgd")
    assert max_abs_diff(got, weights(ref_model)) <= S.TOL

    x, y = make_data(S.WINDOWS * S.N * S.B, seed=S.DATA_SEED["custom"])
    lr = float(S.OPTIMIZERS["sgd"]().learning_rate.numpy())
    for factor in (S.WORKERS, 1 / S.WORKERS, S.N, 1 / S.N, S.WORKERS * S.N):
        wrong = train(make_mlp(seed=0), keras.optimizers.SGD(lr * factor, momentum=0.9), x, y, S.N * S.B, S.WINDOWS)
        assert max_abs_diff(got, weights(wrong)) > 100 * S.TOL, factor

# --------------------------------------------------------------------------
# 2. One gradient all-reduce per update, counted
# --------------------------------------------------------------------------
def _grad(step: dict) -> tuple:
    return step["grad_launches"], step["grad_elements"]

def _other(step: dict) -> tuple:
    return step["all_launches"] - step["grad_launches"], step["all_elements"] - step["grad_elements"]

def test_plain_mwms_all_reduces_gradients_every_step(mwms):
    """The control: plain optimizers under MWMS reduce the gradients on
    every step, so the counter counts executions (each step is traced once)
    and would catch a reduction on an accumulate-only micro-step."""
    out, _ = mwms
    for name in ("custom_plain_sgd", "fit_plain_adam"):
        for r in _results(out, name):
            p = r["num_params"]
            assert [_grad(s) for s in r["per_step"]] == [(1, p)] * (S.N * S.WINDOWS), name

@pytest.mark.parametrize("name, control", [
    ("custom_acc_sgd", "custom_plain_sgd"),
    ("fit_acc_adam", "fit_plain_adam"),
    ("custom_nomerge_adam", None),
    ("fit_nomerge_adam", None),
    ("eager_acc_adam", None),
])
def test_one_gradient_all_reduce_per_update_per_worker(mwms, name, control):
    out, _ = mwms
    for w, r in enumerate(_results(out, name)):
        p = r["num_params"]
        steps = r["per_step"]
        assert len(steps) == S.N * S.WINDOWS
        for k, step in enumerate(steps):
            launches, elements = _grad(step)
            if (k + 1) % S.N:  # accumulate-only micro-step: nothing reduced
                assert (launches, elements) == (0, 0), (name, w, k)
            else:  # update: the window's gradient, once: one packed collective in
                # a tf.function, one per variable eagerly
                per_variable = len(r["weights"])  # (the MLP's weights are all trainable)
                assert elements == p and launches == (per_variable if name.startswith("eager") else 1), (name, w, k)
        bytes_per_window = sum(s["grad_bytes"] for s in steps) / S.WINDOWS
        assert bytes_per_window == 4 * p  # float32
        if control is not None:
            c = _results(out, control)[w]
            assert sum(s["grad_bytes"] for s in c["per_step"]) / S.WINDOWS == S.N * bytes_per_window
            # The wrapper adds no collective of its own: the other reductions
            # (Keras' per-step loss, the distributed dataset's end-of-data
            # check) are the plain run's, step by step.
            assert [_other(s) for s in steps] == [_other(s) for s in c["per_step"]]

def test_keras_builtin_accumulation_under_mwms(mwms):
    """Keras' own ``gradient_accumulation_steps`` under MWMS: in a
    ``tf.function`` (custom loop or ``fit``) it raises, because its update
    ``cond`` holds a ``merge_call``; eagerly it runs, and reduces once per
    update too (one collective per variable, as eager MWMS does). If a future
    Keras changes this, this test fails and the README needs revisiting."""
    out, _ = mwms
    for name in ("custom_builtin_adam", "fit_builtin_adam"):
        for r in _results(out, name):
            assert r["runs"] is False
            assert "RuntimeError" in r["error"] and "merge_call" in r["error"], r["error"]
    ref_model, _ = _large_batch_reference("eager_acc_adam")
    for r in _results(out, "eager_builtin_adam"):
        assert r["runs"] is True
        p = r["num_params"]
        assert [_grad(s)[1] for s in r["per_step"]] == [0, 0, 0, p] * S.WINDOWS
        assert max_abs_diff(_arrays(r["weights"]), weights(ref_model)) <= S.TOL

# --------------------------------------------------------------------------
# 3. Preemption: BackupAndRestore, SIGKILL, restart, resume
# --------------------------------------------------------------------------
def _micro_batch_order(run: str) -> list[int]:
    """The micro-batches (indices into one epoch) that fit trains on, in
    order, for a run killed after its backup and resumed. Keras 3.15's
    BackupAndRestore restores the state of the backup and restarts the
    interrupted epoch from its FIRST batch: after the backup at batch b of
    epoch e, batches 0..b of epoch e are trained again."""
    epoch, batch = S.PREEMPT_RUNS[run]["kill"]
    one = list(range(S.STEPS_PER_EPOCH))
    if batch == "end":  # backup at the end of the epoch: nothing replayed
        return one * S.PREEMPT_EPOCHS
    return one * epoch + one[: batch + 1] + one * (S.PREEMPT_EPOCHS - epoch)

def _preempt_reference(run: str, order: list[int]):
    return _preempt_reference_cached(run, tuple(order))

@functools.lru_cache(maxsize=None)
def _preempt_reference_cached(run: str, order: tuple):
    """One process, no strategy, the plain inner optimizer through ``fit``, on
    the micro-batches of ``order``: one step per micro-batch for a plain run;
    for an accumulating run one step per N consecutive micro-batches (their
    union is the large batch), the last partial group left out (it is the
    window still open in the accumulators)."""
    x, y = make_data(S.STEPS_PER_EPOCH * S.B, seed=S.PREEMPT_DATA_SEED)
    group = S.N if S.PREEMPT_RUNS[run]["accumulate"] else 1
    full = len(order) // group * group
    idx = np.concatenate([np.arange(k * S.B, (k + 1) * S.B) for k in order[:full]])
    model, opt = make_mlp(seed=0), S.OPTIMIZERS[S.PREEMPT_OPTIMIZER]()
    model.compile(optimizer=opt, loss="mse")
    model.fit(x[idx], y[idx], batch_size=group * S.B, epochs=1, shuffle=False, verbose=0)
    open_window = order[full:]
    return model, opt, (x, y), open_window

def _window_gradient_sum(model_weights, x, y, micro_batches) -> list:
    """Sum over ``micro_batches`` of the gradient of the micro-batch's mean
    loss at ``model_weights``: what the accumulators hold, summed over
    replicas, for an open window (each replica adds grad/R of its half)."""
    model = make_mlp(seed=0)
    model.set_weights(model_weights)
    total = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
    for k in micro_batches:
        xb, yb = x[k * S.B:(k + 1) * S.B], y[k * S.B:(k + 1) * S.B]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(yb - model(xb, training=False)))
        g = [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]
        total = [a + b for a, b in zip(total, g)]
    return total

def _assert_preempted_run_matches(out: Path, run: str, workers: int):
    results = _results(out, f"preempt_{run}", workers)
    order = _micro_batch_order(run)
    ref_model, ref_opt, (x, y), open_window = _preempt_reference(run, order)
    epoch, batch = S.PREEMPT_RUNS[run]["kill"]
    killed_at = epoch * S.STEPS_PER_EPOCH + (S.STEPS_PER_EPOCH if batch == "end" else batch + 1)
    accumulate = S.PREEMPT_RUNS[run]["accumulate"]
    for r in results:
        # What the backup held and where fit went on.
        restored = r["restored"]
        if accumulate:
            assert restored["micro_steps"] == killed_at
            assert restored["iterations"] == killed_at // S.N
        else:
            assert restored["iterations"] == killed_at
        assert restored["initial_epoch"] == (epoch + 1 if batch == "end" else epoch)
        assert r["first_batch"] == [restored["initial_epoch"], 0]
        # The finished run equals the computed one.
        assert max_abs_diff(_arrays(r["weights"]), weights(ref_model)) <= S.TOL
        assert max_abs_diff(_arrays(r["inner_variables"]), weights(ref_opt.variables)) <= S.TOL
        assert r["iterations"] == int(ref_opt.iterations.numpy())
        if accumulate:
            assert r["micro_steps"] == len(order)
            expected = _window_gradient_sum(ref_model.get_weights(), x, y, open_window)
            assert max_abs_diff(_arrays(r["acc_grads_sum"]), expected) <= S.TOL
    if workers > 1:
        _assert_workers_identical(results)
    return results, ref_model, order

def _uninterrupted(run: str):
    """The same fit, never interrupted (the computed reference of the
    kill-free micro-batch order)."""
    model, _, _, _ = _preempt_reference(run, list(range(S.STEPS_PER_EPOCH)) * S.PREEMPT_EPOCHS)
    return model

@pytest.mark.parametrize("where", ["mwms", "mirrored"])
def test_preempted_mid_window_keeps_the_partial_window(request, where):
    """SIGKILL right after a backup that holds a partial window (micro_steps
    15, N = 4: 3 micro-batches accumulated), restart, resume. The partial
    window is KEPT: restored with the rest of the state (under distribution
    each replica gets 1/R of the saved sum, so the window's all-reduce counts
    it once) and completed by the first micro-batch fit trains after the
    restart, the first batch of the interrupted epoch. The finished weights
    equal the plain optimizer trained on that micro-batch order, N at a time,
    and the window still open at the end holds exactly its gradients."""
    out, info = request.getfixturevalue(where)
    workers = S.WORKERS if where == "mwms" else 1
    _, ref_model, order = _assert_preempted_run_matches(out, "acc_mid", workers)
    assert len(order) % S.N == 3  # the open window at the end is partial too
    # The replay matters: an uninterrupted run ends elsewhere.
    assert max_abs_diff(weights(ref_model), weights(_uninterrupted("acc_mid"))) > 1e-3

def test_plain_keras_restarts_the_interrupted_epoch_from_its_first_batch(mirrored):
    """What plain Keras 3.15 does with the same backup (one host; interrupted
    in the process after the backup, resumed with a new model and
    optimizer): it restores the state and trains the interrupted epoch again
    from its first batch, so batches 0..6 of epoch 1 count twice. The
    wrapper's kept window follows the same rule at micro-batch granularity."""
    out, _ = mirrored
    _, ref_model, _ = _assert_preempted_run_matches(out, "plain_mid", 1)
    assert max_abs_diff(weights(ref_model), weights(_uninterrupted("plain_mid"))) > 1e-3

def test_resume_from_an_epoch_boundary_is_bitwise_uninterrupted(mirrored):
    """Where plain Keras resumes exactly -- from a backup at the end of an
    epoch -- the wrapper does too (one host, 2 replicas; interrupted after
    the backup at the end of epoch 0 and resumed with a new model and
    optimizer): the finished weights, the inner optimizer's state, the
    accumulators and the counters equal the uninterrupted run's bit for
    bit."""
    out, _ = mirrored
    (resumed,), _, _ = _assert_preempted_run_matches(out, "acc_epoch", 1)
    (uninterrupted,) = _results(out, "uninterrupted_acc_epoch", 1)
    assert resumed["restored"]["micro_steps"] == S.STEPS_PER_EPOCH
    for key in ("weights", "inner_variables", "acc_grads_sum"):
        for a, b in zip(_arrays(resumed[key]), _arrays(uninterrupted[key])):
            np.testing.assert_array_equal(a, b, err_msg=key)
    assert (resumed["micro_steps"], resumed["iterations"]) == (
        uninterrupted["micro_steps"], uninterrupted["iterations"])

def test_the_surviving_worker_ends_by_itself_after_its_peer_is_killed(mwms):
    """Worker 1 is SIGKILLed; worker 0 is left alone. It must not hang: the
    coordination service notices the missing peer and the process exits
    with an error within SURVIVOR_TIMEOUT seconds (a cluster manager then
    restarts both, which is what launch 2 does)."""
    _, info = mwms
    launch = info["launch1"]
    assert launch["survivor_exit"] not in (None, 0), launch
    assert launch["survivor_seconds"] < SURVIVOR_TIMEOUT

# --------------------------------------------------------------------------
# 4. Strategies that cannot work are refused
# --------------------------------------------------------------------------
def test_parameter_server_strategy_is_refused(mirrored):
    """A real ``ParameterServerStrategy`` (one worker and one parameter
    server on 127.0.0.1, in the worker process): plain Keras compiles under
    it; the wrapper refuses it with a message saying why and what to use,
    at construction under its scope and at build under its scope."""
    out, _ = mirrored
    result = json.loads((out / "parameter_server.json").read_text())
    assert result["strategy"] == "ParameterServerStrategyV2"
    for when in ("construction", "build"):
        message = result[when]
        assert message is not None, when
        for words in ("does not support ParameterServerStrategy", "asynchronously",
                      "MirroredStrategy", "MultiWorkerMirroredStrategy"):
            assert words in message, (when, message)
