"""Keras 3 on JAX or torch needs nothing of TensorFlow, even where it is
installed (keras-hub installs it):

* ``import accum_optimizer`` and a wrapper trained with it, the planner's
  ``--help`` and the package's lazily resolved names never try to import
  ``tensorflow``. Each runs in a fresh process with an import hook that
  records (and refuses) every attempt, so the check fails in a leg without
  TensorFlow too, where ``"tensorflow" in sys.modules`` could never be true.
* The planner plans on JAX, and refuses torch without CUDA before its first
  probe, without trying to import TensorFlow.
* ``python -m accum_optimizer._compat`` lists every record and exits 0.

The subprocess checks run under each non-TensorFlow backend installed here
(JAX in k3-jax, torch in k3-torch); the in-process ones where the running
backend is one of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

keras = pytest.importorskip("keras")
if not keras.__version__.startswith("3."):
    pytest.skip(f"Keras 3 only (this is Keras {keras.__version__})", allow_module_level=True)

BACKEND = keras.backend.backend()
OTHER_BACKENDS = [b for b in ("jax", "torch") if importlib.util.find_spec(b) is not None]
needs_other_backend = pytest.mark.skipif(
    not OTHER_BACKENDS, reason="neither JAX nor torch is installed in this leg (k3-jax and k3-torch run this)"
)
on_other_backend = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="Keras 3 runs on TensorFlow here (k3-jax and k3-torch run this)"
)

# Run first in each child: records every attempt to import TensorFlow (with
# the stack that made it) and refuses it, as if it were not installed. Only
# imports count: a look-up of whether it is installed
# (`importlib.util.find_spec`, which torch makes at import) is answered as
# usual.
RECORD_TENSORFLOW_IMPORTS = textwrap.dedent("""
    import json, sys, traceback

    ATTEMPTS = []

    def importing():
        # This hook <- importlib's _find_spec <- the import statement's
        # _find_and_load_unlocked (or importlib.util.find_spec: a look-up).
        return sys._getframe(3).f_code.co_name == "_find_and_load_unlocked"

    class RecordTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if (name == "tensorflow" or name.startswith("tensorflow.")) and importing():
                ATTEMPTS.append({"module": name, "stack": "".join(traceback.format_stack()[:-1])})
                raise ImportError(f"{name}: refused by the test's import hook")
            return None

    sys.meta_path.insert(0, RecordTensorFlow())

    def report(**extra):
        print("RESULT " + json.dumps({"attempts": ATTEMPTS, **extra}))
""")


def _run(backend: str, body: str, **env: str) -> dict:
    script = RECORD_TENSORFLOW_IMPORTS + textwrap.dedent(body)
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environment.update(KERAS_BACKEND=backend, **env)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _no_attempts(result: dict) -> None:
    attempts = result["attempts"]
    assert not attempts, f"{len(attempts)} attempt(s) to import TensorFlow; the first from:\n" + attempts[0]["stack"]


@needs_other_backend
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_importing_and_training_never_imports_tensorflow(backend):
    # A window of N = 2 micro-steps of Adam, against the plain Adam on the
    # window's mean gradient: the wrapper really ran.
    result = _run(backend, """
        import numpy as np
        import keras
        import accum_optimizer
        from accum_optimizer import AccumulatingOptimizer

        g1, g2 = np.array([0.5, -1.0, 2.0], "float32"), np.array([1.5, 3.0, -1.0], "float32")
        wrapped = keras.Variable(np.ones(3, "float32"))
        plain = keras.Variable(np.ones(3, "float32"))
        opt = AccumulatingOptimizer(keras.optimizers.Adam(0.1), gradient_accumulation_steps=2)
        opt.apply([keras.ops.convert_to_tensor(g1)], [wrapped])
        opt.apply([keras.ops.convert_to_tensor(g2)], [wrapped])
        keras.optimizers.Adam(0.1).apply([keras.ops.convert_to_tensor((g1 + g2) / 2)], [plain])
        by_name = AccumulatingOptimizer("adam", gradient_accumulation_steps=2)
        # The names resolved on first use, by the active Keras.
        accum_optimizer.CountedLoss, accum_optimizer.FlushPartialWindow
        import accum_optimizer.layers
        accum_optimizer.layers.BatchNormalization
        report(backend=keras.backend.backend(), wrapped=keras.ops.convert_to_numpy(wrapped).tolist(),
               plain=keras.ops.convert_to_numpy(plain).tolist(), by_name=type(by_name.inner_optimizer).__name__,
               tensorflow_imported="tensorflow" in sys.modules)
    """)
    _no_attempts(result)
    assert result["backend"] == backend and not result["tensorflow_imported"]
    assert result["by_name"] == "Adam"
    assert max(abs(a - b) for a, b in zip(result["wrapped"], result["plain"])) <= 1e-6
    assert result["wrapped"] != [1.0, 1.0, 1.0]


@needs_other_backend
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_the_planners_help_never_imports_tensorflow(backend):
    result = _run(backend, """
        import contextlib, io, runpy
        sys.argv = ["python -m accum_optimizer.plan", "--help"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_module("accum_optimizer.plan", run_name="__main__", alter_sys=True)
                status = None
            except SystemExit as e:
                status = e.code
        report(status=status, help=out.getvalue())
    """)
    _no_attempts(result)
    assert result["status"] == 0 and "--target-batch-size" in result["help"]


# ------------------------------------------------------------ the planner
BUILD_MODULE = """
import numpy as np
import keras


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def batch(size):
    return np.ones((size, 4), "float32"), np.ones((size, 1), "float32")
"""


@needs_other_backend
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_the_planner_never_imports_tensorflow(backend, tmp_path):
    """On JAX the planner plans (XLA's analysis, in its own process); on
    torch without CUDA it refuses before any probe, naming the backend, the
    device and what works (tests/plan/test_plan_jax.py and test_plan_torch.py
    check the figures and the refusal themselves). Neither tries to import
    TensorFlow."""
    (tmp_path / "tiny_model.py").write_text(BUILD_MODULE)
    result = _run(backend, """
        from accum_optimizer.plan import plan_accumulation
        try:
            plan = plan_accumulation("tiny_model:build", "tiny_model:batch", target_batch_size=8,
                                     memory_limit="1GiB", verbose=False)
            report(plan=[plan.backend, plan.micro_batch_size, plan.gradient_accumulation_steps])
        except NotImplementedError as e:
            import torch
            report(refused=str(e), cuda=torch.cuda.is_available())
    """, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    _no_attempts(result)
    if backend == "jax":
        assert result["plan"] == ["jax", 8, 1], result
    elif not result.get("cuda"):
        message = result["refused"]
        assert message.startswith("The planner cannot measure Keras 3 on the 'torch' backend on the CPU"), message
        assert "KERAS_BACKEND=jax" in message and "KERAS_BACKEND=tensorflow" in message, message


# --------------------------------------- `python -m accum_optimizer._compat`
@on_other_backend
def test_the_private_symbol_listing_runs_without_tensorflow():
    """(On TensorFlow, tests/core/test_compat.py runs the same command.)"""
    from accum_optimizer import _compat

    for name in ("tf", "keras3", "keras3_jax", "keras2"):  # what the command imports
        try:
            importlib.import_module(f"accum_optimizer._compat.{name}")
        except ImportError:
            pass
    done = subprocess.run([sys.executable, "-m", "accum_optimizer._compat"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = [line[2:] for line in done.stdout.splitlines() if line.startswith("- ")]
    assert listed and sorted(listed) == sorted(e.symbol for e in _compat.REGISTRY)
    assert f"{len(_compat.REGISTRY)} private symbols declared, 0 missing here." in done.stdout
