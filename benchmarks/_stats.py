"""Summary statistics of timing samples: median, quartiles and the median's
percentile-bootstrap interval."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) without numpy."""
    xs = sorted(values)
    if not xs:
        raise ValueError("empty")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_median_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median of ``values``.

    Draws ``resamples`` samples of ``len(values)`` with replacement (numpy's
    ``default_rng(seed)``: the same values give the same interval), takes
    each one's median, and returns the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles of those medians (Efron's percentile
    interval; ``scipy.stats.bootstrap(..., method="percentile")`` computes
    the same up to its own random draws).

    Raises:
        ValueError: ``values`` is empty, or ``confidence`` is not in (0, 1),
            or ``resamples < 1``.
    """
    import numpy as np

    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_median_ci: `values` is empty; it needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_median_ci: `confidence`={confidence!r}; expected a float in (0, 1)")
    if resamples < 1:
        raise ValueError(f"bootstrap_median_ci: `resamples`={resamples!r}; expected an int >= 1")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    lo, hi = np.quantile(medians, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(lo), float(hi)


def summarize_with_ci(values: Sequence[float], confidence: float = 0.95, seed: int = 0) -> dict:
    """:func:`summarize` plus the median's percentile-bootstrap interval
    (:func:`bootstrap_median_ci`): ``ci_low``, ``ci_high``, ``confidence``."""
    out = summarize(values)
    out["ci_low"], out["ci_high"] = bootstrap_median_ci(values, confidence, seed=seed)
    out["confidence"] = confidence
    return out


def summarize(values: Sequence[float]) -> dict:
    """median, quartiles, min, max of a sample."""
    values = [float(v) for v in values]
    return {
        "median": statistics.median(values),
        "q1": quantile(values, 0.25),
        "q3": quantile(values, 0.75),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
