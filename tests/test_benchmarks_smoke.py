"""Smoke test: every benchmark runs at its tiniest size and writes well-formed
output (JSON with the expected keys, a valid PNG, a Markdown table).

It checks that the scripts run, not how fast anything is: no timing is
asserted. One run of ``python -m benchmarks --tiny`` (the entry point `make
bench` uses, with the smallest sizes) is shared by the tests below.
"""

from __future__ import annotations

from families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_tiny")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    return out, proc.stdout


def _load(path: Path) -> dict:
    assert path.is_file(), f"missing {path.name}"
    return json.loads(path.read_text())


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    # The first chunk is IHDR: length 13, then width and height (big-endian).
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"


def _check_env(env: dict) -> None:
    for key in ("tensorflow", "keras", "device", "cpu_count", "python", "date_utc"):
        assert env.get(key), f"env lacks {key}"


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_memory_output(tiny_run):
    out, stdout = tiny_run
    data = _load(out / "memory.json")
    assert data["benchmark"] == "memory" and data["profile"] == "tiny"
    _check_env(data["env"])
    assert data["models"], "no model was measured"
    for kind, m in data["models"].items():
        assert _positive(m["param_bytes"]) and _positive(m["param_count"])
        statuses = {(r["case"], r["n"]): r["result"]["status"] for r in m["runs"]}
        # Our code paths must run; Keras' built-in may be "n/a" in some setups.
        for (case, n), status in statuses.items():
            assert status in (("ok", "n/a", "error", "OOM") if case == "d" else ("ok",)), (case, n, status)
        for row in m["rows"]:
            figs = row["headline_peak"]
            for key in ("a_plain_B", "b_accum_B", "c_plain_NB"):
                assert isinstance(figs[key], int), (kind, row["n"], key, figs[key])
            assert figs["b_over_c"] is None or figs["b_over_c"] > 0
        cost = m["accumulator_cost"]
        assert cost["floor_bytes"] == m["param_bytes"]
        # The accumulators are one copy of the parameters plus int64 bookkeeping.
        assert cost["accum_state_bytes"] >= m["param_bytes"]
    _check_png(out / "memory.png")
    assert "(b)/(c)" in (out / "memory.md").read_text()
    assert "(b)/(c)" in stdout


def test_overhead_output(tiny_run):
    out, stdout = tiny_run
    data = _load(out / "overhead.json")
    assert data["benchmark"] == "overhead"
    _check_env(data["env"])
    assert _positive(data["bandwidth"]["bytes_per_second"])
    assert data["groups"], "no (model, loop, jit) group ran"
    modes = {(g["loop"], g["jit_compile"]) for g in data["groups"]}
    assert {loop for loop, _ in modes} == {"custom", "fit"}
    assert {jit for _, jit in modes} == {False, True}
    for g in data["groups"]:
        assert not g["errors"].get("plain") and "plain" in g["times_s_per_micro_step"]
        for row in g["rows"]:
            assert _positive(row["plain_s"]["median"]) and _positive(row["accum_s"]["median"])
            ratio = row["accum_over_plain"]
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
            if row["n"] == 1:  # Keras' built-in rejects N=1
                assert row["builtin_s"] is None and row["builtin_na"]
        for label, taken in g["micro_steps_taken"].items():
            assert taken >= g["block_micro_steps"] * (g["rounds"] + 1), (label, taken)
    for kind, m in data["models"].items():
        assert _positive(m["floor_seconds"]) and m["floor_bytes"] == 12 * m["param_count"]
    _check_png(out / "overhead.png")
    assert "accum/plain" in stdout


def test_sparse_output(tiny_run):
    out, stdout = tiny_run
    data = _load(out / "sparse.json")
    assert data["benchmark"] == "sparse"
    _check_env(data["env"])
    settings = data["settings"]
    for v in settings["vocab"]:
        for method in ("plain", "accum"):
            r = data["results"][f"{method}/{v}"]
            assert r["status"] == "ok", (method, v, r)
            assert _positive(r["mean_step_s"]) and isinstance(r["delta_bytes"], int)
            assert len(r["times_s"]) == settings["n"] * (settings["windows"] - 1)
        acc = data["results"][f"accum/{v}"]
        assert _positive(acc["accumulate_step_s"]["median"]) and _positive(acc["update_step_s"]["median"])
        assert acc["accumulator_bytes"]["slots"] >= v * settings["dim"] * 4
        assert acc["table_tracker_bytes"] == 2 * v  # the table's float16 row marks
        dense = data["results"][f"accum_dense/{v}"]  # the dense window, side by side
        assert dense["status"] == "ok" and _positive(dense["update_step_s"]["median"])
    assert "accum" in data["scaling"] and "slope" in data["scaling"]["accum"]
    assert "slope" in data["scaling"]["accum/update"]
    _check_png(out / "sparse.png")
    assert "table MiB" in stdout


def test_summary(tiny_run):
    out, _ = tiny_run
    run = _load(out / "run_all.json")
    assert run["failed"] == [] and set(run["seconds"]) == {"memory", "overhead", "sparse"}
    summary = (out / "SUMMARY.md").read_text()
    for name in ("memory", "overhead", "sparse"):
        assert f"![{name}]({name}.png)" in summary
    assert "python -m benchmarks --tiny" in summary
