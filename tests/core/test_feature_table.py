"""The feature x family table of ``docs/features.md`` is the one
``tests/support/features.py`` renders, and every cell names a test that
exists (that it passed for its family in some leg is ``make test``'s last
check: ``python tests/support/features.py --check``)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from support import features

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_docs_page_shows_the_generated_table():
    page = ROOT / "docs" / "features.md"
    assert features.section(page.read_text()) == features.render(), (
        "docs/features.md is out of date: run python tests/support/features.py --write docs/features.md"
    )


def test_every_row_has_a_cell_per_family():
    for feature in features.FEATURES:
        assert set(feature.cells) == set(features.FAMILIES), feature.name


@pytest.mark.parametrize("family, ref", features.claims(), ids=lambda v: str(v))
def test_every_yes_cell_names_a_test_that_exists(family, ref):
    path, name = ref.split("::")
    source = ROOT / "tests" / path
    assert source.is_file(), f"{family} cell: no file tests/{path}"
    tests = {node.name for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.FunctionDef)}
    assert name in tests, f"{family} cell: no test {name} in tests/{path}"
    folder = path.split("/")[0]
    # (legacy runs in keras2/test_multiworker.py; tests/backends/ is the Keras 3 family on any backend)
    own = {"tfa": ("legacy",), "legacy": ("legacy", "keras2"), "keras3": ("keras3", "backends")}.get(family, (family,))
    assert folder in ("contract", "core") + own, f"{family} cell names a test of another family: {ref}"


def test_the_check_fails_on_an_unbacked_claim(tmp_path):
    """The cross-leg check is not vacuous: with one claim's line missing from
    the passed tests it fails, naming that cell; with every line it passes."""
    lines = {f"{f} tests/{ref}" for f, ref in features.claims()}
    full = tmp_path / "all.txt"
    full.write_text("\n".join(sorted(lines)))
    assert features.main(["--check", str(full)]) == 0
    family, ref = features.claims()[0]
    partial = tmp_path / "partial.txt"
    partial.write_text("\n".join(sorted(lines - {f"{family} tests/{ref}"})))
    assert features.unbacked(set(partial.read_text().split("\n"))) == [(family, ref)]
    assert features.main(["--check", str(partial)]) == 1


def test_no_cell_is_missing():
    """Issue 17: every feature in every family where the framework has it."""
    missing = [(feature.name, f) for feature in features.FEATURES for f, cell in feature.cells.items()
               if isinstance(cell, features.Missing)]
    assert missing == []
