"""The one support package of the test suite (``tests/`` is on ``sys.path``,
see ``pyproject.toml``): family guards, the batch-N·B references, the
per-family drivers of the contract tests, and the multi-worker helpers."""
