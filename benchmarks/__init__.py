"""What accumulation costs: memory, time per micro-step, sparse tables and
distributed traffic, measured (``python -m benchmarks``; docs/benchmarks.md).

The shared helpers are the ``_*.py`` modules, one concern each. None of them
imports TensorFlow at module level: the parents of the memory and sparse
benchmarks only spawn workers, so they stay light and start fast.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
