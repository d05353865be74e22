"""Checkpoints saved by an earlier version resume bitwise: a user upgrading
loses nothing.

``tests/data/checkpoints/<leg>/`` holds, for each case of the leg's
``manifest.json``, checkpoints written by accum_optimizer at commit b72c6b1
(``generated_by`` in the manifest) in the middle of a window, and
``expected.npz``: what the run that saved them went on to compute, in memory,
without interruption (``generate.py``). Each test loads one checkpoint with
the package under test (``load_model``, or ``load_weights`` /
``tf.train.Checkpoint`` / ``Saver`` into a fresh model with other initial
weights and an unbuilt optimizer), rebuilds the data and the training from
the manifest (``tests/data/checkpoints/recipes.py``), trains the recorded
number of micro-steps (across at least one window boundary) and requires,
with ``np.testing.assert_array_equal``:

* the model weights, and every optimizer variable in its saved order (same
  count, shapes and dtypes): the saved layout;
* the wrapper's state read by name (``micro_steps``, ``iterations``,
  ``mini_step``, ``window_weight``, ``grad_received``, ``acc_grads``, the row
  trackers, the skip counters; the inner optimizer's variables; TF1's
  ``global_step`` and ``acc_grad`` slots), where the saving version exposed
  it: the semantics;

equal to the recorded continuation, and, for the formats that restore while
loading (``.keras``, ``.h5``, ``Saver``), the restored state equal to the
state at the save.

The leg is ``ACCUM_LEG`` (set by ``make test``), else probed from the
versions. The numbers are those of the TensorFlow/Keras versions and the CPU
recorded in the manifest: on other versions the tests skip (say so and
regenerate); on a CPU that rounds float32 differently a mismatch may be the
hardware, not the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from support import families
from support.families import requires

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "checkpoints"


def _recipes():
    spec = importlib.util.spec_from_file_location("checkpoint_fixture_recipes", FIXTURES / "recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def current_leg() -> str | None:
    """``ACCUM_LEG``, else the leg these versions are (see .ci/legs.py)."""
    leg = os.environ.get("ACCUM_LEG")
    if leg:
        return leg
    import tensorflow as tf

    tf_minor = tuple(int(p) for p in tf.__version__.split(".")[:2])
    if families.available("keras3"):
        return "k3-oldest" if tf_minor == (2, 16) else "k3"
    if families.available("keras2"):
        if families.legacy_keras_requested():
            return "tfkeras"
        if tf_minor == (2, 15):
            return "tf215"
    return None


LEG = current_leg()
MANIFEST_PATH = FIXTURES / str(LEG) / "manifest.json"
MANIFEST = json.loads(MANIFEST_PATH.read_text()) if LEG and MANIFEST_PATH.exists() else None


def _params() -> list:
    if MANIFEST is None:
        reason = f"no checkpoint fixtures for leg {LEG!r} (looked for {MANIFEST_PATH})"
        return [pytest.param(None, None, id=f"{LEG}-none", marks=pytest.mark.skip(reason=reason))]
    return [
        pytest.param(case, fmt, id=f"{LEG}-{case['case']}-{fmt}",
                     marks=[requires(*case["requires"])] + [getattr(pytest.mark, f) for f in case["requires"]])
        for case in MANIFEST["cases"]
        for fmt in case["formats"]
    ]


def _minor(version: str | None) -> str | None:
    return None if version is None else ".".join(version.split(".")[:2])


def _skip_if_other_versions() -> None:
    """The recorded numbers are those of the versions that computed them."""
    import tensorflow as tf

    made = MANIFEST["generated_by"]
    here = {"tensorflow": tf.__version__, "tf.keras": families.tf_keras_version()}
    differ = {k: (made[k], v) for k, v in here.items() if _minor(made[k]) != _minor(v)}
    if differ:
        pytest.skip(f"fixtures of leg {LEG} were computed with {differ} (recorded, here): "
                    "regenerate them with tests/data/checkpoints/generate.py for these versions")


def _split(expected, prefix: str) -> dict:
    return {k[len(prefix):]: expected[k] for k in expected.files if k.startswith(prefix)}


def _machine() -> str:
    made = MANIFEST["generated_by"]
    return (f"recorded with TF {made['tensorflow']}, tf.keras {made['tf.keras']}, accum_optimizer "
            f"{made['accum_optimizer_commit'][:7]} on {made['machine']} {made['cpu']} {made['cpu_flags']}")


def assert_same_state(actual: dict, expected: dict, names: dict, what: str) -> None:
    """Same entries (weights, optimizer variables in their saved order, named
    state); each with the same shape, dtype and bits."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    assert not missing and not extra, (
        f"{what}: the state has other entries than the saving version's: missing {missing}, extra {extra}")
    order = ("weight.", "var.", "named.")  # the model, the saved layout, then the state by name
    for key in sorted(expected, key=lambda k: (next(i for i, p in enumerate(order) if k.startswith(p)), k)):
        a, e = actual[key], expected[key]
        label = f"{what}: {key}" + (f" ({names[key]})" if key in names else "")
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"{label}: shape/dtype {(a.shape, a.dtype)} != {(e.shape, e.dtype)}"
        np.testing.assert_array_equal(a, e, err_msg=f"{label}; {_machine()}")


# Formats whose checkpoint is keyed by object path, not by position, where
# the family's optimizer lists its variables in restore order after loading
# into an unbuilt optimizer: Keras 2's OptimizerV2 creates each slot (and
# `iterations` last) as the checkpoint restores it, for a plain optimizer as
# for the wrapper's inner one. There the optimizer's variables are matched by
# name; the positional order is pinned by the formats that save by position
# (`.h5`).
MATCHED_BY_NAME = {"legacy": ("weights_tf", "tf_checkpoint")}


def align_by_name(actual: dict, actual_names: dict, expected_names: dict) -> dict:
    """``actual`` with its ``var.*`` and ``named.inner.*`` entries put in the
    order of the saving run's, matched by variable name."""
    aligned = {k: v for k, v in actual.items() if not k.startswith(("var.", "named.inner."))}
    for prefix in ("var.", "named.inner."):
        by_name = {actual_names[k]: actual[k] for k in actual if k.startswith(prefix)}
        wanted = {k: n for k, n in expected_names.items() if k.startswith(prefix)}
        assert len(by_name) == len([k for k in actual if k.startswith(prefix)]), f"{prefix}* names are not unique"
        assert sorted(by_name) == sorted(wanted.values()), (
            f"{prefix}* variables differ by name: {sorted(by_name)} != {sorted(wanted.values())}")
        aligned.update({k: by_name[n] for k, n in wanted.items()})
    return aligned


def _resume_keras(R, case: dict, fmt: str, path: str) -> tuple[dict | None, dict]:
    data = R.make_data(case)
    with R.on_cpu_with_policy(case):
        model, status = R.load(case, fmt, path)
        restored = R.keras_state(case, model)[0] if fmt in R.RESTORED_ON_LOAD else None
        R.train(case, model, data, start=case["save_after"])
        if status is not None:
            status.assert_consumed()  # every saved value found its variable
        continued, names = R.keras_state(case, model)
    if fmt in MATCHED_BY_NAME.get(case["family"], ()):
        continued = align_by_name(continued, names, case["variable_names"])
    return restored, continued


def _resume_tf1(R, case: dict, fmt: str, path: str) -> tuple[dict | None, dict]:
    import tensorflow as tf

    tf1 = tf.compat.v1
    data = R.make_data(case)
    start, stop, seed = case["save_after"], R.total_micro_steps(case), case["model"]["resume_seed"]
    if case["driver"] == "tf1_graph":
        with tf.Graph().as_default() as graph, graph.device("/CPU:0"), tf1.Session() as sess:
            g = R.Tf1Graph(case, seed)
            tf1.train.Saver().restore(sess, path)  # every global variable, none initialized otherwise
            restored = g.state(sess)[0]
            g.run(sess, data, start, stop)
            return restored, g.state(sess)[0]
    with tf.device("/CPU:0"):
        e = R.Tf1Eager(case, seed)
        status = e.checkpoint.read(path)  # restored when the first step creates the state
        e.run(data, start, stop)
        status.assert_consumed()
        return None, e.state()[0]


# Keras 3 skips an unbuilt LossScaleOptimizer's state in load_weights, with
# this warning; the wrapper saved it with its own and restores it when it
# builds them, at the load (the keras3-mixed-float16 case checks that it does).
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer 'loss_scale_optimizer'")
@pytest.mark.parametrize("case, fmt", _params())
def test_resumes_saved_checkpoint_bitwise(case, fmt):
    _skip_if_other_versions()
    R = _recipes()
    leg_dir = FIXTURES / LEG
    with np.load(leg_dir / case["expected"]) as expected:
        at_save, at_end = _split(expected, "save."), _split(expected, "end.")
    path = str(leg_dir / case["files"][fmt])
    # `load_failures` in the manifest records the files the saving version
    # could not load_model by itself (tfa `.h5`: issue 17, bug 1); this
    # version must load every one of them with no custom_objects.
    if case["family"] == "tf1":
        restored, continued = _resume_tf1(R, case, fmt, path)
    else:
        restored, continued = _resume_keras(R, case, fmt, path)
    names = case["variable_names"]
    if restored is not None:
        assert_same_state(restored, at_save, names, f"{case['case']} restored from {fmt}")
    assert_same_state(continued, _expected_end(case, at_end), names,
                      f"{case['case']} from {fmt}, after {case['micro_steps_after_save']} more micro-steps")


def _cpu_flags() -> list:
    """This CPU's flags among those the manifest records (``["?"]`` on
    another machine type)."""
    import platform

    return _recipes().cpu()[1] if platform.machine() == MANIFEST["generated_by"]["machine"] else ["?"]


def _expected_end(case: dict, at_end: dict) -> dict:
    """The recorded state after the resumed micro-steps. Under a 16-bit
    dtype policy its bits hold only on a CPU with the recording CPU's
    instruction sets (oneDNN's float16 kernels differ with and without AMX,
    by ~1e-5 after a few micro-steps; seen on AMD EPYC against the recording
    Intel Xeon): elsewhere the continuation is not compared (the restored
    state still is, bitwise, and the resume contract tests run whole on this
    machine); float32 cases and TF1 compare everywhere."""
    if case["model"].get("dtype_policy") and _cpu_flags() != MANIFEST["generated_by"]["cpu_flags"]:
        pytest.skip(f"{case['case']}: recorded on {MANIFEST['generated_by']['cpu']} "
                    f"{MANIFEST['generated_by']['cpu_flags']}; this CPU has {_cpu_flags()} (16-bit kernels differ)")
    return at_end
