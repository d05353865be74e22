"""Griffe extension for the API reference: the package's docstrings use
Sphinx roles (``:class:`x```, ``:meth:`~a.b```); Markdown has none, so each is
rendered as the code span `x` (``~`` keeps the last component, as in Sphinx).

Loaded by mkdocs.yml (mkdocstrings' python handler, ``extensions``); static
analysis only, no import of the package or of TensorFlow."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
