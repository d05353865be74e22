"""Smoke test: every benchmark runs at its tiniest size and writes well-formed
output (JSON with the expected keys, a valid PNG, a Markdown table).

It checks that the scripts run, not how fast anything is: no timing is
asserted. One run of ``python -m benchmarks --tiny`` (the entry point `make
bench` uses, with the smallest sizes) is shared by the tests below. The
bootstrap interval the overhead benchmark reports is checked against the
exact bootstrap distribution of a small sample. The benchmarks run as
processes (``python -m benchmarks ...``, ``python -c``): this module imports
none of them.
"""

from __future__ import annotations

from support.families import require

require("keras3")  # first, before Keras is imported: skips the module elsewhere

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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
        # What one micro-batch adds: ((c) - (a)) / (N - 1), from the table's own figures.
        row = m["rows"][0]
        f = row["headline_peak"]
        assert cost["per_micro_batch_headline_peak_bytes"] == pytest.approx(
            (f["c_plain_NB"] - f["a_plain_B"]) / (row["n"] - 1))
        # The accumulators are one copy of the parameters plus int64 bookkeeping.
        assert cost["accum_state_bytes"] >= m["param_bytes"]
    _check_png(out / "memory.png")
    md = (out / "memory.md").read_text()
    assert "(b)/(c)" in md and "what one micro-batch of B=" in md
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
            # Every ratio and the overhead carry the median's bootstrap interval over the rounds.
            for key in ("accum_over_plain", "accum_over_builtin", "accum_minus_plain_s"):
                st = row[key]
                if st is None:
                    assert key == "accum_over_builtin" and row["builtin_s"] is None
                    continue
                assert st["n"] == g["rounds"] and st["confidence"] == 0.95, (key, st)
                assert st["min"] <= st["ci_low"] <= st["median"] <= st["ci_high"] <= st["max"], (key, st)
            assert row["within_3_percent_shown"] == (ratio["ci_high"] <= 1.03)
            if row["n"] == 1:  # Keras' built-in rejects N=1; the wrapper is a pass-through
                assert row["builtin_s"] is None and row["builtin_na"]
                assert row["floor_seconds"] == 0 and row["overhead_over_floor"] is None
            else:
                floor = data["models"][g["model"]]["floor_seconds"]
                assert row["floor_seconds"] == floor
                assert row["overhead_over_floor"] == pytest.approx(row["accum_minus_plain_s"]["median"] / floor)
        for label, taken in g["micro_steps_taken"].items():
            assert taken >= g["block_micro_steps"] * (g["rounds"] + 1), (label, taken)
    for kind, m in data["models"].items():
        assert _positive(m["floor_seconds"]) and m["floor_bytes"] == 12 * m["param_count"]
    # The wide model runs in its own modes (the custom loop, XLA off).
    assert data["models"]["transformer_wide"]["param_count"] > data["models"]["cnn"]["param_count"]
    assert [(g["loop"], g["jit_compile"]) for g in data["groups"] if g["model"] == "transformer_wide"] == [
        ("custom", False)]
    _check_png(out / "overhead.png")
    assert "accum/plain [95% CI]" in stdout and "accum/built-in [95% CI]" in stdout
    assert "accum/plain [95% CI]" in (out / "overhead.md").read_text()


def test_overhead_reports_build_and_trace(tiny_run):
    out, _ = tiny_run
    data = _load(out / "overhead.json")
    for g in data["groups"]:
        for label, seconds in g["build_and_trace_s"].items():
            assert _positive(seconds), (label, seconds)
    md = (out / "overhead.md").read_text()
    assert "build + trace s: plain / accum / built-in" in md and "accum/built-in build + trace" in md
    assert data["env"]["load_average_at_end"] is not None and data["env"]["load_average_at_start"] is not None


def test_step_profile_output(tiny_run):
    """Each micro-step kind's wall times and, with XLA off, its ops as the
    TensorFlow profiler saw them: the accumulate-only micro-step runs no
    inner update (no Adam slot write), the update runs it."""
    out, stdout = tiny_run
    data = _load(out / "step_profile.json")
    assert data["benchmark"] == "step_profile"
    _check_env(data["env"])
    assert {g["jit_compile"] for g in data["groups"]} == {False, True}
    rounds = data["settings"]["rounds"]
    for g in data["groups"]:
        for method in ("accum", "builtin"):
            b = g["build"][method]
            assert _positive(b["trace_s"]) and _positive(b["first_call_s"]) and b["graph"]["functions"] >= 2
            for kind in ("accumulate", "update"):
                assert len(g["times_s"][method][kind]) == rounds and all(map(_positive, g["times_s"][method][kind]))
        for kind in ("accumulate", "update"):
            st = g["accum_over_builtin"][kind]
            assert st["n"] == rounds and st["ci_low"] <= st["median"] <= st["ci_high"]
        if g["jit_compile"]:
            continue
        for method in ("accum", "builtin"):
            ops = g["ops"][method]
            assert ops["accumulate"] and ops["update"], method
            # Adam writes its slots with AssignSubVariableOp / AssignVariableOp on updates only:
            # the accumulate-only micro-step of either optimizer has no AssignSubVariableOp.
            assert "AssignSubVariableOp" not in ops["accumulate"], (method, sorted(ops["accumulate"]))
            assert ops["update"]["AssignSubVariableOp"]["count"] > 0
            assert sum(e["count"] for e in ops["update"].values()) > sum(e["count"] for e in ops["accumulate"].values())
            # From the traced graph: an update runs the inner optimizer's ops on top of what every micro-step runs.
            graph = g["graph_ops"][method]
            assert graph["update"].get("AssignSubVariableOp", 0) > 0 and "AssignSubVariableOp" not in graph["accumulate"]
            assert sum(graph["update"].values()) > sum(graph["accumulate"].values())
    _check_png(out / "step_profile.png")
    md = (out / "step_profile.md").read_text()
    assert "Ops of one accumulate micro-step" in md and "Ops of one update micro-step" in md
    assert "accum/built-in [95% CI]" in stdout


def test_step_profile_self_check_runs_the_builtin_in_both_slots(tmp_path):
    """``--self-check``: Keras' built-in in the ``accum`` slot too. Both
    slots then trace the same graph (op for op, by kind of micro-step),
    which a run of the wrapper against the built-in never does; the report
    says so and names the command that gives it."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_profile", "--tiny", "--self-check", "--rounds", "2", "--out",
         str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = _load(tmp_path / "step_profile.json")
    assert data["settings"]["self_check"] is True and data["settings"]["rounds"] == 2
    for g in data["groups"]:
        assert g["graph_ops"]["accum"] == g["graph_ops"]["builtin"]
        assert g["build"]["accum"]["graph"]["all_ops"] == g["build"]["builtin"]["graph"]["all_ops"]
    md = (tmp_path / "step_profile.md").read_text()
    assert "**Self-check**" in md
    assert "`.venv/bin/python -m benchmarks.step_profile --tiny --rounds 2 --self-check`" in md


def test_step_profile_output_names_no_self_check(tiny_run):
    """The plain run's graphs differ between the slots (the wrapper's own
    ``cond`` and counters), and its report claims no self-check."""
    out, _ = tiny_run
    data = _load(out / "step_profile.json")
    assert data["settings"]["self_check"] is False
    assert all(g["graph_ops"]["accum"] != g["graph_ops"]["builtin"] for g in data["groups"])
    assert "Self-check" not in (out / "step_profile.md").read_text()


def test_bootstrap_interval_matches_exact_bootstrap():
    """The percentile interval of the median of 7 distinct values, against the
    exact bootstrap distribution (all 7**7 resamples equally likely). With
    x1 < ... < x7, the resampled median is x1 iff at least 4 of the 7 draws are
    x1: P = sum_{k>=4} C(7,k) (1/7)^k (6/7)^(7-k) = 8359 / 7**7 = 1.0%; it is
    <= x2 iff at least 4 draws are in {x1, x2}: P = 89168 / 7**7 = 10.8%. So
    the 2.5% quantile is x2, and by symmetry the 97.5% quantile is x6 (not the
    extremes, not the quartiles). 10,000 draws put about 101 +- 10 medians at
    x1, far from the 250 that would move the quantile."""
    from math import comb

    n = 7
    p_x1 = sum(comb(n, k) * 1 * (n - 1) ** (n - k) for k in range(4, n + 1)) / n**n
    p_le_x2 = sum(comb(n, k) * 2**k * (n - 2) ** (n - k) for k in range(4, n + 1)) / n**n
    assert p_x1 < 0.025 < p_le_x2  # the derivation above
    values = [3.0, 0.5, 2.0, 7.0, 1.0, 4.0, 11.0]  # x1..x7 = 0.5, 1, 2, 3, 4, 7, 11
    xs = sorted(values)
    got = _bootstrap_results(values)
    assert got["ci"] == [xs[1], xs[5]]
    assert got["ci_seed5"] == [xs[1], xs[5]]  # not an accident of one seed
    assert got["constant"] == [2.5, 2.5]
    s = got["summary"]
    assert (s["ci_low"], s["median"], s["ci_high"], s["confidence"]) == (xs[1], xs[3], xs[5], 0.95)
    assert "`values` is empty" in got["empty"]
    assert "`confidence`=1.5" in got["confidence"]


# `benchmarks._stats`' statistics (no TensorFlow import), in a process of their own.
_BOOTSTRAP = r"""
import json, sys
from benchmarks import _stats as C

values = json.loads(sys.argv[1])


def error(**kwargs):
    try:
        C.bootstrap_median_ci(**kwargs)
    except ValueError as e:
        return str(e)
    return "no ValueError"


print(json.dumps({
    "ci": C.bootstrap_median_ci(values),
    "ci_seed5": C.bootstrap_median_ci(values, seed=5),
    "constant": C.bootstrap_median_ci([2.5] * 30),
    "summary": C.summarize_with_ci(values),
    "empty": error(values=[]),
    "confidence": error(values=values, confidence=1.5),
}))
"""


def _bootstrap_results(values: list) -> dict:
    proc = subprocess.run([sys.executable, "-c", _BOOTSTRAP, json.dumps(values)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    assert run["failed"] == [] and set(run["seconds"]) == {"memory", "overhead", "sparse", "step_profile"}
    assert run["env"]["load_average_at_start"] and run["env"]["load_average_at_end"]
    summary = (out / "SUMMARY.md").read_text()
    assert "load average (1, 5, 15 min) at start" in summary and ", at end " in summary
    for name in ("memory", "overhead", "sparse", "step_profile"):
        assert f"![{name}]({name}.png)" in summary
    assert "python -m benchmarks --tiny" in summary


def test_batchnorm_quick_run_writes_its_figures_and_the_pooled_rule_matches_the_large_batch(tmp_path):
    """`benchmarks.batchnorm --quick`: its table, JSON, PNG and Markdown, and
    the frozen pass's pooled-statistics error against the large batch's rule
    at float32 rounding (the figure docs/batchnorm.md quotes)."""
    import json

    proc = subprocess.run([sys.executable, "-m", "benchmarks.batchnorm", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in ("batchnorm.json", "batchnorm.png", "batchnorm.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "python -m benchmarks.batchnorm --quick" in (tmp_path / "batchnorm.md").read_text()
    frozen = {way: r["frozen"] for way, r in json.loads((tmp_path / "batchnorm.json").read_text())["ways"].items()}
    # The large batch's own float32 statistics are ~1e-6 from its float64 rule; the pooled ones as close.
    assert frozen["accum-pooled-bn"]["variance_error_vs_rule"] < 1e-5
    assert frozen["accum-pooled-bn"]["mean_error_vs_rule"] < 1e-5
    # Averaging the micro-batch variances misses the spread between their means: low.
    assert frozen["accum-andreped"]["variance_error_vs_rule"] > 10 * frozen["accum-pooled-bn"]["variance_error_vs_rule"]
    assert frozen["accum-plain-bn"]["variance_error_vs_rule"] > 1e-2


def test_update_overlap_tiny_run_writes_its_table_json_and_figure(tmp_path):
    """`benchmarks.update_overlap --tiny`: three variants timed, the three
    ratios with their intervals, the PNG, and the command in the Markdown."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.update_overlap", "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = _load(tmp_path / "update_overlap.json")
    assert data["benchmark"] == "update_overlap" and data["settings"]["rounds"] == 3
    assert set(data["times_s"]) == {"accum", "builtin", "waiting"}
    assert all(len(t[k]) == 3 for t in data["times_s"].values() for k in ("accumulate", "update"))
    for ratio in ("accum/builtin", "waiting/builtin", "accum/waiting"):
        r = data["ratios"][ratio]["update"]
        assert r["ci_low"] <= r["median"] <= r["ci_high"], (ratio, r)
    _check_png(tmp_path / "update_overlap.png")
    assert "python -m benchmarks.update_overlap --tiny" in (tmp_path / "update_overlap.md").read_text()
