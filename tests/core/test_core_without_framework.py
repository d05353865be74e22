"""``accum_optimizer.core`` imports and runs a window where no framework can be
imported (keras, tensorflow, tf_keras, jax, torch blocked by a ``sys.meta_path``
finder in a fresh interpreter), and the package's wrappers then name what
to install.

Reference: the window of ``N = 2`` over ``g1 = [1, 2]``, ``g2 = [3, -4]``
hands the inner optimizer ``(g1 + g2) / 2 = [2, -1]`` (by hand).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import importlib.abc, sys

BLOCKED = {"keras", "tensorflow", "tf_keras", "tensorflow_addons", "jax", "jaxlib", "torch"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())

import numpy as np
from accum_optimizer.core import Rules, micro_step
from support.numpy_backend import make_window

w = make_window([(2,)], Rules(2))
for g in ([1.0, 2.0], [3.0, -4.0]):
    micro_step(w.b, w.state, w.rules, [np.array(g)])
print("window", w.inner.calls[0][0][0].tolist(), int(w.inner.iterations.value))

import accum_optimizer
try:
    accum_optimizer.AccumulatingOptimizer("adam")
except ImportError as error:
    print("wrapper", type(error).__name__, error)
print("frameworks", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def test_core_imports_and_runs_a_window_without_any_framework():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "window [2.0, -1.0] 1"
    assert lines[1].startswith("wrapper NoFrameworkError accum_optimizer needs Keras 3"), lines[1]
    assert "neither is installed" in lines[1]
    assert lines[2] == "frameworks []"
