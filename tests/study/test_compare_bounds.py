"""Bounds from the problem, not from one data set: the shipped map's grid.sweep_bounds let an arm
whose optimum lies far outside the sweep (a small set trained for many epochs wants a low rate)
walk to an interior selection, where the old [1e-4, 0.1] stopped it at the bound. In process, fake
val results (a parabola in log10 lr peaking at the arm's optimum), the study's own tune()."""
import math
from types import SimpleNamespace

import pytest

from vlp.study.compare import load_compare_config
from vlp.study.grid import parse_grid
from vlp.study.study import tune
from vlp.study.tuning import edge_notes
from vlp_testing import REPO

ACC = SimpleNamespace(is_main_process=True, num_processes=1)
OPTIMUM = {"infonce": 2e-5, "flatnce": 0.3}  # both outside [1e-4, 0.1]


def _walk(runs, ranked=True):
    return [{"run": r.name, "arm": r.arm, "setting": r.setting, "seed": r.seed, "status": "ok",
             "val/mean_R@10": 0.5 - (math.log10(dict(r.setting)["optim.lr"]) - math.log10(OPTIMUM[r.arm.loss])) ** 2}
            for r in runs]


@pytest.mark.parametrize("config", ["compare_small_batch.yaml", "compare_gpu_vitb32.yaml", "compare_your_data.yaml"])
def test_shipped_bounds_reach_an_interior_optimum_the_old_ones_did_not(config):
    _, grid = load_compare_config(REPO / "configs" / config,  # cut to 2 losses at batch 8, one data set (the config's)
                                  ["grid.losses=[infonce,flatnce]", "grid.batch_per_device=[8]", "grid.datasets=null",
                                   "grid.regimes={scratch: {}}",
                                   "grid.accum_price=null"])
    assert grid.sweep_bounds["optim.lr"][0] <= 1e-6 and grid.sweep_bounds["optim.lr"][1] >= 1.0
    rows, best, tried = tune(_walk, grid, ACC)
    chosen = {arm.loss: dict(setting)["optim.lr"] for arm, setting in best.items()}
    for loss, lr in chosen.items():  # the nearest value of the x3 walk: within a factor sqrt(3) of the optimum
        assert abs(math.log(lr / OPTIMUM[loss])) <= math.log(3) / 2 + 1e-6, (loss, lr)
    assert edge_notes(grid, best, tried) == []  # interior: no arm ends at an edge or a bound
    old = parse_grid({**{k: getattr(grid, k) for k in ("losses", "batch_per_device", "seeds", "optimizers")},
                      "sweep": grid.sweep, "sweep_bounds": {"optim.lr": [1e-4, 0.1]}})
    _, old_best, old_tried = tune(_walk, old, ACC)
    assert {n["kind"] for n in edge_notes(old, old_best, old_tried)} == {"bound"}
