"""The one place the tests reach into ``accum_optimizer``'s internals.

Everything else in the suite uses the public API only
(``accum_optimizer.AccumulatingOptimizer``, ``CountedLoss``,
``FlushPartialWindow``, ``accum_optimizer.families.<family>.AccumulatingOptimizer``
and their documented attributes). The tests of ``tests/core/`` check the
shared argument validation, the schedule's window length and the family
dispatch directly; they import them from here, so that a move of those
internals is one edit in this module.

Each name is looked up in the modules listed for it, first to last.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    # argument validation, shared by every family
    "ARGUMENTS": ("accum_optimizer._args",),
    "NUMERICS_ARGUMENTS": ("accum_optimizer._args",),
    "REQUIRED": ("accum_optimizer._args",),
    "check_arguments": ("accum_optimizer._args",),
    "validate_gradient_accumulation_steps": ("accum_optimizer._args",),
    "validate_reduction": ("accum_optimizer._args",),
    "validate_accumulation_schedule": ("accum_optimizer._args",),
    # which family an inner optimizer belongs to
    "family_of": ("accum_optimizer._dispatch",),
    "_is_keras3": ("accum_optimizer._dispatch",),
    "_is_keras2": ("accum_optimizer._dispatch",),
    "_is_legacy": ("accum_optimizer._dispatch",),
    "_is_tf1": ("accum_optimizer._dispatch",),
}


def _find(name: str) -> Any:
    tried = []
    for module_name in _WHERE[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            tried.append(f"{module_name} (does not import)")
            continue
        if hasattr(module, name):
            return getattr(module, name)
        tried.append(f"{module_name} (no {name})")
    raise ImportError(f"accum_optimizer internal {name!r} not found; tried {', '.join(tried)}: "
                      "point tests/support/internals.py at its new home")


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return _find(name)
    raise AttributeError(name)


__all__ = sorted(_WHERE)
