"""``python -m accum_optimizer._compat``: every private framework symbol the
package uses, why, the versions it was checked on, and whether the installed
versions still have it (``ok``, ``MISSING``, or ``-`` where that framework is
not installed). Exit status 1 if one is missing."""

from __future__ import annotations

import importlib
import sys

from accum_optimizer import _compat, _packages


def _packages_for(distribution: str) -> list:
    names = {"tensorflow": ["tensorflow"], "keras": ["keras"], "tf_keras": ["tf_keras", "keras"],
             "tensorflow-addons": ["tensorflow_addons"]}[distribution]
    found = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        major = _packages.major(module)
        if distribution == "keras" and major < 3 or distribution == "tf_keras" and major != 2:
            continue
        found.append(module)
    return found


def main() -> int:
    for name in ("tf", "keras3", "keras3_jax", "keras2"):
        try:
            importlib.import_module(f"accum_optimizer._compat.{name}")
        except ImportError:
            pass
    missing = 0
    for entry in _compat.REGISTRY:
        packages = _packages_for(entry.distribution)
        states = []
        for package in packages:
            try:
                entry.probe(package)
                states.append(f"ok in {package.__name__} {package.__version__}")
            except Exception as e:  # noqa: BLE001 - report, don't stop
                missing += 1
                states.append(f"MISSING in {package.__name__} {package.__version__} ({type(e).__name__}: {e})")
        print(f"- {entry.symbol}\n    why: {entry.reason}\n    checked: {entry.checked}\n"
              f"    here: {'; '.join(states) or '- (not installed)'}")
    print(f"{len(_compat.REGISTRY)} private symbols declared, {missing} missing here.")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
