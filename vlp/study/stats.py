"""Uncertainty for `vlp compare`: pure functions of numbers, no I/O; the distributions come from
scipy.stats (no hand-typed tables).

- ``seed_summary``: mean, sample std and a 95 % t-interval over seeds (the run-to-run spread);
- ``paired_difference``: arm − reference per seed (same seed = same data order and init), its
  mean, 95 % t-interval and two-sided paired t-test p-value: the comparison that cancels the
  seed's own effect;
- ``holm``: Holm-Bonferroni over a family of p-values (the cells of one table): which
  differences stay resolved when the number of cells is accounted for; ``simultaneous_ci`` the
  Bonferroni interval of each, valid for the whole family at once;
- ``bootstrap_ci``: a percentile bootstrap over eval items (queries) of one run
  (scipy.stats.bootstrap): how much the metric would move on another eval set of the same size;
- ``linear_fit``: least-squares slope with its 95 % t-interval (scipy.stats.linregress);
- ``verdict``: one sentence saying which paired differences are resolved (95 % CI excludes 0).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Hashable, Optional, Sequence

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
"""The confidence level of every interval, and 1 − the family-wise error rate of ``holm``."""


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The two-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (df >= 1):
    t_{(1+level)/2, df}, e.g. 12.706 for df = 1, 2.262 for df = 9 (scipy.stats.t.ppf)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    return float(sps.t.ppf((1.0 + level) / 2.0, df))


def seed_summary(values: Sequence[float]) -> Optional[dict]:
    """{n, mean, std, lo, hi}: std is the sample std (0 for one value), [lo, hi] the 95 %
    t-interval of the mean (None for one value). None for no finite value."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    std = statistics.stdev(vals) if n > 1 else 0.0
    half = t_quantile(n - 1) * std / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean, "std": std,
            "lo": None if half is None else mean - half, "hi": None if half is None else mean + half}


def t_test_p(mean: float, std: float, n: int) -> Optional[float]:
    """Two-sided one-sample t-test p-value of mean = 0 from n values (None for n < 2). With
    std = 0 the t statistic is infinite (p = 0) unless the mean is 0 too (p = 1)."""
    if n < 2:
        return None
    if std == 0.0:
        return 0.0 if mean != 0.0 else 1.0
    t = mean / (std / math.sqrt(n))
    return float(2.0 * sps.t.sf(abs(t), n - 1))


def paired_difference(arm: dict[int, float], reference: dict[int, float]) -> Optional[dict]:
    """Per-seed arm − reference over the seeds both have: seed_summary of the differences plus
    ``diffs`` (by seed), ``p`` (paired t-test, two-sided; None with one seed) and ``resolved``
    (the 95 % CI excludes 0, i.e. p < 0.05; False with one seed). Not corrected for the number
    of cells: see ``holm``."""
    seeds = sorted(set(arm) & set(reference))
    diffs = {s: arm[s] - reference[s] for s in seeds
             if arm[s] is not None and reference[s] is not None}
    summary = seed_summary(list(diffs.values()))
    if summary is None:
        return None
    resolved = summary["lo"] is not None and (summary["lo"] > 0 or summary["hi"] < 0)
    p = t_test_p(summary["mean"], summary["std"], summary["n"])
    return {**summary, "diffs": diffs, "p": p, "resolved": resolved}


def holm(pvalues: dict[Hashable, Optional[float]], alpha: float = 1.0 - LEVEL) -> dict[Hashable, dict]:
    """Holm-Bonferroni over the family ``pvalues`` (None: not a test, e.g. one seed; left out of
    the family). Sorted ascending, p_(i) is rejected while p_(j) <= alpha / (m − j + 1) for every
    j <= i (m tests). Returns {key: {"p_holm": adjusted p, "holm": rejected, "m": m}}, the
    adjusted p_(i) = min(1, max_{j <= i} (m − j + 1) p_(j)), so rejected <=> p_holm <= alpha."""
    tests = sorted(((p, k) for k, p in pvalues.items() if p is not None), key=lambda pk: pk[0])
    m, running, out = len(tests), 0.0, {}
    for i, (p, key) in enumerate(tests):
        running = max(running, min(1.0, (m - i) * p))
        out[key] = {"p_holm": running, "holm": running <= alpha, "m": m}
    return out


def simultaneous_ci(mean: float, std: float, n: int, m: int, level: float = LEVEL) -> tuple[float, float]:
    """The Bonferroni interval of one of ``m`` paired differences: mean ± t·std/√n with t the
    two-sided 1 − (1 − level) / m quantile (n − 1 degrees of freedom), so that all m intervals
    cover together with probability >= ``level``. Holm's step-down test has no interval of its
    own; where this interval excludes 0, Holm rejects too. n >= 2."""
    half = t_quantile(n - 1, 1.0 - (1.0 - level) / m) * std / math.sqrt(n)
    return mean - half, mean + half


def bootstrap_ci(items: Sequence[float], stat: Callable = np.mean, n_boot: int = 2000, level: float = LEVEL,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` (a numpy reduction taking ``axis``) over resamples,
    with replacement, of ``items``, e.g. 0/1 hits of each eval query for R@k
    (scipy.stats.bootstrap). Deterministic for a given seed."""
    data = np.asarray(list(items), dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap_ci needs at least one item")
    if np.all(data == data[0]):  # every resample is the same: the interval is that one value
        value = float(stat(data))
        return value, value
    res = sps.bootstrap((data,), stat, n_resamples=n_boot, confidence_level=level, method="percentile",
                        vectorized=True, random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def linear_fit(xs: Sequence[float], ys: Sequence[float], level: float = LEVEL) -> Optional[dict]:
    """Least-squares line y = intercept + slope · x (scipy.stats.linregress): {n, slope, lo, hi,
    intercept, r, p}, [lo, hi] the ``level`` t-interval of the slope (n − 2 degrees of freedom)
    and p the two-sided p-value of slope = 0. None for fewer than 3 points or one distinct x."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 3 or np.all(x == x[0]):
        return None
    fit = sps.linregress(x, y)
    half = t_quantile(len(x) - 2, level) * fit.stderr
    return {"n": len(x), "slope": float(fit.slope), "lo": float(fit.slope - half), "hi": float(fit.slope + half),
            "intercept": float(fit.intercept), "r": float(fit.rvalue), "p": float(fit.pvalue)}


def signed(x: float, scale: float = 100.0) -> str:
    """x·scale with a sign and 1 decimal; 2 decimals when 1 would print a non-zero value as
    ±0.0 (a CI bound just off 0 must not read as 0)."""
    value = x * scale
    return f"{value:+.2f}" if value != 0 and abs(value) < 0.05 else f"{value:+.1f}"


def verdict(differences: dict[str, Optional[dict]], reference: str, metric: str, scale: float = 100.0,
            unit: str = " points") -> str:
    """One sentence: for each arm, its paired difference to ``reference`` on ``metric`` with the
    95 % CI (and its Holm-adjusted p when the difference carries one), grouped into resolved (CI
    excludes 0) and not resolved."""
    resolved, unresolved = [], []
    for arm, d in differences.items():
        if d is None:
            continue
        ci = "" if d["lo"] is None else f", 95 % CI [{signed(d['lo'], scale)}, {signed(d['hi'], scale)}]"
        holm_p = "" if d.get("p_holm") is None else f", Holm p={d['p_holm']:.2g}" + (" ✓" if d["holm"] else "")
        text = f"{arm} {signed(d['mean'], scale)}{unit}{ci}, n={d['n']}{holm_p}"
        (resolved if d["resolved"] else unresolved).append(text)
    if not resolved and not unresolved:
        return f"No paired differences to {reference} on {metric} yet."
    parts = []
    if resolved:
        parts.append(f"resolved (95 % CI excludes 0): {'; '.join(resolved)}")
    if unresolved:
        parts.append(f"not resolved: {'; '.join(unresolved)}")
    return f"Paired by seed, {metric} minus {reference}'s: " + ". ".join(parts) + "."
