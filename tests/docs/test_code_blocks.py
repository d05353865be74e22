"""Every Python block of README.md and docs/ runs, in the legs that have what it needs.

The blocks and their markers: :mod:`support.doc_blocks`; the tiny data and
models they take for granted: :mod:`support.doc_setups`. Each block runs in
a fresh process; a failing block fails with its own traceback, named by page
and line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import doc_blocks, families

_BACKENDS = ("jax", "torch")


def _why_not(need: str) -> str | None:
    if need in families.FAMILIES:
        return families.skip_reason(need)
    if need in _BACKENDS + ("keras3-any",):
        if families.legacy_keras_requested():
            return f"needs {need}: TF_USE_LEGACY_KERAS=1 here"
        try:
            import keras
        except ImportError as e:
            return f"needs {need}: keras does not import ({e})"
        if not keras.__version__.startswith("3."):
            return f"needs {need}: Keras {keras.__version__} here"
        if need != "keras3-any" and keras.backend.backend() != need:
            return f"needs Keras 3 on {need}; the backend here is {keras.backend.backend()!r} (the k3-{need} leg)"
        return None
    raise ValueError(f"unknown need {need!r}: a family of support.families, {_BACKENDS} or 'keras3-any'")


def _marks(block: doc_blocks.Block) -> list:
    needs = (block.marker or {}).get("needs", "")
    return [getattr(pytest.mark, "keras3" if n in _BACKENDS + ("keras3-any",) else n)
            for n in needs.split(",") if n]


BLOCKS = doc_blocks.blocks()


def test_there_are_blocks_on_the_pages_that_teach_the_api():
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/families/backends.md", "docs/families/tf1.md", "docs/saving.md"} <= pages, pages


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in BLOCKS])
def test_block_runs(block, tmp_path):
    if block.marker is None:
        pytest.fail(f"{block.id}: a python block without a `<!-- docs-test: ... -->` marker on the line above "
                    "its fence (tests/support/doc_blocks.py says what it takes; skip=\"why\" if it cannot run)")
    if "skip" in block.marker:
        pytest.skip(f"{block.id}: {block.marker['skip']}")
    needs = block.marker.get("needs")
    if not needs:
        pytest.fail(f"{block.id}: its marker names no `needs=`")
    for need in needs.split(","):
        reason = _why_not(need)
        if reason is not None:
            pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(doc_blocks.ROOT / "tests"), str(doc_blocks.ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "support.doc_blocks", block.page, str(block.line)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def test_the_readme_stays_within_250_lines():
    """The README is the front page: the details live in docs/ (it links them)."""
    lines = (doc_blocks.ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/"
