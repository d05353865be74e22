"""Smoke test of examples/tf1_session.py at tiny settings.

It checks that the example runs and that its verdict follows its own
comparison (the equivalence itself is tested in tests/contract/): exit status 0
when the accumulating run matches the plain batch-N*B run, 1 on drift.
"""

from support.families import require

require("tf1")

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("sklearn")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tf1_session.py"


def _example():
    spec = importlib.util.spec_from_file_location("tf1_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_the_options():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--epochs", "--micro-batch", "--steps", "--tolerance", "--tf1-behavior"):
        assert flag in proc.stdout


def test_tiny_run_matches_and_reports(capsys):
    """One epoch, B=64, N=2 (10 updates): exit status 0, both runs made 10
    updates, and the printed difference is within the tolerance."""
    assert _example().main(["--epochs", "1", "--micro-batch", "64", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("plain", "accum"))}
    assert lines["plain,"][3:5] == ["10", "10"]  # sess.run, global_step
    assert lines["accum,"][5:7] == ["20", "10"]
    assert "max |weight difference|" in out


def test_drift_exits_with_status_one(monkeypatch, capsys):
    """If the runs' weights differ beyond --tolerance, the exit status is 1."""
    example = _example()
    import numpy as np

    def fake_train(args, accumulate, train_data, test_data):
        w = {"k": np.full(2, 1.0 if accumulate else 0.0, "float32")}
        return {"weights": w, "loss": 0.0, "test_acc": 0.0, "global_step": 1, "runs": 1, "seconds": 0.0}

    monkeypatch.setattr(example, "train", fake_train)
    assert example.main(["--tolerance", "0.5"]) == 1
    assert "FAIL" in capsys.readouterr().err
