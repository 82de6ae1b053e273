"""Uncertainty for `vlp compare`: pure functions of numbers, no I/O.

- ``seed_summary``: mean, sample std and a 95 % t-interval over seeds (the run-to-run spread);
- ``paired_difference``: arm − reference per seed (same seed = same data order and init), its
  mean and 95 % t-interval: the comparison that cancels the seed's own effect;
- ``bootstrap_ci``: a percentile bootstrap over eval items (queries) of one run: how much the
  metric would move on another eval set of the same size;
- ``verdict``: one sentence saying which paired differences are resolved (95 % CI excludes 0).
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Optional, Sequence

# two-sided 95 % Student t quantiles t_{0.975, df}, df = 1..30 (then the normal 1.960)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def seed_summary(values: Sequence[float]) -> Optional[dict]:
    """{n, mean, std, lo, hi}: std is the sample std (0 for one value), [lo, hi] the 95 %
    t-interval of the mean (None for one value). None for no finite value."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    std = statistics.stdev(vals) if n > 1 else 0.0
    half = t975(n - 1) * std / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean, "std": std,
            "lo": None if half is None else mean - half, "hi": None if half is None else mean + half}


def paired_difference(arm: dict[int, float], reference: dict[int, float]) -> Optional[dict]:
    """Per-seed arm − reference over the seeds both have: seed_summary of the differences plus
    ``diffs`` (by seed) and ``resolved`` (the 95 % CI excludes 0; False with one seed)."""
    seeds = sorted(set(arm) & set(reference))
    diffs = {s: arm[s] - reference[s] for s in seeds
             if arm[s] is not None and reference[s] is not None}
    summary = seed_summary(list(diffs.values()))
    if summary is None:
        return None
    resolved = summary["lo"] is not None and (summary["lo"] > 0 or summary["hi"] < 0)
    return {**summary, "diffs": diffs, "resolved": resolved}


def bootstrap_ci(items: Sequence[float], stat: Callable[[list], float] = statistics.fmean,
                 n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` over resamples (with replacement) of ``items``,
    e.g. 0/1 hits of each eval query for R@k. Deterministic for a given seed."""
    items = list(items)
    if not items:
        raise ValueError("bootstrap_ci needs at least one item")
    rng = random.Random(seed)
    n = len(items)
    stats = sorted(stat([items[rng.randrange(n)] for _ in range(n)]) for _ in range(n_boot))
    alpha = (1.0 - level) / 2
    lo = stats[int(math.floor(alpha * (n_boot - 1)))]
    hi = stats[int(math.ceil((1 - alpha) * (n_boot - 1)))]
    return lo, hi


def signed(x: float, scale: float = 100.0) -> str:
    """x·scale with a sign and 1 decimal; 2 decimals when 1 would print a non-zero value as
    ±0.0 (a CI bound just off 0 must not read as 0)."""
    value = x * scale
    return f"{value:+.2f}" if value != 0 and abs(value) < 0.05 else f"{value:+.1f}"


_pp = signed


def verdict(differences: dict[str, Optional[dict]], reference: str, metric: str, scale: float = 100.0,
            unit: str = " points") -> str:
    """One sentence: for each arm, its paired difference to ``reference`` on ``metric`` with the
    95 % CI, grouped into resolved (CI excludes 0) and not resolved."""
    resolved, unresolved = [], []
    for arm, d in differences.items():
        if d is None:
            continue
        ci = "" if d["lo"] is None else f", 95 % CI [{_pp(d['lo'], scale)}, {_pp(d['hi'], scale)}]"
        text = f"{arm} {_pp(d['mean'], scale)}{unit}{ci}, n={d['n']}"
        (resolved if d["resolved"] else unresolved).append(text)
    if not resolved and not unresolved:
        return f"No paired differences to {reference} on {metric} yet."
    parts = []
    if resolved:
        parts.append(f"resolved (95 % CI excludes 0): {'; '.join(resolved)}")
    if unresolved:
        parts.append(f"not resolved: {'; '.join(unresolved)}")
    return f"Paired by seed, {metric} minus {reference}'s: " + ". ".join(parts) + "."
