"""Smoke test of bench/: every script runs with --quick and prints its FIGURE lines.

No timing assertions (the numbers are meaningless at these sizes and on a shared machine);
only that each benchmark still runs end to end against the current vlp and open_clip_train
APIs and reports the figures BENCHMARKS.md quotes.

One script runs as `python bench/SCRIPT` (the command line a person types); the others run in a
few batches, each one process that imports torch, open_clip and vlp once and forks a child per
script (tests/support/bench_batch.py): each script is still its own process with its own argv, minus the
~6 CPU seconds of imports it would pay alone.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlp_testing import REPO, run_env

FIGURE = re.compile(r"^FIGURE (.+?) = (\S+)", re.M)

CASES = {
    "scaling.py": ["--quick"],
    "train_throughput.py": ["--quick"],
    "quality.py": ["--quick"],
    "loss_cost.py": ["--quick"],
    "data_loading.py": ["--quick"],
    "soak.py": ["--minutes", "0.15", "--every", "3", "--warmup", "3"],  # 4 samples over 9 s, 3 after warm-up (a slope and its SE)
    "remote_loading.py": ["--quick"],
    "gpu_bench.py": ["--cpu", "--tiny"],
    "gpu_sweep.py": ["--cpu", "--tiny", "--cli-steps", "3"],
    "step_cost.py": ["--quick"],
    "eval_cost.py": ["--quick"],
    "augment_equivalence.py": ["--quick"],
    "fsdp_cost.py": ["--quick"],
    "checksum_cost.py": ["--quick"],
    "feature_cache.py": ["--quick"],
    "many_ranks.py": ["--quick", "--only", "collectives"],  # ~13 s; the 2-rank train part takes ~95 s
    "driver_scale.py": ["--quick"],
}
CLI = "scaling.py"  # run as `python bench/scaling.py --quick`: its CPU is in its children (vlp runs), not its imports
BATCHES = {  # the rest: about 50 CPU seconds a batch once batched (2026-12-02); the CLI one and these start first
    "quality+features+step+checksum+sweep": ["quality.py", "feature_cache.py", "step_cost.py", "checksum_cost.py",
                                             "gpu_sweep.py"],
    "soak+fsdp+augment+loss+driver": ["soak.py", "fsdp_cost.py", "augment_equivalence.py", "loss_cost.py",
                                      "driver_scale.py"],
    "data+train+remote+ranks+gpu+eval": ["data_loading.py", "train_throughput.py", "remote_loading.py",
                                         "many_ranks.py", "gpu_bench.py", "eval_cost.py"],
}

EXPECTED = {
    "loss_cost.py": ["loss_time_ratio flatnce/infonce", "loss_time_ratio siglip/infonce",
                     "loss_time_ratio_local flatnce/infonce", "loss_mem_saved flatnce local/full",
                     "loss_mem_peak flatnce local/full"],
    "data_loading.py": ["data_images_per_s vlp", "data_images_per_s open_clip",
                        "data_ratio vlp/open_clip", "data_ratio vlp_uint8/open_clip",
                        "data_ratio vlp_float/open_clip", "data_images_per_cpu_s vlp", "data_images_per_cpu_s decode_dct"],
    "augment_equivalence.py": ["augment_box_identical", "augment_mean_abs_diff", "augment_psnr_median",
                               "augment_ks_p_channel_mean"],
    "train_throughput.py": ["train_samples_per_s vlp", "train_samples_per_s open_clip_train",
                            "train_ratio vlp/open_clip_train"],
    "quality.py": ["quality_mean_R@1 vlp", "quality_mean_R@1 open_clip_train",
                   "quality_ratio vlp/open_clip_train"],
    "step_cost.py": ["step_time infonce", "step_time_ratio flatnce/infonce",
                     "step_time_ratio flatnce_t_infonce/infonce", "step_time_ratio siglip/infonce"],
    "eval_cost.py": ["eval_classifier_s trim", "eval_classifier_s no_trim", "eval_classifier_speedup trim",
                     "eval_retrieval_speedup trim", "eval_trim_max_abs_diff"],
    "remote_loading.py": ["remote_images_per_s local", "remote_images_per_s http", "remote_ratio http/local"],
    "fsdp_cost.py": ["fsdp_step_time_ratio fsdp/ddp", "fsdp_bytes_per_rank_ratio fsdp/ddp"],
    "checksum_cost.py": ["checksum_verify_s_per_gb vlp-micro", "checksum_verify_s_per_gb 50MB",
                         "checksum_save_overhead 50MB", "checksum_load_overhead 50MB"],
    "soak.py": ["soak_slope_per_10k_batches mainrss", "soak_slope_per_10k_batches workersrss",
                "soak_slope_per_10k_batches mainfds", "soak_slope_per_10k_batches workersfds", "soak_batches"],
    "many_ranks.py": ["collective_wall_ms gather@2", "collective_wall_ms sogclr@2", "collective_wall_ms skip_counts@2",
                      "collective_wall_ms nonfinite@2", "collective_wall_ms ckpt_meta@2"],
    "feature_cache.py": ["feature_cache_samples_per_s uncached", "feature_cache_samples_per_s cached",
                         "feature_cache_build_s", "feature_cache_speedup loop"],
    "driver_scale.py": ["driver_runs_in_flight", "driver_cpu_ms_per_poll_round", "driver_peak_rss_mb",
                        "driver_slurm_calls sbatch", "driver_sacct_argv_bytes"],
    "scaling.py": ["scaling_samples_per_s 1proc", "scaling_samples_per_s 2proc", "scaling_ratio 2proc/1proc"],
    "gpu_bench.py": ["gpu_synthetic_samples_per_s vlp", "gpu_synthetic_samples_per_s open_clip",
                     "gpu_synthetic_ratio vlp/open_clip", "gpu_flops_per_step", "gpu_real_ratio vlp/open_clip",
                     "gpu_real_ratio vlp_gpu_decode/vlp", "gpu_host_syncs_per_step vlp"],
    "gpu_sweep.py": [f"gpu_sweep_samples_per_s {system} b={b}" for system in ("vlp_eager", "vlp_graphs", "open_clip",
                                                                               "bare") for b in (4, 8)]
                    + ["gpu_sweep_flops_per_step b=8", "gpu_cli_samples_per_s cli_eager",
                       "gpu_graphs_max_abs_diff infonce", "gpu_graphs_nan_step_untouched sogclr", "gpu_graphs_skipped infonce",
                       "gpu_sweep_host_syncs_per_step vlp_graphs b=4"],
}


BUDGET_S = 600  # one script's limit (alone, idle: 10-40 s; ~4x that under a load of 8)


@pytest.fixture
def bench_data():
    """The data the scripts share, built by the first test (the scripts build it themselves when
    missing, unguarded against each other): the OpenMoji shards and the quick runs' 128 synthetic
    JPEGs. Under a file lock, as pytest-xdist's workers run these tests side by side; the next
    tests find them built (a check of two files)."""
    from filelock import FileLock

    from bench._common import jpeg_shards
    from vlp.data.embedded import prepare_shards

    (REPO / ".cache").mkdir(exist_ok=True)
    with FileLock(REPO / ".cache" / "bench_smoke.lock"):
        prepare_shards(REPO / ".cache" / "shards" / "openmoji")
        jpeg_shards(REPO / ".cache" / "bench", 128, per_shard=32)  # data_loading / remote_loading --quick


def _argv(script: str, tmp_path) -> list[str]:
    return [*CASES[script], *(["--out", str(tmp_path / "gpu")] if script.startswith("gpu_") else [])]


def _problems(script: str, code, stdout: str, stderr: str) -> list[str]:
    """What is wrong with one script's run: its exit, a figure it did not print or that is not a number."""
    if code == "timeout":
        return [f"bench/{script} did not finish in {BUDGET_S} s; its output so far:\n{(stdout + stderr)[-3000:]}"]
    if code != 0:
        return [f"bench/{script} exited {code}:\n{(stdout + stderr)[-3000:]}"]
    figures = dict(FIGURE.findall(stdout))
    missing = [name for name in EXPECTED[script] if name not in figures]
    if missing:
        return [f"{script} did not print {missing}:\n{stdout[-3000:]}"]
    for name in EXPECTED[script]:
        float(figures[name])  # a number (nan allowed: CPU memory/MFU)
    return []


def test_every_script_runs_once():
    assert sorted([CLI, *sum(BATCHES.values(), [])]) == sorted(CASES) == sorted(EXPECTED)


@pytest.mark.multiproc
def test_bench_quick_on_the_command_line(bench_data, tmp_path):
    """One script as a person runs it: its own Python, `python bench/SCRIPT ARGS`."""
    cmd = [sys.executable, str(REPO / "bench" / CLI), *_argv(CLI, tmp_path)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=BUDGET_S)
    except subprocess.TimeoutExpired as e:
        out, err = ((x or b"").decode(errors="replace") for x in (e.stdout, e.stderr))
        pytest.fail(_problems(CLI, "timeout", out, err)[0])
    assert not (problems := _problems(CLI, proc.returncode, proc.stdout, proc.stderr)), problems[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("batch", list(BATCHES))
def test_bench_quick(batch, bench_data, tmp_path):
    """The batch's scripts, each its own forked process (tests/support/bench_batch.py); every script's
    exit and figures are checked, and every failure is reported."""
    scripts = BATCHES[batch]
    logs = [tmp_path / script for script in scripts]  # LOG.out, LOG.err
    jobs = [[str(REPO / "bench" / s), _argv(s, tmp_path), str(log), BUDGET_S] for s, log in zip(scripts, logs)]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "bench_batch.py"), str(tmp_path / "jobs.json")],
                          cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=BUDGET_S * len(scripts) + 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    print(proc.stderr)  # each script's CPU seconds (`pytest -s` or a failure shows them)
    problems = sum((_problems(s, code, *(Path(f"{log}.{x}").read_text(errors="replace") for x in ("out", "err")))
                    for s, code, log in zip(scripts, codes, logs)), [])
    assert not problems, "\n\n".join(problems)
