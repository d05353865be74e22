"""The Python blocks of README.md and docs/, and how each one runs.

Every fenced ``python`` block of the README and of the pages under
``docs/`` (the generated ``docs/benchmarks/`` excepted) carries a marker on
the line right above its fence, an HTML comment that the rendered page
hides::

    <!-- docs-test: needs=keras3 setup=classifier expect="int(opt.iterations) == 5" -->

``needs``
    where it runs: a family of ``support.families`` (``keras3``: Keras 3 on
    TensorFlow; ``keras2``, ``legacy``, ``tfa``, ``tf1``), a Keras 3
    backend (``jax``, ``torch``), or ``keras3-any`` (Keras 3 on whichever
    backend the leg runs). Comma-separated: all of them.
``setup``
    a function of :mod:`support.doc_setups` that puts what the block takes
    for granted (``model``, ``x``, ``y``, ``loss_fn``, ``micro_batches``, a
    TF1 graph's ``loss``...) into its namespace, with tiny data.
``name``
    the block's name, unique on its page, for ``continues``.
``continues``
    ``continues=NAME``: the block runs after the block of the same page named
    ``NAME`` (and in its namespace, with that block's setup): a snippet that
    goes on from an earlier one.
``expect``
    a Python expression, true after the block ran (what the block's own
    comments promise: the updates it makes, say).
``then``
    a function of :mod:`support.doc_setups` called with the namespace after
    the block (runs what the block only defines, and checks it).
``skip``
    ``skip="why"``: the block does not run; the reason is the test's skip
    message.

Each block runs in a fresh Python process (``python -m support.doc_blocks
PAGE LINE``) in an empty working directory, so a block that sets a global
policy or a strategy leaves nothing behind. A block without a marker fails
its test: a snippet can only be left unrun with a written reason.
"""

from __future__ import annotations

import dataclasses
import linecache
import pathlib
import re
import shlex
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*docs-test:(?P<body>.*?)-->\s*$", re.S)
KEYS = ("name", "needs", "setup", "continues", "expect", "then", "skip")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    code: str  # dedented
    marker: dict | None  # None: the block has no marker

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    docs = sorted(p for p in (root / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(root / "docs").parts)
    return [root / "README.md", *docs]


def parse_marker(body: str, where: str) -> dict:
    marker: dict = {}
    for token in shlex.split(body):
        key, sep, value = token.partition("=")
        if not sep or key not in KEYS:
            raise ValueError(f"{where}: bad docs-test marker item {token!r}; expected key=value with key in {KEYS}")
        marker[key] = value
    return marker


def blocks(root: pathlib.Path = ROOT) -> list[Block]:
    found = []
    for path in pages(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            mm = _MARKER.search(before)
            marker = parse_marker(mm.group("body"), f"{rel}:{line}") if mm else None
            found.append(Block(rel, line, textwrap.dedent(m.group("code")), marker))
    return found


def find(page: str, line: int | None = None, name: str | None = None, root: pathlib.Path = ROOT) -> Block:
    """The block of ``page`` that starts at ``line``, or the one named ``name``."""
    for b in blocks(root):
        if b.page == page and (b.line == line if name is None else (b.marker or {}).get("name") == name):
            return b
    raise LookupError(f"no python block at {page}:{line}" if name is None else f"no block named {name!r} on {page}")


def chain(block: Block, root: pathlib.Path = ROOT) -> list[Block]:
    """The blocks that run, in order: the ones it continues, then itself."""
    out = [block]
    while out[0].marker and out[0].marker.get("continues"):
        out.insert(0, find(out[0].page, name=out[0].marker["continues"], root=root))
    return out


def run(page: str, line: int) -> None:
    """Run one block (and those it continues) in this process."""
    from support import doc_setups

    ns: dict = {"__name__": "__main__"}
    todo = chain(find(page, line))
    if todo[0].marker.get("setup"):
        getattr(doc_setups, todo[0].marker["setup"])(ns)
    for b in todo:
        filename = f"{ROOT / b.page}:{b.line}"
        # In linecache, so that tracebacks show the block's lines and AutoGraph
        # (inspect.getsource) can convert the tf.functions it defines.
        linecache.cache[filename] = (len(b.code), None, b.code.splitlines(True), filename)
        exec(compile(b.code, filename, "exec"), ns)
    marker = todo[-1].marker
    if marker.get("then"):
        getattr(doc_setups, marker["then"])(ns)
    if marker.get("expect"):
        assert eval(marker["expect"], ns), f"{page}:{line}: after the block, {marker['expect']} is false"


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
    print("docs block ran:", sys.argv[1], sys.argv[2])
