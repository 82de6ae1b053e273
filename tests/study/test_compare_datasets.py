"""`vlp compare` on two packaged data sets, end to end: the shipped map config cut to a tiny grid
(2 losses, batch 8, 32 samples, 2 sweep seeds, one lr bounded above by the next), so that every
arm's sweep is extended once and ends at its bound, val and test are ranked at 2 budget points,
and the report has a table per data set and the verdicts across them."""
import pytest
import json

import forked
from vlp_testing import PYTHON, REPO, run_env

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes


def test_cli_map_on_two_data_sets(tmp_path):
    out = tmp_path / "map"
    proc = forked.run(
        [PYTHON, "-m", "vlp", "compare", "-c", str(REPO / "configs/compare_small_batch.yaml"), "--quick",
         f"grid.out_dir={out}", "train.samples=32", "grid.warmup_samples=8", "grid.losses=[infonce,flatnce]",
         "grid.optimizers=[adamw]", "grid.batch_per_device=[8]", "grid.seeds=[0,1]", "grid.final_seeds=[0,1]",
         "grid.sweep={optim.lr: [0.001]}", "grid.sweep_bounds={optim.lr: [0.001, 0.003]}", "grid.budget_points=2",
         "grid.regimes={scratch: {}}", "grid.datasets=[openmoji,material_icons]", "grid.accum_price=null",
         "grid.workers=1"],
        cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for dataset in ("openmoji", "material_icons"):  # lr 0.001, then its extension 0.003, 2 seeds each
        for loss in ("infonce", "flatnce"):
            for lr in ("0.001", "0.003"):
                for seed in (0, 1):
                    assert (out / f"{dataset}_scratch_{loss}_adamw_b8_lr{lr}_s{seed}" / "eval_items.json").is_file()
    run = out / "material_icons_scratch_infonce_adamw_b8_lr0.001_s0"
    points = json.loads((run / "eval_points.json").read_text())
    assert sorted(points, key=int) == ["16", "32"]  # 4 steps of 8, ranked at 2 and 4
    assert points["32"] == json.loads((run / "eval_items.json").read_text())
    text = (out / "study.md").read_text()
    assert "### openmoji" in text and "### material_icons" in text and "**openmoji · scratch**" in text
    assert "## Budget and epochs" in text and "| material_icons · scratch |" in text
    assert "Selected at a declared bound (grid.sweep_bounds optim.lr: [0.001, 0.003]" in text
    assert "openmoji/scratch/infonce/adamw/b8: optim.lr=" in text
    assert "## Verdicts across data sets (test)" in text and "**At the val-best budget point** (rule: per arm" in text
    assert "| scratch | adamw | 8 | flatnce |" in text
    assert "| openmoji · scratch | adamw | 8 |" in text  # the mechanism, every cell of every data set
    summary = json.loads((out / "study.json").read_text())
    assert {e["kind"] for e in summary["edges"]} == {"bound"} and len(summary["edges"]) == 4
    assert {p["samples"] for p in summary["val_best_point"]} <= {16, 32} and len(summary["val_best_point"]) == 4
    for png in ("sweep.png", "map.png", "mechanism.png", "final.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
