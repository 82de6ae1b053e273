"""Seeds where the answer is open (grid.seeds_until): after the final seeds, every paired Δ to
InfoNCE whose simultaneous interval (the map's "Δ after Holm" column: Bonferroni over its
table's m cells and the K looks) still contains 0 and is wider than ± half_width points gets
`step` more seeds, up to max_seeds; a settled comparison (resolved after the correction, or
pinned within ± half_width) gets none. Pure functions of the GridSpec, the
selection and the final table (vlp.study.study runs what they plan).

The rule is honest under this data-dependent stopping: a comparison may stop at any of K
planned looks (n0, n0 + step, ..., max_seeds), so every interval of the study is at level
1 − 0.05 / K and every p-value is min(1, K·p) (a Bonferroni split of alpha over the looks,
vlp.study.stats.look_level / sequential_p); Holm then runs over each table's cells as before.
tests/study/test_compare_seeds.py checks by simulation that a null effect is resolved in at most 5 %
of maps.
"""

from __future__ import annotations

from vlp.study.plan import REFERENCE_LOSS, Arm, Run, run_of
from vlp.study.stats import look_sizes, seeds_open

SCALE = 100.0
"""half_width is in points of grid.metric (a fraction × 100)."""


def sizes_of(grid) -> list[int]:
    """The seeds a comparison has at each planned look ([n0] without grid.seeds_until)."""
    rule, first = grid.seeds_until, len(grid.final_seeds)
    return look_sizes(first, rule.step, rule.max_seeds) if rule else [first]


def looks_of(grid) -> int:
    """K, the number of planned looks every interval and p-value of the study is corrected for."""
    return len(sizes_of(grid))


def seeds_of_look(grid, look: int) -> list[int]:
    """The new seeds of look ``look`` (1-based after the first): the next integers after the
    final seeds, the same for every comparison (seed s = the same init and data order)."""
    sizes, start = sizes_of(grid), max(grid.final_seeds) + 1
    return list(range(start + sizes[look - 1] - sizes[0], start + sizes[look] - sizes[0]))


def _is_open(d: dict, grid, looks: int) -> bool:
    """One seed has no interval at all: open."""
    return d["n"] < 2 or bool(seeds_open(d["mean"], d["std"], d["n"], grid.seeds_until.half_width / SCALE, looks,
                                           d.get("m") or 1))


def open_arms(table: list[dict], grid, n: int) -> list[Arm]:
    """The arms (non-reference) whose paired Δ on grid.metric has exactly ``n`` seeds (it reached
    this look) and is open: its simultaneous interval (over its table's m cells and the looks)
    contains 0 and its half-width exceeds grid.seeds_until.half_width points, or it has one seed
    (no interval yet)."""
    looks = looks_of(grid)
    return [e["arm"] for e in table if (d := e.get(f"diff/{grid.metric}")) is not None and d["n"] == n
            and _is_open(d, grid, looks)]


def more_seed_runs(grid, best: dict, arms: list[Arm], seeds: list[int]) -> list[Run]:
    """The selected setting of every open arm and of its reference (InfoNCE at the same data set,
    regime, optimizer and batch) with each new seed; a reference shared by several arms runs once."""
    runs = []
    for seed in seeds:
        for arm in arms:
            for key in (arm.with_(loss=REFERENCE_LOSS), arm):
                if key in best:
                    runs.append(run_of(grid, key, best[key], seed))
    return list(dict.fromkeys(runs))


def seed_reasons(table: list[dict], grid) -> list[dict]:
    """Per comparison (non-reference arm with a paired Δ on grid.metric): {arm, n, reason}, the
    reason one of 'resolved' (its simultaneous interval excludes 0), 'within ± h' (pinned near 0),
    'open at the maximum' (max_seeds reached, still open), 'fewer seeds than planned' (failed
    runs), or 'no rule' (grid.seeds_until unset)."""
    looks, sizes, out = looks_of(grid), sizes_of(grid), []
    for e in table:
        d = e.get(f"diff/{grid.metric}")
        if d is None:
            continue
        if not grid.seeds_until:
            reason = "no rule (grid.seeds_until unset)"
        elif d.get("lo_sim") is not None and (d["lo_sim"] > 0 or d["hi_sim"] < 0):
            reason = "resolved (simultaneous interval excludes 0)"
        elif not _is_open(d, grid, looks):
            reason = f"settled: within ± {grid.seeds_until.half_width:g} points"
        elif d["n"] >= sizes[-1]:
            reason = "open at the maximum (grid.seeds_until.max_seeds)"
        else:
            reason = "fewer seeds than planned (failed runs)"
        out.append({"arm": e["arm"], "n": d["n"], "reason": reason})
    return out
