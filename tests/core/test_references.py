"""Every reference the sources make to the repository resolves, read
statically (no import: no framework needed, so it runs in every leg).

* **Test paths**: each ``tests/<dir>/<name>.py`` path named in the package
  (``accum_optimizer/**/*.py``), the docs (``docs/**/*.md``), ``README.md``,
  the tests (``tests/**/*.py``), ``benchmarks/``, ``experiments/``,
  ``examples/``, the ``Makefile`` and ``.ci/`` exists, and for ``path.py::name`` (or
  ``::Class::name``, a ``[parameter]`` suffix ignored) the file defines that
  test function or class (read with ``ast``). ``CHANGELOG.md`` is not read:
  its entries name the paths of their day, and old ones no longer exist
  (``tests/MOVED.tsv`` maps the old test ids to the new).
* **API references**: each Sphinx role (``:mod:``, ``:class:``, ``:func:``,
  ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``) naming a dotted
  ``accum_optimizer.…`` target, in the same files, and each mkdocstrings
  directive (``::: accum_optimizer.…``), anchor (``(#accum_optimizer.…)``)
  and cross-reference (``[text][accum_optimizer.…]``) of the docs. A target
  resolves when its longest module prefix is a file of the package and the
  rest is a name that module binds at module level (defined, assigned,
  imported -- followed to its source when that is the package's -- or
  served by a module ``__getattr__``), then a member of that class (its body,
  ``self.x = ...`` in its methods, or a base class of the package's; a class
  with a base from outside the package may inherit the name from there).
  References to other libraries (``keras.*``, ``tf.*``) are not checked.
* **Tests import neither ``benchmarks`` nor ``experiments``**: the benchmarks
  and the correctness studies are tools the tests run as processes
  (``python -m benchmarks ...``); what a tool and the tests both need (the
  multi-worker launcher, the collective counter, the caveats' cases, the JAX
  all-reduce check) lives in ``tests/support/``, which the tools import
  (``tests/`` on ``sys.path``), never the other way round.

Each check is shown to fail on a file holding a stale path, a bad reference
or an import of ``benchmarks`` or ``experiments`` (the ``test_*_catches_*``
tests below).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "accum_optimizer"


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The files whose references are checked (CHANGELOG.md is not: see the
    module docstring)."""
    globs = [f"{PACKAGE}/**/*.py", "docs/**/*.md", "README.md", "tests/**/*.py", "benchmarks/**/*.py",
             "benchmarks/**/*.md", "experiments/**/*.py", "examples/**/*.py", "Makefile", ".ci/*"]
    files = {p for g in globs for p in root.glob(g) if p.is_file()}
    return sorted(p for p in files if "__pycache__" not in p.parts)


# ------------------------------------------------------------ test paths
# A `tests/...py` path made of plain names (not `tests/...py`, `tests/*.py` or
# `tests/{family}/...`), not the tail of a longer path (`../tests/...` is the
# same path, from docs/), with an optional
# `::name` (`::Class::name`, `::name[param]`).
_TEST_PATH = re.compile(
    r"(?<![\w/.-])(?:\.\./)*(tests/(?:[A-Za-z0-9_-]+/)*[A-Za-z0-9_-]+\.py)((?:::[A-Za-z_]\w*)*)")


def paths_in(text: str) -> list[tuple[str, str]]:
    """``(path, "::name...")`` for every test path in ``text``."""
    return [(m.group(1), m.group(2)) for m in _TEST_PATH.finditer(text)]


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _defines(body: list[ast.stmt], name: str) -> ast.stmt | None:
    for node in _top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _targets(node):
            return node  # e.g. `test_x = pytest.mark.slow(_test_x)`
    return None


def path_problem(root: Path, path: str, names: str) -> str | None:
    """Why ``path`` + ``names`` does not resolve under ``root``, or None."""
    file = root / path
    if not file.is_file():
        return f"{path} does not exist"
    body: list[ast.stmt] = _parse(file).body
    for name in (n for n in names.split("::") if n):
        node = _defines(body, name)
        if node is None:
            return f"{path} defines no {name!r}"
        body = node.body if isinstance(node, ast.ClassDef) else []
    return None


def stale_test_paths(root: Path = ROOT, files: list[Path] | None = None) -> list[str]:
    """``file:line: problem`` for every test path that does not resolve."""
    problems = []
    for f in files if files is not None else scanned_files(root):
        for lineno, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for path, names in paths_in(line):
                problem = path_problem(root, path, names)
                if problem:
                    problems.append(f"{f.relative_to(root)}:{lineno}: {path}{names}: {problem}")
    return problems


# ------------------------------------------------------- API references
_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj):`([^`]+)`")
_DOCS_TARGETS = (
    re.compile(r"^:::[ \t]+(\S+)", re.M),  # mkdocstrings directive
    re.compile(r"\]\(#([\w.]+)\)"),  # anchor of an API page
    re.compile(r"\]\[([\w.]+)\]"),  # autorefs cross-reference
)


def api_references_in(text: str, markdown: bool = False) -> list[tuple[int, str]]:
    """``(line, target)`` for every reference to a dotted name of the package."""
    found = []
    for m in _ROLE.finditer(text):
        target = m.group(1).strip()
        target = re.sub(r"^.*<(.+)>$", r"\1", target, flags=re.S).lstrip("~!").strip()
        found.append((m.start(), target))
    if markdown:
        found += [(m.start(1), m.group(1)) for rx in _DOCS_TARGETS for m in rx.finditer(text)]
    return sorted((text.count("\n", 0, pos) + 1, t) for pos, t in found
                  if t == PACKAGE or t.startswith(PACKAGE + "."))


def _top_level(body: list[ast.stmt]):
    """The statements of a module or class body, those under ``if``/``try``/
    ``with`` included (imports guarded by ``try: ... except ImportError``)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _top_level(node.body)
            for h in node.handlers:
                yield from _top_level(h.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _top_level(node.body)


def _targets(node: ast.stmt) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = set()
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.add(n.id)
    return names


class Resolver:
    """Resolves ``accum_optimizer.…`` names against the package's sources."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    def bindings(self, module: str) -> tuple[dict, list[str]]:
        """Names ``module`` binds at module level: name -> ("node", node) or
        ("import", module, name or None); and its ``from x import *`` modules."""
        file = self.module_file(module)
        is_package = file.name == "__init__.py"
        names: dict = {}
        stars: list[str] = []
        for node in _top_level(_parse(file).body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = ("node", node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for n in _targets(node):
                    names.setdefault(n, ("node", node))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        names[a.asname] = ("import", a.name, None)
                    else:
                        top = a.name.split(".")[0]
                        names[top] = ("import", top, None)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parts = module.split(".")
                    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    if a.name == "*":
                        stars.append(source)
                    else:
                        names[a.asname or a.name] = ("import", source, a.name)
        getattr_ = names.get("__getattr__")
        if getattr_ and getattr_[0] == "node":  # lazy attributes: `__all__` and the names `__getattr__` tests
            lazy = {c.value for c in ast.walk(getattr_[1]) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            all_ = names.get("__all__")
            if all_ and all_[0] == "node":
                lazy |= {c.value for c in ast.walk(all_[1].value) if isinstance(c, ast.Constant)}
            for n in lazy:
                if n.isidentifier():
                    names.setdefault(n, ("lazy",))
        return names, stars

    def problem(self, target: str) -> str | None:
        """Why ``target`` does not resolve, or None."""
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if self.module_file(module):
                return self._in_module(module, parts[i:])
        return f"no module {parts[0]}"

    def _in_module(self, module: str, rest: list[str], seen: frozenset = frozenset()) -> str | None:
        if not rest:
            return None
        if module.split(".")[0] != PACKAGE:
            return None  # another library's name, imported by the package: not checked
        if self.module_file(module) is None:
            return f"no module {module}"
        if (module, rest[0]) in seen:
            return f"{module}.{rest[0]} imports itself"
        seen = seen | {(module, rest[0])}
        names, stars = self.bindings(module)
        binding = names.get(rest[0])
        if binding is None:
            if self.module_file(f"{module}.{rest[0]}"):
                return self._in_module(f"{module}.{rest[0]}", rest[1:], seen)
            for star in stars:
                if self._in_module(star, rest, seen) is None:
                    return None
            return f"{module} has no {rest[0]!r}"
        if binding[0] == "lazy":
            if len(rest) == 1:
                return None
            return f"{module}.{rest[0]} is resolved at run time; its members cannot be checked"
        if binding[0] == "import":
            _, source, name = binding
            if name is None:
                return self._in_module(source, rest[1:], seen)
            if self.module_file(f"{source}.{name}"):  # `from package import submodule`
                return self._in_module(f"{source}.{name}", rest[1:], seen)
            return self._in_module(source, [name] + rest[1:], seen)
        node = binding[1]
        if len(rest) == 1:
            return None
        if isinstance(node, ast.ClassDef):
            return self._in_class(module, node, rest[1:])
        return f"{module}.{rest[0]} is not a class or module: {'.'.join(rest[1:])} cannot be checked"

    def _in_class(self, module: str, cls: ast.ClassDef, rest: list[str]) -> str | None:
        name = rest[0]
        member = _defines(cls.body, name)
        if member is None:
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for n in ast.walk(fn):
                        if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                                and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr == name):
                            member = n
        if member is not None:
            if len(rest) == 1:
                return None
            if isinstance(member, ast.ClassDef):
                return self._in_class(module, member, rest[1:])
            return f"{cls.name}.{name} is not a class: {'.'.join(rest[1:])} cannot be checked"
        external = False
        for base in cls.bases:
            dotted = _dotted(base)
            if dotted is None:
                external = True
                continue
            found = self._class_of(module, dotted.split("."))
            if found is None:
                external = True
            elif self._in_class(*found, rest) is None:
                return None
        if external:
            return None  # may come from a base outside the package (keras.Optimizer, ...)
        return f"{module}.{cls.name} has no member {name!r}"

    def _class_of(self, module: str, parts: list[str]):
        """``(module, ClassDef)`` that ``parts`` names in ``module``, or None
        where it is not a class of the package."""
        if module.split(".")[0] != PACKAGE or self.module_file(module) is None:
            return None
        names, _ = self.bindings(module)
        binding = names.get(parts[0])
        if binding is None:
            if self.module_file(f"{module}.{parts[0]}") and len(parts) > 1:
                return self._class_of(f"{module}.{parts[0]}", parts[1:])
            return None
        if binding[0] == "import":
            _, source, name = binding
            if name is None:
                return self._class_of(source, parts[1:]) if len(parts) > 1 else None
            if self.module_file(f"{source}.{name}"):
                return self._class_of(f"{source}.{name}", parts[1:]) if len(parts) > 1 else None
            return self._class_of(source, [name] + parts[1:])
        if binding[0] == "node" and isinstance(binding[1], ast.ClassDef) and len(parts) == 1:
            return module, binding[1]
        return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def bad_api_references(root: Path = ROOT, files: list[Path] | None = None) -> list[str]:
    """``file:line: target: problem`` for every reference that does not resolve."""
    resolver = Resolver(root)
    problems = []
    for f in files if files is not None else scanned_files(root):
        text = f.read_text(encoding="utf-8", errors="replace")
        for lineno, target in api_references_in(text, markdown=f.suffix == ".md"):
            problem = resolver.problem(target)
            if problem:
                problems.append(f"{f.relative_to(root)}:{lineno}: {target}: {problem}")
    return problems


# ------------------------------- tests import no benchmarks, no experiments
TOOLS = ("benchmarks", "experiments")


def tool_imports(root: Path = ROOT) -> list[str]:
    """``file:line`` of every import of a tool (:data:`TOOLS`) in a module
    under tests/."""
    found = []
    for f in sorted((root / "tests").rglob("*.py")):
        for node in sorted(ast.walk(_parse(f)), key=lambda n: getattr(n, "lineno", 0)):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            if any(m.split(".")[0] in TOOLS for m in modules):
                found.append(f"{f.relative_to(root)}:{node.lineno}")
    return found


# ----------------------------------------------------------------- tests
def test_every_test_path_exists():
    assert stale_test_paths() == []


def test_every_api_reference_resolves():
    assert bad_api_references() == []


def test_no_test_imports_benchmarks_or_experiments():
    assert tool_imports() == []


def test_the_scan_reads_the_sources_the_docs_and_the_tools_but_not_the_changelog():
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert {"README.md", "Makefile", ".ci/run", f"{PACKAGE}/__init__.py", "docs/index.md",
            "tests/core/test_references.py", "examples/multiworker.py", "benchmarks/distributed.py",
            "experiments/caveats.py"} <= files
    assert "CHANGELOG.md" not in files


def _fake_repo(tmp_path: Path) -> Path:
    """A package, a test file, and a doc naming one good and one stale thing each."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from accum_optimizer.sub.mod import Thing\n__all__ = ['Thing']\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text(
        "import keras\n\n"
        "class Base:\n    def flush(self):\n        pass\n\n"
        "class Thing(Base):\n    LIMIT = 3\n\n    def __init__(self):\n        self.count = 0\n\n"
        "    def step(self):\n        pass\n\n"
        "class Wrapped(keras.Optimizer):\n    pass\n\n"
        "def helper():\n    pass\n")
    (tmp_path / "tests" / "core").mkdir(parents=True)
    (tmp_path / "tests" / "core" / "test_here.py").write_text(
        "def test_one():\n    pass\n\nclass TestGroup:\n    def test_two(self):\n        pass\n")
    return tmp_path


def test_test_path_check_catches_a_stale_path_and_a_missing_test(tmp_path):
    root = _fake_repo(tmp_path)
    doc = root / "docs" / "page.md"
    doc.parent.mkdir()
    # Written in pieces so that this file itself names no stale path.
    t = "tests"
    doc.write_text(
        f"See {t}/core/test_here.py, {t}/core/test_here.py::test_one and\n"
        f"{t}/core/test_here.py::TestGroup::test_two; {t}/core/test_here.py::test_one[a-b].\n"
        f"Stale: {t}/test_semantics.py::test_x, {t}/core/test_here.py::test_three,\n"
        f"{t}/core/test_here.py::TestGroup::test_one, ../{t}/gone.py. Not paths: {t}/...py, {t}/*.py, x/{t}/a.py.\n")
    assert stale_test_paths(root, [doc]) == [
        f"docs/page.md:3: {t}/test_semantics.py::test_x: {t}/test_semantics.py does not exist",
        f"docs/page.md:3: {t}/core/test_here.py::test_three: {t}/core/test_here.py defines no 'test_three'",
        f"docs/page.md:4: {t}/core/test_here.py::TestGroup::test_one: {t}/core/test_here.py defines no 'test_one'",
        f"docs/page.md:4: {t}/gone.py: {t}/gone.py does not exist",
    ]


def test_api_reference_check_catches_bad_references(tmp_path):
    root = _fake_repo(tmp_path)
    p = PACKAGE
    good = [f":mod:`{p}.sub.mod`", f":class:`~{p}.sub.mod.Thing`", f":meth:`{p}.Thing.step`",
            f":meth:`{p}.sub.mod.Thing.flush`", f":attr:`{p}.sub.mod.Thing.count`",
            f":data:`{p}.sub.mod.Thing.LIMIT`", f":func:`helper <{p}.sub.mod.helper>`",
            f":meth:`{p}.sub.mod.Wrapped.apply_gradients`", ":class:`keras.Optimizer`", f":mod:`{p}`"]
    bad = [f":mod:`{p}.gone`", f":class:`{p}.sub.mod.Gone`", f":meth:`{p}.Thing.stop`",
           f":attr:`{p}.sub.mod.helper.x`"]
    src = root / p / "sub" / "doc.py"
    src.write_text('"""' + "\n".join(good + bad) + '"""\n')
    doc = root / "docs" / "api.md"
    doc.parent.mkdir()
    doc.write_text(f"::: {p}.sub.mod.Thing\n\n::: {p}.sub.mod.Thing.gone\n\n"
                   f"[Thing](#{p}.sub.mod.Thing) [x][{p}.sub.missing.X]\n")
    n = len(good)
    assert bad_api_references(root, [src, doc]) == [
        f"{p}/sub/doc.py:{n + 1}: {p}.gone: {p} has no 'gone'",
        f"{p}/sub/doc.py:{n + 2}: {p}.sub.mod.Gone: {p}.sub.mod has no 'Gone'",
        f"{p}/sub/doc.py:{n + 3}: {p}.Thing.stop: {p}.sub.mod.Thing has no member 'stop'",
        f"{p}/sub/doc.py:{n + 4}: {p}.sub.mod.helper.x: "
        f"{p}.sub.mod.helper is not a class or module: x cannot be checked",
        f"docs/api.md:3: {p}.sub.mod.Thing.gone: {p}.sub.mod.Thing has no member 'gone'",
        f"docs/api.md:5: {p}.sub.missing.X: {p}.sub has no 'missing'",
    ]


def test_tool_import_check_catches_imports(tmp_path):
    (tmp_path / "tests" / "support").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "ok.py").write_text(
        "import benchmarks_of_something_else\nfrom .benchmarks import x\ncmd = 'python -m benchmarks --tiny'\n"
        "import experimental\nfrom .experiments import y\n")
    (tmp_path / "tests" / "test_a.py").write_text(
        "import os\nfrom benchmarks._cluster import Cluster\n\ndef f():\n    import benchmarks.memory as m\n"
        "import experiments\nfrom experiments.caveats import case_gan\n")
    t = "tests"  # (so that this file names no path of its own that does not exist)
    assert tool_imports(tmp_path) == [f"{t}/test_a.py:2", f"{t}/test_a.py:5", f"{t}/test_a.py:6",
                                      f"{t}/test_a.py:7"]


@pytest.mark.parametrize("text, expected", [  # P: the package (this file names none of its own)
    (":class:`P.A`", [(1, "P.A")]),
    ("x\n:meth:`~P.a.B.c`", [(2, "P.a.B.c")]),
    (":py:func:`f <P.f>`", [(1, "P.f")]),
    (":obj:`P`", [(1, "P")]),
    (":class:`keras.Layer` :mod:`P_x` :class:`x.P.y`", []),
])
def test_api_references_are_read_from_roles(text, expected):
    def p(s):
        return s.replace("P", PACKAGE)

    assert api_references_in(p(text)) == [(line, p(t)) for line, t in expected]
