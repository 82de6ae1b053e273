"""Seeds where the answer is open (grid.seeds_until) and the paired bootstrap over test items and
seeds: the stopping rule's error rate by simulation (pure numpy / scipy, no training), the looks'
correction by hand, the planner with fake test results (an open comparison gets more seeds than a
settled one, up to the maximum), and the bootstrap's exact small cases."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as sps

from vlp.config import ConfigError
from vlp.study.adaptive import looks_of, seed_reasons, seeds_of_look, sizes_of
from vlp.study.grid import parse_grid
from vlp.study.plan import Arm, final_runs
from vlp.study import report
from vlp.study.rows import final_table
from vlp.study.stats import (holm, item_seed_bootstrap, look_level, look_sizes, paired_difference, seeds_open,
                             sequential_p)
from vlp.study.study import add_seeds

ACC = SimpleNamespace(is_main_process=True, num_processes=1)


def simulate(rng, maps: int, cells: int, sizes: list[int], half_width: float, looks: int, sd: float = 0.03):
    """``maps`` maps of ``cells`` null comparisons (paired Δ per seed ~ N(0, sd)): each walks the
    looks while seeds_open, then gives its sequential p. Returns (seeds per cell, p per cell)."""
    most = sizes[-1]
    deltas = rng.normal(0.0, sd, size=(maps, cells, most))
    n = np.full((maps, cells), sizes[0])
    active = np.ones((maps, cells), bool)
    for size in sizes:
        n[active] = size
        first = deltas[..., :size]
        active &= seeds_open(first.mean(-1), first.std(-1, ddof=1), size, half_width, looks, cells)
    mask = np.arange(most) < n[..., None]
    mean = (deltas * mask).sum(-1) / n
    std = np.sqrt((((deltas - mean[..., None]) * mask) ** 2).sum(-1) / (n - 1))
    p = sequential_p(2 * sps.t.sf(np.abs(mean) / (std / np.sqrt(n)), n - 1), looks)
    # the same p from the study's own function, on a few cells
    for m, c in ((0, 0), (1, cells - 1)):
        seeds = range(n[m, c])
        d = paired_difference({s: float(deltas[m, c, s]) for s in seeds}, {s: 0.0 for s in seeds}, looks)
        assert d["p"] == pytest.approx(p[m, c], rel=1e-9, abs=1e-12)
    return n, p


def false_resolutions(p) -> float:
    """The share of maps where Holm over the map's cells resolves at least one (null) comparison."""
    return float(np.mean([any(v["holm"] for v in holm(dict(enumerate(row))).values()) for row in p]))


@pytest.mark.parametrize("half_width", [0.01, 0.03])
def test_a_null_effect_is_resolved_in_at_most_5_percent_of_maps(half_width):
    """4 to 8 seeds by 2 (3 looks), 4 comparisons a map, 10,000 maps: with the looks' correction a
    null is resolved (after Holm) in <= 5 % of maps, and in one-comparison maps too. Without it
    (every look at 95 %) the same stopping rule resolves a null far more often: the correction
    is what keeps it honest."""
    rng = np.random.default_rng(43)
    sizes = look_sizes(4, 2, 8)
    n, p = simulate(rng, 10_000, 4, sizes, half_width, looks=3)
    assert false_resolutions(p) <= 0.05
    assert set(np.unique(n)) <= {4, 6, 8} and (n == 8).any() and (n < 8).any()  # the seeds depend on the data
    _, p1 = simulate(rng, 10_000, 1, sizes, half_width, looks=3)
    assert false_resolutions(p1) <= 0.05
    _, naive = simulate(rng, 10_000, 1, sizes, half_width, looks=1)
    assert false_resolutions(naive) > 0.055  # the uncorrected looks: alpha spent up to 3 times (SE 0.002)


def test_looks_and_their_correction_by_hand():
    assert look_sizes(4, 2, 8) == [4, 6, 8] and look_sizes(4, 3, 8) == [4, 7, 8] and look_sizes(4, 2, 4) == [4]
    assert look_level(3) == pytest.approx(1 - 0.05 / 3)
    arm, ref = {0: 0.30, 1: 0.32, 2: 0.28}, {0: 0.25, 1: 0.26, 2: 0.25}  # Δ .05 .06 .03, t² = 28, 2 df
    plain, corrected = paired_difference(arm, ref), paired_difference(arm, ref, looks=3)
    p_t = 1 - math.sqrt(14 / 15)
    assert corrected["p_t"] == pytest.approx(p_t, rel=1e-9) and corrected["p"] == pytest.approx(3 * p_t, rel=1e-9)
    half = sps.t.ppf(1 - 0.05 / 6, 2) * math.sqrt(7e-4 / 3) / math.sqrt(3)
    assert corrected["lo"] == pytest.approx(0.14 / 3 - half, rel=1e-9) and corrected["lo"] < plain["lo"]
    assert plain["resolved"] and corrected["resolved"] == (corrected["p"] < 0.05)
    # the rule: open while the corrected interval holds 0 and is wider than the target
    assert bool(seeds_open(0.0, 0.04, 4, 0.01, 3)) and not bool(seeds_open(0.0, 0.001, 4, 0.01, 3))
    assert not bool(seeds_open(0.2, 0.04, 4, 0.01, 3))  # resolved: settled
    # over a family of 9 cells: t at 1 - 0.05 / (2 · 27) with 3 df; a Δ of .05 ± .02 (4 seeds) is open there only
    assert not bool(seeds_open(0.05, 0.02, 4, 0.01, 3)) and bool(seeds_open(0.05, 0.02, 4, 0.01, 3, 9))
    assert sps.t.ppf(1 - 0.05 / 54, 3) * 0.02 / 2 > 0.05 > sps.t.ppf(1 - 0.05 / 6, 3) * 0.02 / 2


def _grid(**extra):
    return parse_grid({"losses": ["infonce", "flatnce"], "batch_per_device": [8, 128, 32], "seeds": [0, 1],
                       "final_seeds": [0, 1, 2, 3], "optimizers": ["adamw"], "sweep": {"optim.lr": [1e-3]},
                       "metric": "mean_R@10", "seeds_until": {"half_width": 1.0, "max_seeds": 8, "step": 2}, **extra})


# FlatNCE − InfoNCE per seed: batch 8 open at every look; batch 128 resolved at 4 seeds; batch 32 pinned near 0
DELTAS = {8: [0.05, -0.05, 0.04, -0.04, 0.03, -0.03, 0.02, -0.02], 128: [-0.26, -0.25, -0.27, -0.26],
          32: [0.001, -0.001, 0.0005, -0.0005]}


def _fake_walk(log):
    def walk(runs, ranked=True):
        log.append(sorted(r.name for r in runs))
        return [{"run": r.name, "arm": r.arm, "setting": r.setting, "seed": r.seed, "status": "ok",
                 "test/mean_R@10": 0.5 + (DELTAS[r.arm.batch_per_device][r.seed] if r.arm.loss == "flatnce" else 0.0),
                 "test/mean_R@1": 0.2} for r in runs]
    return walk


def test_an_open_comparison_gets_more_seeds_than_a_settled_one_up_to_the_maximum():
    grid, log = _grid(), []
    assert sizes_of(grid) == [4, 6, 8] and looks_of(grid) == 3
    assert seeds_of_look(grid, 1) == [4, 5] and seeds_of_look(grid, 2) == [6, 7]
    best = {Arm("", "", loss, "adamw", b): (("optim.lr", 1e-3),) for loss in ("infonce", "flatnce") for b in (8, 32, 128)}
    walk = _fake_walk(log)
    finals = walk(final_runs(grid, best))
    rows = add_seeds(walk, grid, ACC, best, finals)
    assert log[1] == sorted(f"{loss}_adamw_b8_lr0.001_s{s}" for loss in ("infonce", "flatnce") for s in (4, 5))
    assert log[2] == sorted(f"{loss}_adamw_b8_lr0.001_s{s}" for loss in ("infonce", "flatnce") for s in (6, 7))
    assert len(log) == 3  # at 8 seeds the maximum is reached: no further look
    table = final_table(report.test_rows(rows), ("mean_R@10",), looks=looks_of(grid))
    seeds = {e["batch_per_device"]: e["n"] for e in table if e["loss"] == "flatnce"}
    assert seeds == {8: 8, 128: 4, 32: 4}
    reasons = {r["arm"].batch_per_device: (r["n"], r["reason"]) for r in seed_reasons(table, grid)}
    assert reasons == {8: (8, "open at the maximum (grid.seeds_until.max_seeds)"),
                       128: (4, "resolved (simultaneous interval excludes 0)"), 32: (4, "settled: within ± 1 points")}
    d128 = next(e for e in table if e["arm"] == Arm("", "", "flatnce", "adamw", 128))["diff/mean_R@10"]
    assert d128["looks"] == 3 and d128["p"] == pytest.approx(3 * d128["p_t"], rel=1e-12)
    from vlp.study import tables  # the report labels every paired interval with its level, 1 - 0.05 / 3
    assert "Δ vs infonce [98.33 % CI]" in tables.map_markdown(table, "mean_R@10")
    assert "resolved (98.33 % CI excludes 0): flatnce -26.0 points, 98.33 % CI [" in " ".join(
        tables.verdicts(table, "mean_R@10"))


@pytest.mark.parametrize("raw, needle", [
    ({"half_width": 1.0, "max_seeds": 8}, "must give half_width"),
    ({"half_width": 0, "max_seeds": 8, "step": 2}, "half_width must be a number of points > 0"),
    ({"half_width": 1.0, "max_seeds": 4, "step": 2}, "must exceed the 4 final seed"),
    ({"half_width": 1.0, "max_seeds": 8, "step": 0}, "step must be a positive integer"),
])
def test_seeds_until_refusals(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        _grid(seeds_until=raw)


def test_item_seed_bootstrap_exact_cases():
    # 2 seeds × 2 items, Δ = [[0, 1], [2, 3]]: each corner (one seed twice, one item twice) has
    # probability 1/16 > 2.5 %, so the percentile interval is exactly [min Δ, max Δ]
    assert item_seed_bootstrap({0: [0, 1], 1: [2, 3]}, {0: [0, 0], 1: [0, 0]}) == (0.0, 3.0)
    assert item_seed_bootstrap({0: [1, 1], 1: [1, 1]}, {0: [0, 0], 1: [0, 0]}) == (1.0, 1.0)
    assert item_seed_bootstrap({0: [1, 1]}, {0: [0, 0]}) is None  # one seed
    assert item_seed_bootstrap({0: [1, 1], 1: [1]}, {0: [0, 0], 1: [0]}) is None  # unequal item lists


def test_small_test_set_is_not_judged_on_seed_variance_alone():
    """Every seed gives the same per-item Δ on 10 items (2 better, 1 worse): no seed variance, so the
    t-interval is a point and 'resolved'; the bootstrap over items and seeds is wide and holds 0."""
    items = [1, 1, -1, 0, 0, 0, 0, 0, 0, 0]
    arm = {s: [max(v, 0) for v in items] for s in range(4)}
    ref = {s: [max(-v, 0) for v in items] for s in range(4)}
    d = paired_difference({s: float(np.mean(arm[s])) for s in arm}, {s: float(np.mean(ref[s])) for s in ref})
    assert d["std"] == 0.0 and d["resolved"]
    lo, hi = item_seed_bootstrap(arm, ref)
    assert lo < 0 < hi and lo <= 0.1 <= hi


def test_one_final_seed_has_no_interval_so_every_comparison_gets_the_next_seed():
    grid, log = _grid(final_seeds=[0], seeds_until={"half_width": 1.0, "max_seeds": 2, "step": 1}), []
    assert sizes_of(grid) == [1, 2] and seeds_of_look(grid, 1) == [1]
    best = {Arm("", "", loss, "adamw", b): (("optim.lr", 1e-3),) for loss in ("infonce", "flatnce") for b in (8, 32, 128)}
    walk = _fake_walk(log)
    rows = add_seeds(walk, grid, ACC, best, walk(final_runs(grid, best)))
    assert len(log) == 2 and len(log[1]) == 6 and all(name.endswith("_s1") for name in log[1])
    table = final_table(report.test_rows(rows), ("mean_R@10",), looks=looks_of(grid))
    assert {e["n"] for e in table} == {2}
