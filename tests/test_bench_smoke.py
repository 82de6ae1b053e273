"""Smoke test of bench/: every script runs with --quick and prints its FIGURE lines.

No timing assertions (the numbers are meaningless at these sizes and on a shared machine);
only that each benchmark still runs end to end against the current vlp and open_clip_train
APIs and reports the figures BENCHMARKS.md quotes.
"""

import re
import subprocess
import sys

import pytest

from vlp_testing import REPO, run_env

FIGURE = re.compile(r"^FIGURE (.+?) = (\S+)", re.M)

CASES = {
    "loss_cost.py": ["--quick"],
    "data_loading.py": ["--quick"],
    "train_throughput.py": ["--quick"],
    "quality.py": ["--quick"],
    "scaling.py": ["--quick"],
    "gpu_bench.py": ["--cpu", "--tiny"],
}

EXPECTED = {
    "loss_cost.py": ["loss_time_ratio flatnce/infonce", "loss_time_ratio siglip/infonce",
                     "loss_time_ratio_local flatnce/infonce", "loss_mem_saved flatnce local/full",
                     "loss_mem_peak flatnce local/full"],
    "data_loading.py": ["data_images_per_s vlp", "data_images_per_s open_clip",
                        "data_ratio vlp/open_clip", "data_ratio vlp_draft224/open_clip"],
    "train_throughput.py": ["train_samples_per_s vlp", "train_samples_per_s open_clip_train",
                            "train_ratio vlp/open_clip_train"],
    "quality.py": ["quality_mean_R@1 vlp", "quality_mean_R@1 open_clip_train",
                   "quality_ratio vlp/open_clip_train"],
    "scaling.py": ["scaling_samples_per_s 1proc", "scaling_samples_per_s 2proc", "scaling_ratio 2proc/1proc"],
    "gpu_bench.py": ["gpu_synthetic_samples_per_s vlp", "gpu_synthetic_samples_per_s open_clip",
                     "gpu_synthetic_ratio vlp/open_clip", "gpu_flops_per_step", "gpu_real_ratio vlp/open_clip"],
}


@pytest.mark.parametrize("script", list(CASES))
def test_bench_quick(script, tmp_path):
    extra = ["--out", str(tmp_path)] if script == "gpu_bench.py" else []
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *CASES[script], *extra],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    figures = dict(FIGURE.findall(proc.stdout))
    missing = [name for name in EXPECTED[script] if name not in figures]
    assert not missing, f"{script} did not print {missing}:\n{proc.stdout[-3000:]}"
    for name in EXPECTED[script]:
        float(figures[name])  # a number (nan allowed: CPU memory/MFU)
