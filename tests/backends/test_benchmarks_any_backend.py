"""Smoke test: ``benchmarks.overhead`` and ``benchmarks.memory`` run with
``--backend`` on the leg's JAX or torch backend at their tiniest size and
write well-formed output (no timing or memory figure is asserted: these are
benchmarks, not tests). On TensorFlow, ``tests/keras3/test_benchmarks_smoke.py``
runs every benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3.") or keras.backend.backend() == "tensorflow":
    pytest.skip("JAX and torch (TensorFlow: tests/keras3/test_benchmarks_smoke.py)", allow_module_level=True)
pytest.importorskip("matplotlib")

BACKEND = keras.backend.backend()
ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(module: str, out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--tiny", "--backend", BACKEND, "--out", str(out), *args],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    name = f"{module}_{BACKEND}"
    assert (out / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / f"{name}.md").read_text().count("|") > 10
    data = json.loads((out / f"{name}.json").read_text())
    assert data["benchmark"] == module and data["env"]["keras_backend"] == BACKEND
    assert data["env"][BACKEND]
    return data


def test_overhead_times_plain_accum_and_builtin_side_by_side(tmp_path):
    data = run("overhead", tmp_path, "--models", "cnn")
    assert data["backend"] == BACKEND
    (group,) = data["groups"]
    assert group["loop"] == "fit" and group["jit_compile"] == (BACKEND == "jax")
    rows = {row["n"]: row for row in group["rows"]}
    assert rows[2]["accum_over_builtin"]["ci_low"] <= rows[2]["accum_over_builtin"]["median"]
    assert rows[2]["accum_over_plain"] is not None
    assert group["micro_steps_taken"]["accum N=2"] == group["micro_steps_taken"]["plain"]


def test_memory_measures_the_four_cases(tmp_path):
    data = run("memory", tmp_path)
    assert data["settings"]["backend"] == BACKEND
    for kind, m in data["models"].items():
        runs = {(r["case"], r["n"]): r["result"] for r in m["runs"]}
        for key in (("a", 1), ("b", 2), ("c", 2)):
            assert runs[key]["status"] == "ok", (kind, key, runs[key])
        accumulated = runs[("b", 2)]
        assert accumulated["iterations"] == 1  # one window of 2, then one accumulate-only micro-step
        assert accumulated["accumulator_bytes"]["slots"] == m["param_bytes"]  # one float32 copy of the parameters


def test_mixed_precision_accumulates_within_the_tolerance_and_as_close_as_the_builtin(tmp_path):
    """``experiments.mixed_precision`` at 2 updates: under each mixed policy the
    accumulated weights are within the tests' tolerance of the large batch's
    (:func:`support.precision.mixed_precision_tolerance`), and with a constant
    learning rate (where Keras' built-in accumulation is exact) no further
    from it than the built-in's."""
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.mixed_precision", "--backend", BACKEND, "--updates", "2",
         "--out", str(tmp_path)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    name = f"mixed_precision_{BACKEND}"
    assert (tmp_path / f"{name}.md").read_text().count("|") > 10
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["backend"] == BACKEND and data["env"]["keras_backend"] == BACKEND and data["env"][BACKEND]
    assert data["updates"] == 2 and data["jit_compile"] == (BACKEND == "jax")
    checked = 0
    for r in data["results"]:
        assert r["weights_moved"] > 0, r
        if r["test_tolerance"] is None:  # float32, or a schedule (the tolerance does not apply)
            continue
        assert r["accum_optimizer"] <= r["test_tolerance"], r
        assert r["accum_optimizer"] <= r["keras_builtin"], r
        checked += 1
    assert checked == 4  # Adam and SGD under mixed_float16 and mixed_bfloat16
