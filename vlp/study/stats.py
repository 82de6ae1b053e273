"""Uncertainty for `vlp compare`: pure functions of numbers, no I/O; the distributions come from
scipy.stats (no hand-typed tables). Over seeds: ``seed_summary`` (t-interval) and
``paired_difference`` (arm − reference per seed: the comparison that cancels the seed's own
effect); over a table's cells: ``holm`` and ``simultaneous_ci``; over eval items: ``bootstrap_ci``
and ``item_seed_bootstrap`` (items and seeds together); over the planned looks of grid.seeds_until:
``look_sizes``, ``look_level``, ``sequential_p`` and the rule ``seeds_open``; then ``linear_fit``
and the report's ``verdict``.
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


def seed_summary(values: Sequence[float], level: float = LEVEL) -> Optional[dict]:
    """{n, mean, std, lo, hi}: std is the sample std (0 for one value), [lo, hi] the ``level``
    t-interval of the mean (None for one value). None for no finite value."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    n, mean = len(vals), statistics.fmean(vals)
    std = statistics.stdev(vals) if n > 1 else 0.0
    half = t_quantile(n - 1, level) * std / math.sqrt(n) if n > 1 else None
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


def paired_difference(arm: dict[int, float], reference: dict[int, float], looks: int = 1) -> Optional[dict]:
    """Per-seed arm − reference over the seeds both have: seed_summary of the differences plus
    ``diffs`` (by seed), ``p`` (paired t-test, two-sided; None with one seed) and ``resolved``
    (the CI excludes 0, i.e. p < 0.05; False with one seed). Not corrected for the number
    of cells: see ``holm``. ``looks`` > 1 (grid.seeds_until: the seeds may stop at any of that
    many planned looks): the interval is at ``look_level(looks)`` and p is ``sequential_p``, so
    both stay valid whatever look the data stopped at; ``p_t`` keeps the plain t-test p."""
    seeds = sorted(set(arm) & set(reference))
    diffs = {s: arm[s] - reference[s] for s in seeds
             if arm[s] is not None and reference[s] is not None}
    summary = seed_summary(list(diffs.values()), look_level(looks))
    if summary is None:
        return None
    resolved = summary["lo"] is not None and (summary["lo"] > 0 or summary["hi"] < 0)
    p_t = t_test_p(summary["mean"], summary["std"], summary["n"])
    p = None if p_t is None else float(sequential_p(p_t, looks))
    return {**summary, "diffs": diffs, "p": p, "p_t": p_t, "looks": looks, "level": look_level(looks),
            "resolved": resolved}


# ---------------------------------------------------------------------------- seeds where the answer is open
def look_sizes(first: int, step: int, most: int) -> list[int]:
    """The planned looks of grid.seeds_until: the seeds a comparison has at each look, from the
    final seeds (``first``) by ``step`` up to ``most`` (the last look capped at it): (4, 2, 8) ->
    [4, 6, 8], (4, 3, 8) -> [4, 7, 8], (4, 2, 4) -> [4]."""
    sizes = [first]
    while sizes[-1] < most:
        sizes.append(min(sizes[-1] + step, most))
    return sizes


def look_level(looks: int, level: float = LEVEL) -> float:
    """The level of every look's interval when a comparison may stop at any of ``looks`` planned
    looks: 1 − (1 − level) / looks (Bonferroni over the looks: the chance that the interval
    misses the true Δ at *some* look is at most the sum, 1 − level, whatever rule stops it)."""
    return 1.0 - (1.0 - level) / looks


def sequential_p(p, looks: int):
    """The p-value of a comparison stopped at a data-dependent look, one of ``looks`` planned:
    min(1, looks · p) (numpy arrays too). P(sequential_p ≤ a) ≤ P(some look has p ≤ a / looks)
    ≤ a under the null, so it is a valid p-value and Holm may combine it with the others."""
    return np.minimum(1.0, looks * np.asarray(p, dtype=float))


def seeds_open(mean, std, n, half_width: float, looks: int, family: int = 1, level: float = LEVEL):
    """The stopping rule of grid.seeds_until (numpy arrays too): True where a comparison needs
    more seeds, i.e. its simultaneous interval over ``family`` comparisons and ``looks`` looks
    (Bonferroni, level 1 − (1 − level) / (family · looks): the study's "Δ after Holm" interval)
    contains 0 *and* its half-width exceeds ``half_width`` (the units of ``mean``); False once
    it is resolved or pinned within ± half_width. n >= 2. The rule may use any interval: the
    looks' correction (``sequential_p``) keeps the tests valid whatever stops the seeds."""
    mean, std, n = np.broadcast_arrays(np.asarray(mean, float), np.asarray(std, float), np.asarray(n, float))
    half = sps.t.ppf(1.0 - (1.0 - look_level(looks * family, level)) / 2.0, n - 1) * std / np.sqrt(n)
    return (np.abs(mean) <= half) & (half > half_width)


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


def item_seed_bootstrap(arm: dict[int, Sequence[float]], reference: dict[int, Sequence[float]], n_boot: int = 2000,
                        level: float = LEVEL, seed: int = 0) -> Optional[tuple[float, float]]:
    """Paired percentile bootstrap of the mean of arm − reference over test items and seeds
    together. ``arm`` / ``reference``: per seed, the per-item scores of one run (e.g. hit at k
    per test item, the same items in the same order for every run). Δ[s, j] = arm[s][j] −
    reference[s][j]; each resample draws the seeds with replacement and, independently, the items
    with replacement (the crossed design: every seed ranks the same items) and takes the mean of
    Δ over the drawn seeds × items. Seed-to-seed and item-to-item variation both widen it, so a
    small test set is not judged on seed variance alone. None with fewer than 2 common seeds or
    unequal item lists. Deterministic for a given ``seed``."""
    seeds = [s for s in sorted(set(arm) & set(reference)) if arm[s] is not None and reference[s] is not None]
    lengths = {len(arm[s]) for s in seeds} | {len(reference[s]) for s in seeds}
    if len(seeds) < 2 or len(lengths) != 1 or 0 in lengths:
        return None
    delta = np.asarray([np.subtract(arm[s], reference[s]) for s in seeds], dtype=float)
    n_seeds, n_items = delta.shape
    rng = np.random.default_rng(seed)
    seed_counts = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=n_boot)
    item_counts = rng.multinomial(n_items, np.full(n_items, 1.0 / n_items), size=n_boot)
    means = np.einsum("bs,sj,bj->b", seed_counts, delta, item_counts) / (n_seeds * n_items)
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


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


def ci_label(level: float = LEVEL) -> str:
    """0.95 -> '95 %', 0.975 -> '97.5 %' (an interval's level as the report prints it)."""
    return f"{100 * level:.4g} %"


def verdict(differences: dict[str, Optional[dict]], reference: str, metric: str, scale: float = 100.0,
            unit: str = " points") -> str:
    """One sentence: for each arm, its paired difference to ``reference`` on ``metric`` with the
    95 % CI (and its Holm-adjusted p when the difference carries one), grouped into resolved (CI
    excludes 0) and not resolved."""
    resolved, unresolved = [], []
    label = ci_label(next((d.get("level", LEVEL) for d in differences.values() if d), LEVEL))
    for arm, d in differences.items():
        if d is None:
            continue
        ci = "" if d["lo"] is None else f", {label} CI [{signed(d['lo'], scale)}, {signed(d['hi'], scale)}]"
        holm_p = "" if d.get("p_holm") is None else f", Holm p={d['p_holm']:.2g}" + (" ✓" if d["holm"] else "")
        text = f"{arm} {signed(d['mean'], scale)}{unit}{ci}, n={d['n']}{holm_p}"
        (resolved if d["resolved"] else unresolved).append(text)
    if not resolved and not unresolved:
        return f"No paired differences to {reference} on {metric} yet."
    parts = []
    if resolved:
        parts.append(f"resolved ({label} CI excludes 0): {'; '.join(resolved)}")
    if unresolved:
        parts.append(f"not resolved: {'; '.join(unresolved)}")
    return f"Paired by seed, {metric} minus {reference}'s: " + ". ".join(parts) + "."
