"""The fence around private framework symbols (issue 16, item 3).

* Every private Keras / TensorFlow symbol the package uses is declared in
  ``accum_optimizer/_compat/`` and resolves in this leg's versions; a missing
  or changed one fails here, naming the symbol and the installed version.
* No module outside ``_compat/`` touches one: no ``keras.src``,
  ``tensorflow.python``, frame inspection or ``__setattr__`` patching, no
  underscore attribute the package does not define itself, and no class of
  the package overrides a framework's private method outside ``_compat/``.
* A missing symbol at run time raises ``PrivateSymbolMissing`` naming it and
  the version, not a wrong result.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import sys

import pytest

import accum_optimizer
from accum_optimizer import _compat, _packages

PACKAGE = pathlib.Path(accum_optimizer.__file__).parent
COMPAT = PACKAGE / "_compat"


def _importable_compat_modules() -> list:
    """The compatibility modules this leg can import (Keras 3's needs Keras 3
    on TensorFlow; Keras 2's a Keras 2 package)."""
    found = [importlib.import_module("accum_optimizer._compat.tf")]
    try:
        import keras

        if keras.__version__.startswith("3.") and keras.backend.backend() == "tensorflow":
            found.append(importlib.import_module("accum_optimizer._compat.keras3"))
    except ImportError:
        pass
    if _keras2_packages():
        found.append(importlib.import_module("accum_optimizer._compat.keras2"))
    return found


def _keras2_packages() -> list:
    packages = []
    for name in ("tf_keras", "keras"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if str(module.__version__).startswith("2."):
            packages.append(module)
    return packages


def _packages_for(entry: _compat.Private) -> list:
    """The imported framework modules an entry's symbol belongs to here."""
    if entry.distribution == "tensorflow":
        return [sys.modules["tensorflow"]]
    if entry.distribution == "keras":
        return [sys.modules["keras"]]
    if entry.distribution == "tensorflow-addons":
        try:
            return [importlib.import_module("tensorflow_addons")]
        except ImportError:
            pytest.skip(f"{entry.symbol}: no tensorflow-addons in this leg (it runs in tf215)")
    return _keras2_packages()


MODULES = _importable_compat_modules()


def _entries() -> list:
    names = {m.__name__ for m in MODULES}
    return [e for e in _compat.REGISTRY if e.probe.__module__ in names]


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: e.symbol.split(" ")[0])
def test_every_private_symbol_resolves_in_this_leg(entry):
    packages = _packages_for(entry)
    assert packages, f"no {entry.distribution} package in this leg for {entry.symbol}"
    for package in packages:
        try:
            entry.probe(package)
        except Exception as e:  # noqa: BLE001 - the message is the point
            pytest.fail(_compat.message(entry, package, e))


def test_every_declaration_gives_a_reason_and_the_versions_checked():
    for entry in _compat.REGISTRY:
        assert len(entry.reason) > 40, entry.symbol
        assert re.search(r"\d+\.\d+", entry.checked), entry.symbol


def test_a_missing_symbol_raises_a_clear_error_naming_it_and_the_version():
    import tensorflow as tf

    missing = _compat.Private(
        "tf.no_such_private_symbol", "tensorflow", "a test of the fence's own error message, nothing else",
        "TensorFlow 2.21", lambda t: t.no_such_private_symbol,
    )
    with pytest.raises(_compat.PrivateSymbolMissing) as got:
        _compat.require(missing, tf)
    text = str(got.value)
    assert "tf.no_such_private_symbol" in text and tf.__version__ in text and "TensorFlow 2.21" in text


# ------------------------------------------------------------------ the fence
def _modules_outside_compat() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if COMPAT not in p.parents)


@pytest.mark.parametrize("path", _modules_outside_compat(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_import_frame_walk_or_setattr_outside_compat(path):
    pattern = re.compile(r"keras\.src|tensorflow\.python|_getframe|__setattr__\(")
    hits = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, "private touches outside accum_optimizer/_compat/:\n" + "\n".join(hits)


def _own_private_names() -> set[str]:
    """Every single-underscore name the package defines itself: functions,
    methods, class attributes, attributes it assigns, keyword arguments and
    string keys it stores in ``__dict__``."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if COMPAT in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


# The standard library's documented underscore functions the package calls:
# (module, name). `os._exit` ends a child of the planner's fork server
# without running the exit handlers it inherited from the server
# (https://docs.python.org/3/library/os.html#os._exit: "normally used in the
# child process after a fork()").
STDLIB_PUBLIC = {("os", "_exit")}


@pytest.mark.parametrize("path", _modules_outside_compat(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_underscore_attribute_of_a_framework_object_outside_compat(path):
    own = _own_private_names()
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in STDLIB_PUBLIC:
                continue
            if node.attr not in own:
                hits.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not hits, "underscore attributes the package does not define (fence them in _compat/):\n" + "\n".join(hits)


def _package_classes() -> list[type]:
    classes = []
    for name in ("keras3", "keras3_jax", "keras3_saving", "keras3_fit", "keras2", "keras2_fit", "legacy",
                 "tf1"):
        try:
            module = importlib.import_module(f"accum_optimizer.families.{name}")
        except ImportError:
            continue
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__.startswith("accum_optimizer")]
    return classes


@pytest.mark.parametrize("cls", _package_classes(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_no_framework_private_method_is_overridden_outside_compat(cls):
    """A method named like a framework base class' private one is an
    override of its private hook: it belongs in a compatibility mixin."""
    framework = [b for b in cls.__mro__ if not b.__module__.startswith("accum_optimizer")]
    hits = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("accum_optimizer") or klass.__module__.startswith("accum_optimizer._compat"):
            continue
        for name in vars(klass):
            if name.startswith("_") and not name.startswith("__") and any(name in vars(b) for b in framework):
                hits.append(f"{klass.__module__}.{klass.__qualname__}.{name}")
    assert not hits, "framework private hooks overridden outside _compat/: " + ", ".join(hits)


# ------------------------------------------- `python -m accum_optimizer._compat`
def test_the_listing_command_lists_every_declared_symbol_and_exits_0():
    """``python -m accum_optimizer._compat`` (docs/contributing.md, the first
    step of ``make test-nightly``) lists every record its compatibility
    modules declare, each with its state here, and exits 0 where none is
    missing (this leg's versions are among those checked)."""
    import os
    import subprocess

    for name in ("tf", "keras3", "keras3_jax", "keras2"):  # what the command imports
        try:
            importlib.import_module(f"accum_optimizer._compat.{name}")
        except ImportError:
            pass
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-m", "accum_optimizer._compat"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = [line[2:] for line in done.stdout.splitlines() if line.startswith("- ")]
    assert sorted(listed) == sorted(e.symbol for e in _compat.REGISTRY)
    assert done.stdout.count("    here: ") == len(_compat.REGISTRY)
    assert f"{len(_compat.REGISTRY)} private symbols declared, 0 missing here." in done.stdout
