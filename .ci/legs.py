#!/usr/bin/env python3
"""The test legs, one table: ``make test`` runs ``python3 .ci/legs.py test``.

A *leg* is one virtual environment (one TensorFlow/Keras/backend
combination), installed from pyproject's extras plus the leg's exact pins
(the package itself editable), and the tests that run there. ``LEGS`` below
is the whole table; everything else in this file is how to install and run
it:

    python3 .ci/legs.py list                  # the table
    python3 .ci/legs.py venv k3-jax           # install a leg (only if missing or changed)
    python3 .ci/legs.py run k3-jax [ARGS...]  # its tests (pytest ARGS appended)
    python3 .ci/legs.py test                  # every leg in two lanes, the docs, the feature table

A leg's venv carries a stamp named after a checksum of its Python, extras,
pins and ``pyproject.toml``: changing a pin reinstalls that leg (and only
it); editing ``pyproject.toml`` reinstalls every leg.

``test`` runs the legs in two lanes at once (the CI machines have 2 cores
and a leg keeps about one busy): the legs marked ``lane=1`` in one, in
table order, shown live; the others in the other, each leg's log shown when
it ends. Installs take turns (one lock), so two editable installs never
write the package's metadata at once. It runs every leg even if one fails,
then the docs build (``make docs``: mkdocs --strict) and, for a full run,
the feature-table check, prints one line per leg (pytest's summary, install
and test seconds) and ``legs: N passed, M failed``, and exits 1 if anything
failed. Settings come from the environment, as ``make test`` passes them:
``LEGS`` (names, space-separated), ``TEST_LANES`` (1: one after the other),
``TEST_DOCS`` (empty: no docs build), ``TEST_KEEP_VENVS`` (``no``: remove a
leg's venv once its tests end; CI's disk is shared), ``PYTEST_ARGS``,
``PYTHON`` (the interpreter that creates the venvs), ``VENV``, ``VENVS``.

Which tests a leg runs: every leg that collects ``tests/`` whole sees
core/, contract/ and one folder per family (tests of a family the leg lacks
skip with the reason); ``--leave-out M[,M]`` (tests/conftest.py) deselects
the tests that carry all those markers, leaving -m and -k free for
PYTEST_ARGS. Each test carries its family's marker (keras3, keras2, legacy,
tfa, tf1); every contract test carries ``contract``, and those of weighted
windows, flush, resume and accumulation schedules also ``windows``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("PYTHON") or "python3"
VENV = os.environ.get("VENV") or ".venv"
VENVS = os.environ.get("VENVS") or ".venvs"

# keras-hub (tests/clients/: its tasks trained with the wrapper), one pinned
# version. On TensorFlow (k3) installed as a user would, with every dependency
# (tensorflow-text among them). On JAX and torch without TensorFlow:
# tensorflow-text, one of its requirements, brings TensorFlow, so keras-hub is
# installed --no-deps after the leg's install, and KERAS_HUB_DEPS are its
# other requirements (0.32's METADATA), plus grain, what keras-hub's `fit`
# batches arrays with where TensorFlow is absent.
KERAS_HUB = ["keras-hub==0.32.*"]
KERAS_HUB_DEPS = ["absl-py", "numpy", "packaging", "regex", "rich", "kagglehub!=1.0.1", "kagglesdk==0.1.28",
                  "sentencepiece", "tokenizers", "grain"]

# What every leg runs (no framework needed; the legs that collect tests/
# whole run them as part of it): the framework-free core through the NumPy
# reference backend (tests/support/numpy_backend.py) and its import without
# any framework, the saved layouts (tests/core/test_layout.py), and
# tests/core/test_references.py (the sources read
# statically: every tests/...py path and every API reference of the package,
# docs and tools resolves; no test imports benchmarks or experiments).
EVERY_LEG = ["tests/core/test_window_numpy.py", "tests/core/test_core_without_framework.py",
             "tests/core/test_layout.py", "tests/core/test_references.py"]

# The TF1 family runs whole in tf215 (the oldest TensorFlow the legs have);
# in k3 (the newest) its own folder, tests/tf1/, runs too, its contract cells
# only in tf215 (time budget: the planner's tests came in with issue 21).
TF1_TESTS = ["--leave-out", "tf1"]

OLDEST_CONTRACT = [f"tests/contract/test_{name}.py" for name in (
    "between_updates", "ema", "large_batch", "missing_gradients", "nonfinite", "pass_through", "resume",
    "saved_checkpoints", "strategies")]


@dataclasses.dataclass(frozen=True)
class Leg:
    """One row of the table: where its venv lives, what is installed there
    (``extras`` of pyproject, exact ``pins``, then ``nodeps`` with
    ``--no-deps``), the environment and pytest arguments of its tests, its
    lane, and what it proves."""

    venv: str
    extras: str
    pins: tuple
    args: tuple
    proves: str
    env: tuple = ()  # (name, value) pairs
    nodeps: tuple = ()
    lane: int = 2


LEGS = {
    "k3": Leg(
        venv=VENV, extras="test,demo,keras3,tensorflow", pins=("tensorflow==2.21.*", "keras==3.15.*", *KERAS_HUB),
        # Everything but the TF1 family's contract cells.
        args=("--leave-out", "tf1,contract"), lane=1,
        proves="TF 2.21 + Keras 3.15 (also used by demo/bench): the Keras 3 and TF1 families' folders, Keras 3's "
               "contract cells, core/, the planner, the multi-worker processes, the benchmark smoke run and "
               "tests/clients/"),
    "k3-oldest": Leg(
        venv=f"{VENVS}/k3-oldest", extras="test,keras3,tensorflow", pins=("tensorflow==2.16.2", "keras==3.15.0"),
        args=(*TF1_TESTS, "tests/test_environment.py", *EVERY_LEG, "tests/core/test_arguments.py",
              "tests/core/test_dispatch.py", "tests/core/test_compat.py", "tests/core/test_version.py",
              *OLDEST_CONTRACT, "tests/keras3/test_api.py", "tests/keras3/test_subclass.py"),
        proves="the oldest versions pyproject claims, TF 2.16.2 + Keras 3.15.0 (Keras < 3.15 fails the suite: "
               "README, Compatibility): the contract properties (Keras 3's cells; weighted windows, flush, "
               "accumulation schedules and the fit-level windows prove the shared window logic and run in k3 "
               "only: time budget), the framework-free core, argument validation and dispatch, the "
               "private-symbol fence (core/test_compat.py), the references, Keras 3's API and subclassing"),
    "tfkeras": Leg(
        venv=f"{VENVS}/tfkeras", extras="test,keras2", pins=("tensorflow==2.21.*", "tf_keras==2.21.*"),
        env=(("TF_USE_LEGACY_KERAS", "1"),), args=(*TF1_TESTS, "--leave-out", "legacy,windows"),
        proves="TF 2.21 + tf_keras 2.21: the keras2 and legacy families; the Keras 2 new API's window "
               "contract tests and its multi-worker processes (keras2/test_multiworker.py)"),
    "tf215": Leg(
        # TensorFlow 2.15 has wheels for Python 3.9-3.11 only.
        venv=f"{VENVS}/tf215", extras="test,addons",
        pins=("tensorflow==2.15.1", "tensorflow-addons==0.23.0", "numpy<2"),
        args=("--leave-out", "keras2,windows", "--leave-out", "multiworker"),
        proves="TF 2.15.1 + its Keras 2.15 + tensorflow-addons 0.23: Keras 2, OptimizerV2, tensorflow-addons, "
               "the legacy family's window contract tests, and the TF1 family whole"),
    "k3-jax": Leg(
        venv=f"{VENVS}/k3-jax", extras="test,keras3,plan", pins=("keras==3.15.*", "jax[cpu]==0.10.*", *KERAS_HUB_DEPS),
        nodeps=tuple(KERAS_HUB), env=(("KERAS_BACKEND", "jax"),),
        args=("tests/backends", "tests/clients", "tests/docs", "tests/plan", *EVERY_LEG), lane=1,
        proves="Keras 3.15 on JAX 0.10 (CPU wheels), no TensorFlow: the tests written once with keras.ops and "
               "NumPy (tests/backends/; k3 runs them on TensorFlow), keras-hub's tasks, the planner on JAX "
               "(tests/plan/: XLA's memory analysis, per device on 4 simulated CPU devices), the framework-free "
               "core and the references"),
    "k3-torch": Leg(
        # torch 2.13.0: the CPU build these machines keep on disk (1.1 GB venv,
        # under a minute); any other torch from the index is a CUDA build of 5.5 GB.
        venv=f"{VENVS}/k3-torch", extras="test,keras3,plan",
        pins=("keras==3.15.*", "torch==2.13.0", *KERAS_HUB_DEPS), nodeps=tuple(KERAS_HUB),
        env=(("KERAS_BACKEND", "torch"),),
        args=("tests/backends", "tests/clients", "tests/docs", "tests/plan", *EVERY_LEG), lane=1,
        proves="Keras 3.15 on torch 2.13 (its CPU build), no TensorFlow: tests/backends/, keras-hub's tasks, "
               "the planner's refusal on the CPU (tests/plan/; its CUDA test skips), the framework-free core "
               "and the references"),
}

INSTALL_LOCK = threading.Lock()  # installs take turns
PRINT_LOCK = threading.Lock()


def _stamp(name: str) -> Path:
    leg = LEGS[name]
    key = " ".join([PYTHON, leg.extras, *leg.pins, "--no-deps", *leg.nodeps]).encode()
    key += hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest().encode()
    return ROOT / leg.venv / f".installed-{hashlib.sha256(key).hexdigest()[:12]}"


def _python(name: str) -> str:
    return str(ROOT / LEGS[name].venv / "bin" / "python")


def venv(name: str, out=None) -> int:
    """Install leg ``name`` unless its stamp is current; the exit status."""
    leg, stamp = LEGS[name], _stamp(name)
    if stamp.exists():
        return 0
    for old in (ROOT / leg.venv).glob(".installed*"):
        old.unlink()
    python = _python(name)
    steps = [[PYTHON, "-m", "venv", str(ROOT / leg.venv)],
             [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
             [python, "-m", "pip", "install", "--quiet", "-e", f".[{leg.extras}]", *leg.pins]]
    if leg.nodeps:
        steps.append([python, "-m", "pip", "install", "--quiet", "--no-deps", *leg.nodeps])
    for step in steps:
        print("+", shlex.join(step), file=out or sys.stdout, flush=True)
        rc = subprocess.call(step, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None)
        if rc:
            return rc
    stamp.touch()
    return 0


def run(name: str, extra: list, out=None) -> int:
    """The tests of leg ``name`` (pytest ``extra`` appended); the exit status."""
    leg = LEGS[name]
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update(KERAS_BACKEND="tensorflow", ACCUM_LEG=name, ACCUM_LEG_PINS=" ".join([*leg.pins, *leg.nodeps]),
               ACCUM_PASSED_OUT=str(ROOT / VENVS / f".passed-{name}.txt"))
    env.update(dict(leg.env))
    command = [_python(name), "-m", "pytest", *leg.args, *extra]
    print(f"==== leg {name}: {' '.join(leg.pins)} {' '.join(f'{k}={v}' for k, v in leg.env)}", file=out or sys.stdout,
          flush=True)
    return subprocess.call(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)


def _summary_line(log: str) -> str:
    import re

    lines = [re.sub(r"^=+ | =+$", "", line.strip()) for line in log.splitlines()
             if re.match(r"^(=+ )?[0-9a-z ,]*(passed|failed|skipped|error|no tests ran).* in [0-9.]+s", line.strip())]
    return lines[-1] if lines else "no pytest summary"


def _leg(name: str, live: bool, extra: list, keep: bool, results: dict) -> None:
    log_path = ROOT / VENVS / f".test-{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        with INSTALL_LOCK:
            rc = venv(name, out=log)
        middle = time.monotonic()
        if rc:
            results[name] = f"{name}: install FAILED"
            with PRINT_LOCK:
                print(log_path.read_text(), flush=True)
            return
        if live:
            process = subprocess.Popen([sys.executable, __file__, "run", name, *extra], cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in process.stdout:
                log.write(line)
                with PRINT_LOCK:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            rc = process.wait()
        else:
            log.flush()
            rc = run(name, extra, out=log)
    text = log_path.read_text()
    if not live:
        with PRINT_LOCK:
            print(text, flush=True)
    results[name] = (f"{name}: {'ok' if rc == 0 else 'FAILED'} ({_summary_line(text)}); "
                     f"install {middle - start:.0f} s, tests {time.monotonic() - middle:.0f} s")
    if not keep:
        shutil.rmtree(ROOT / LEGS[name].venv, ignore_errors=True)
        free = shutil.disk_usage(ROOT).free / 2**30
        with PRINT_LOCK:
            print(f"{name}: venv removed (TEST_KEEP_VENVS=no); {free:.1f} GiB free", flush=True)


def test(names: list, lanes: int, docs: bool, keep: bool, extra: list) -> int:
    """Every leg of ``names``, the docs build and the feature table; 0 if all passed."""
    (ROOT / VENVS).mkdir(parents=True, exist_ok=True)
    for old in list((ROOT / VENVS).glob(".passed-*.txt")):
        old.unlink()
    results: dict = {}
    lane1 = [n for n in names if lanes >= 2 and LEGS[n].lane == 1]
    lane2 = [n for n in names if n not in lane1]
    if lane1:
        print(f"==== two lanes at once: [ {' '.join(lane1)} ] (shown live) and [ {' '.join(lane2)} ] (each leg's "
              "log shown when it ends)", flush=True)
        other = threading.Thread(target=lambda: [_leg(n, False, extra, keep, results) for n in lane2])
        other.start()
        for n in lane1:
            _leg(n, True, extra, keep, results)
        other.join()
    else:
        for n in lane2:
            _leg(n, True, extra, keep, results)
    summary = [results.get(n, f"{n}: no result") for n in names]
    failed = sum(not line.startswith(f"{n}: ok (") for n, line in zip(names, summary))
    checks = len(names)
    if docs:
        checks += 1
        start = time.monotonic()
        if subprocess.call(["make", "--no-print-directory", "venv-docs"], cwd=ROOT) == 0:
            middle = time.monotonic()
            print("==== docs: mkdocs build --strict", flush=True)
            rc = subprocess.call(["make", "--no-print-directory", "docs"], cwd=ROOT)
            failed += rc != 0
            summary.append(f"docs: {'ok' if rc == 0 else 'FAILED'}; install {middle - start:.0f} s, "
                           f"build {time.monotonic() - middle:.0f} s")
        else:
            failed += 1
            summary.append("docs: install FAILED")
    if set(names) == set(LEGS) and not extra:
        checks += 1
        print("==== feature table: every 'yes' cell's test passed in some leg", flush=True)
        rc = subprocess.call([PYTHON, "tests/support/features.py", "--check",
                              *(str(Path(VENVS) / f".passed-{n}.txt") for n in LEGS)], cwd=ROOT)
        failed += rc != 0
        summary.append(f"feature table: {'ok' if rc == 0 else 'FAILED'}")
    print("==== make test: one line per leg", *summary, f"legs: {checks - failed} passed, {failed} failed", sep="\n")
    return 1 if failed else 0


def _names(text: str) -> list:
    names = text.split() or list(LEGS)
    unknown = [n for n in names if n not in LEGS]
    if unknown:
        raise SystemExit(f"LEGS: unknown leg(s) {unknown}; the legs are {list(LEGS)}.")
    return names


def main(argv: list) -> int:
    if not argv or argv[0] not in ("list", "venv", "run", "test"):
        print("usage: python3 .ci/legs.py list | venv [LEG ...] | run LEG [PYTEST ARGS ...] | test",
              file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    extra = shlex.split(os.environ.get("PYTEST_ARGS", ""))
    if command == "list":
        for name, leg in LEGS.items():
            print(f"{name:10} {leg.venv:18} {' '.join(leg.pins + leg.nodeps)}\n{'':10} {leg.proves}")
        return 0
    if command == "venv":
        return max([venv(n) for n in _names(" ".join(rest))] or [0])
    if command == "run":
        return run(_names(rest[0])[0], rest[1:] or extra)
    return test(_names(os.environ.get("LEGS", "")), int(os.environ.get("TEST_LANES") or 2),
                bool(os.environ.get("TEST_DOCS", "yes")), os.environ.get("TEST_KEEP_VENVS", "yes") != "no", extra)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
