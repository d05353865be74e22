"""Max difference from the batch-N·B reference per legacy / tfa optimizer.

    TF_CPP_MIN_LOG_LEVEL=3 .venvs/tf215/bin/python tests/support/legacy_report.py
    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 .venvs/tfkeras/bin/python tests/support/legacy_report.py

The same runs as tests/contract/test_large_batch.py, test_schedules.py and
test_ema.py for the legacy and tfa families (N=3, B=2, 3 updates, float32,
traced): the max absolute difference over the trajectory (model weights and
every inner optimizer variable after every update) and over the final inner
state. Prints a Markdown table.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
warnings.simplefilter("ignore")

import tensorflow as tf  # noqa: E402

from support import families  # noqa: E402
from support.arrays import max_abs_diff, trajectory_diff  # noqa: E402
from support.drivers import NotApplicable, driver  # noqa: E402

top = tf.keras.optimizers.Optimizer.__module__.split(".")[0]
d = driver("legacy")
print(f"TF {tf.__version__}, {top} {sys.modules[top].__version__}; N={d.N}, B={d.B}, {d.UPDATES} updates\n")
print("| family | optimizer | max diff (trajectory) | max diff (final inner state) |")
print("|---|---|---|---|")
for family in ("legacy", "tfa"):
    if not families.available(family):
        continue
    d = driver(family)
    for cases in (d.equivalence_cases(), d.schedule_cases(), d.ema_cases()):
        if isinstance(cases, NotApplicable):
            continue
        for case in cases:
            ref, acc = d.pair(case)
            print(f"| {family} | {case} | {trajectory_diff(ref.trajectory, acc.trajectory):.2e} | "
                  f"{max_abs_diff(ref.state, acc.state):.2e} |", flush=True)
