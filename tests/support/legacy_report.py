"""Max difference from the batch-N·B reference per legacy / tfa optimizer.

    TF_CPP_MIN_LOG_LEVEL=3 .venvs/tf215/bin/python tests/support/legacy_report.py
    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 .venvs/tfkeras/bin/python tests/support/legacy_report.py

The same runs as tests/test_legacy_equivalence.py and tests/test_tfa.py
(N=3, B=2, 3 updates, float32, traced): the max absolute difference over the
trajectory (model weights and every inner optimizer variable after every
update). Prints a Markdown table.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
warnings.simplefilter("ignore")

from support import families  # noqa: E402
from support import reference_keras2 as R  # noqa: E402
import tensorflow as tf  # noqa: E402
from test_legacy_equivalence import B, LEGACY, N, UPDATES, VARIANTS  # noqa: E402

tables = [("legacy", LEGACY), ("legacy", VARIANTS)]
if families.available("tfa"):
    from test_tfa import TFA

    tables.append(("tfa", TFA))
top = tf.keras.optimizers.Optimizer.__module__.split(".")[0]
print(f"TF {tf.__version__}, {top} {sys.modules[top].__version__}; N={N}, B={B}, {UPDATES} updates\n")
print("| family | optimizer | max diff (trajectory) | max diff (final inner state) |")
print("|---|---|---|---|")
for family, table in tables:
    for name, make in table.items():
        ref, acc = R.run_pair(make, N, B, UPDATES)
        print(f"| {family} | {name} | {R.trajectory_diff(ref, acc):.2e} | {R.state_diff(ref, acc):.2e} |", flush=True)
if families.available("tfa"):
    import tensorflow_addons as tfa

    ref, acc = R.run_pair(lambda m: tfa.optimizers.RectifiedAdam(0.05, total_steps=6, warmup_proportion=0.5,
                                                                 min_lr=0.01), N, B, 6)
    print(f"| tfa | RectifiedAdam (6 updates) | {R.trajectory_diff(ref, acc):.2e} | {R.state_diff(ref, acc):.2e} |")
