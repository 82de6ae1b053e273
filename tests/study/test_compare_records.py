"""Old run folders still read: `vlp compare --report-only` on the records both old pipelines wrote
(a plain grid's <loss>_b<batch>_s<seed>/ with result.json, compare.json and log.jsonl; a tuned
study's <loss>_<optim>_b<batch>_<setting>_s<seed>/ with eval_items.json and eval_points.json
besides) gives the tables the two pipelines gave before they were one: results.md, runs.csv and
study.md as tests/study/records/ holds them (written by the code of 99fad36 on these folders)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vlp.study.compare import run_grid
from vlp.study.grid import parse_grid

RECORDS = Path(__file__).parent / "records"
ACC = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0, print=print,
                      wait_for_everyone=lambda: None)
BASE = {"model": {"name": "vlp-micro"}, "data": {"train_shards": "/no/train.tar", "eval_shards": "/no/val.tar"},
        "train": {"samples": 32}}
PLAIN = {"losses": ["infonce", "flatnce"], "batch_per_device": [4, 8], "seeds": [0, 1]}
STUDY = {"losses": ["infonce", "flatnce"], "batch_per_device": [8], "seeds": [0], "final_seeds": [0, 1, 2],
         "optimizers": ["adamw"], "sweep": {"optim.lr": [0.001, 0.003]}, "test_shards": "/no/test.tar",
         "metric": "mean_R@10", "budget_points": 2}


def _log(run: Path, batch: int, steps: int, seed: int) -> None:
    with open(run / "log.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"type": "train", "step": step, "samples_seen": step * batch, "infonce": 3.0 / step,
                                "log_xi": 0.5, "grad_ratio": 0.1 + 0.01 * seed + 0.001 * batch, "frac_saturated": 0.0,
                                "ess_neg": 2.0, "acc": 0.5, "logit_scale": 14.0 + seed}) + "\n")


def _ranks(n: int, shift: int) -> dict:
    return {"image_to_text": [1 + (i * 7 + shift) % 13 for i in range(n)],
            "text_to_image": [1 + (i * 5 + 2 * shift) % 11 for i in range(n)]}


def write_plain_records(out: Path) -> None:
    """What a plain grid's runs left: flatnce b8 s1 failed (compare.json and a log, no result)."""
    for loss in PLAIN["losses"]:
        for batch in PLAIN["batch_per_device"]:
            for seed in PLAIN["seeds"]:
                run = out / f"{loss}_b{batch}_s{seed}"
                run.mkdir(parents=True)
                steps = 32 // batch
                _log(run, batch, 1 if (loss, batch, seed) == ("flatnce", 8, 1) else steps, seed)
                if (loss, batch, seed) == ("flatnce", 8, 1):
                    (run / "compare.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: OOM",
                                                                  "attempts": 2, "wall_time_s": 1.5}))
                    continue
                r = 0.1 + 0.05 * seed + (0.1 if loss == "flatnce" else 0.0) + batch / 100
                (run / "result.json").write_text(json.dumps({
                    "step": steps, "samples_seen": 32, "global_batch": batch, "train_time_s": 2.0,
                    **{f"eval/{d}_R@{k}": r + k / 50 + (0.01 if d == "text_to_image" else 0.0)
                       for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)},
                    "eval/chance_R@1": 0.025}))
                (run / "compare.json").write_text(json.dumps({"status": "ok", "error": "", "attempts": 1,
                                                              "wall_time_s": 3.0 + seed}))


def write_study_records(out: Path) -> None:
    """What a tuned study's runs left: the sweep (2 lrs, seed 0), then the final seeds 1 and 2 of
    each arm's val-best lr (seed 0 reused), each ranked at 2 budget points."""
    best = {"infonce": "0.001", "flatnce": "0.003"}
    runs = [(loss, lr, 0) for loss in STUDY["losses"] for lr in ("0.001", "0.003")]
    runs += [(loss, best[loss], seed) for loss in STUDY["losses"] for seed in (1, 2)]
    for loss, lr, seed in runs:
        run = out / f"{loss}_adamw_b8_lr{lr}_s{seed}"
        run.mkdir(parents=True)
        _log(run, 8, 4, seed)
        good = 3 * (lr == best[loss]) + 2 * (loss == "flatnce") + seed
        items = {"val": _ranks(24, 9 - good), "test": _ranks(24, 8 - good)}
        early = {"val": _ranks(24, 10 - good), "test": _ranks(24, 11 - good)}
        (run / "eval_points.json").write_text(json.dumps({"16": early, "32": items}))
        (run / "eval_items.json").write_text(json.dumps(items))
        (run / "result.json").write_text(json.dumps({"step": 4, "samples_seen": 32, "global_batch": 8,
                                                     "train_time_s": 2.0, "peak_step_mem_mb": 12.5}))
        (run / "compare.json").write_text(json.dumps({"status": "ok", "error": "", "attempts": 1,
                                                      "wall_time_s": 3.0}))


@pytest.mark.parametrize("kind, grid, write, files", [
    ("plain", PLAIN, write_plain_records, ("results.md", "runs.csv")),
    ("study", STUDY, write_study_records, ("study.md",)),
])
def test_report_only_on_old_records_gives_the_old_tables(tmp_path, kind, grid, write, files):
    out = tmp_path / kind
    write(out)
    run_grid(BASE, parse_grid({**grid, "out_dir": str(out)}), report_only=True, accelerator=ACC)
    for name in files:
        assert (out / name).read_text() == (RECORDS / kind / name).read_text(), name
