"""train.parallel=fsdp: FSDP2 really shards (DTensor parameters, ~1/world per rank), trains like
DDP, resumes bit-identically after SIGKILL from its DCP checkpoints, and checkpoints cross
formats and world sizes (DCP 2 -> 1 rank, DCP -> DDP, DDP .pt -> FSDP). CPU, gloo, 2 ranks."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from vlp_testing import REPO, accelerate_cmd, kill_job, overrides, run_env, run_launch

from vlp_testing import FSDP_COMMON as COMMON  # noqa: E402  (shared with tests/checkpoint/test_bucket_runs.py)

ACCUM = ("train.accum_steps=2", "optim.grad_clip=0.5")  # micro-steps without grad sync; clipping


def _config(shards, out, *extra):
    from vlp.experiment import load_config

    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", *COMMON, *extra])


def _copy_checkpoint(src: Path, run: Path) -> None:
    (run / "checkpoints").mkdir(parents=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, run / "checkpoints" / src.name)


def _trainer_runs(rank, world, shards, root):
    """In 2 gloo ranks (Accelerate on the existing process group, as under `accelerate launch`):
    DDP and FSDP runs with checkpoints every 4 steps, then resumes from step 4 across formats
    (DDP .pt -> FSDP, DCP -> DDP) and within FSDP. Writes shard figures and the FSDP run's
    gathered full model + optimizer state for the checks in the tests."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from accelerate.state import AcceleratorState

    from vlp.train import parallel
    from vlp.train.loop import Trainer

    os.environ.update(ACCELERATE_USE_CPU="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    root = Path(root)

    def run(name, parallel_mode, resume_from=None, extra=()):
        if resume_from is not None and rank == 0:
            _copy_checkpoint(root / resume_from, root / name)
        dist.barrier()
        extra = [f"train.parallel={parallel_mode}", *extra] + (["train.resume=latest"] if resume_from else [])
        AcceleratorState._reset_state()  # precision may differ from the previous run's (the group stays)
        trainer = Trainer(_config(shards, root / name, *extra))
        trainer.train()
        return trainer

    run("ddp", "ddp")
    run("ddp_accum", "ddp", None, ACCUM)
    run("fsdp_accum", "fsdp", None, ACCUM)
    fsdp = run("fsdp", "fsdp")
    kinds = sorted({type(p).__name__ for p in fsdp.model.parameters()})
    local = sum(parallel.local(p).numel() for p in fsdp.model.parameters())
    from bench._common import rank_bytes  # the benchmark's measure (bench/fsdp_cost.py)

    params, optim = rank_bytes(fsdp.model, fsdp.torch_optimizer)
    full = get_state_dict(fsdp.model, fsdp.torch_optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, root / "fsdp_full_state.pt")
    (root / f"shards_rank{rank}.json").write_text(json.dumps(
        {"kinds": kinds, "local_numel": local, "param_bytes": params, "optim_bytes": optim}))
    bf16 = run("fsdp_bf16", "fsdp", None, ("train.precision=bf16",))
    (root / f"bf16_dtypes_rank{rank}.json").write_text(json.dumps(
        sorted({str(parallel.local(p).dtype) for p in bf16.model.parameters()})))
    run("fsdp_from_ddp", "fsdp", "ddp/checkpoints/step_00000004.pt")
    run("ddp_from_dcp", "ddp", "fsdp/checkpoints/step_00000004")
    run("fsdp_resumed", "fsdp", "fsdp/checkpoints/step_00000004")


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_runs")
    run_distributed(_trainer_runs, 2, (tiny_shards, str(root)), timeout_s=400)
    return root


def _weights(run: Path) -> dict:
    return torch.load(run / "open_clip_model.pt", weights_only=True)["state_dict"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiproc
def test_fsdp_params_are_dtensor_shards(runs):
    r0, r1 = (json.loads((runs / f"shards_rank{r}.json").read_text()) for r in range(2))
    full = sum(v.numel() for v in _weights(runs / "fsdp").values())
    print(f"parameters per rank: {r0['local_numel']} + {r1['local_numel']} of {full}; "
          f"bytes per rank {r0['param_bytes']} params + {r0['optim_bytes']} AdamW state")
    assert r0["kinds"] == ["DTensor", "Parameter"]  # Parameter: the 0-d logit_scale, replicated
    assert r0["local_numel"] + r1["local_numel"] == full + 1
    assert abs(r0["local_numel"] - full / 2) < 0.01 * full
    assert abs(r0["optim_bytes"] - 2 * r0["param_bytes"]) < 0.01 * r0["param_bytes"]  # exp_avg, exp_avg_sq


@pytest.mark.multiproc
def test_fsdp_equals_ddp(runs):
    for name in ("fsdp", "ddp"):
        ckpts = sorted(p.name for p in (runs / name / "checkpoints").iterdir() if not p.name.endswith(".manifest.json"))
        suffix = "" if name == "fsdp" else ".pt"
        assert ckpts == [f"step_{s:08d}{suffix}" for s in (4, 8, 12)], ckpts
    worst = _max_diff(_weights(runs / "fsdp"), _weights(runs / "ddp"))
    print(f"FSDP vs DDP after 12 steps (fp32): max |weight diff| = {worst:.2e}")
    assert worst < 1e-5
    log = lambda run: [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    for a, b in zip(log(runs / "fsdp"), log(runs / "ddp")):
        if "infonce" in a:
            assert a["infonce"] == pytest.approx(b["infonce"], abs=1e-5)


@pytest.mark.multiproc
def test_fsdp_equals_ddp_with_accumulation_and_clipping(runs):
    worst = _max_diff(_weights(runs / "fsdp_accum"), _weights(runs / "ddp_accum"))
    print(f"FSDP vs DDP, accum_steps=2 and grad_clip (fp32): max |weight diff| = {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.multiproc
def test_fsdp_bf16_policy_trains_like_fp32(runs):
    """precision=bf16: blocks compute in bf16 (MixedPrecisionPolicy), master weights and AdamW
    state stay fp32, and the run follows the fp32 one within bf16 rounding."""
    assert json.loads((runs / "bf16_dtypes_rank0.json").read_text()) == ["torch.float32"]
    log = lambda run: [r["infonce"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
                       if "infonce" in r]
    low, full = log(runs / "fsdp_bf16"), log(runs / "fsdp")
    worst_loss = max(abs(a - b) for a, b in zip(low, full))
    worst_weight = _max_diff(_weights(runs / "fsdp_bf16"), _weights(runs / "fsdp"))
    print(f"FSDP bf16 vs fp32 over 12 steps: max |InfoNCE diff| = {worst_loss:.3f}, "
          f"max |weight diff| = {worst_weight:.2e}")
    assert len(low) == len(full) == 12 and worst_loss < 0.05 and 0 < worst_weight < 2e-2


def _launch(shards, out, *extra, wait=True):
    cmd = accelerate_cmd("-m", "vlp", "train", "-c", "configs/demo.yaml",
                         *overrides(f"data.train_shards={shards['train']}", f"train.output_dir={out}", *COMMON,
                                    "train.parallel=fsdp", *extra))
    env = run_env() | {"ACCELERATE_USE_CPU": "1"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    return run_launch(cmd, cwd=REPO, env=env, timeout=300)


@pytest.mark.multiproc
def test_fsdp_sigkill_and_resume_is_bit_identical(runs, tiny_shards, tmp_path):
    """`accelerate launch`, every step a DCP checkpoint, SIGKILL of the whole job after step 6,
    resume=latest: the same weights, bit for bit, as the uninterrupted FSDP run."""
    from vlp.checkpoint import files as ckpt

    child = _launch(tiny_shards, tmp_path, "train.checkpoint_every=1", wait=False)
    target = tmp_path / "checkpoints" / "step_00000006"
    deadline = time.time() + 240
    while not target.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    kill_job(child.pid)
    child.wait()
    assert target.is_dir()
    from vlp.checkpoint.storage import RunFolder
    from vlp.checkpoint.checkpointer import list_checkpoints

    for name in list_checkpoints(RunFolder(tmp_path / "checkpoints")):  # only whole ones (META_FILE last)
        assert ckpt.load_valid(tmp_path / "checkpoints" / name)["train"]["step"] == int(name[5:])
    proc = _launch(tiny_shards, tmp_path, "train.checkpoint_every=1", "train.resume=latest")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    assert not list((tmp_path / "checkpoints").glob(".*.tmp*"))
    assert _max_diff(_weights(tmp_path), _weights(runs / "fsdp")) == 0.0


@pytest.mark.multiproc
def test_fsdp_resume_from_dcp_is_bit_identical(runs):
    assert _max_diff(_weights(runs / "fsdp_resumed"), _weights(runs / "fsdp")) == 0.0


@pytest.mark.multiproc
def test_checkpoints_cross_formats(runs):
    worst_in = _max_diff(_weights(runs / "fsdp_from_ddp"), _weights(runs / "ddp"))
    worst_out = _max_diff(_weights(runs / "ddp_from_dcp"), _weights(runs / "fsdp"))
    print(f"DDP .pt -> FSDP resume vs DDP: {worst_in:.2e}; DCP -> DDP resume vs FSDP: {worst_out:.2e}")
    assert worst_in < 1e-5 and worst_out < 1e-5


@pytest.mark.multiproc
def test_dcp_reshards_two_ranks_to_one(runs):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from vlp.checkpoint import files as ckpt
    from vlp.train import parallel

    path = runs / "fsdp" / "checkpoints" / "step_00000012"
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                                      "meta.pt"]
    meta = ckpt.load_valid(path)
    assert meta["train"]["step"] == 12 and meta["world_size"] == 2 and len(meta["rng"]) == 2 and "model" not in meta
    full_model, full_optim = torch.load(runs / "fsdp_full_state.pt", weights_only=True)

    # 1 process, no process group, another init: DCP reads the 2-rank shards as whole tensors
    model, make_opt = _tiny_model_and_optimizer(1)
    opt = make_opt(model)
    state = parallel.sharded_state(model, opt)
    ckpt.load_sharded(state, path)
    parallel.set_sharded_state(model, opt, state)
    got_model, got_optim = get_state_dict(model, opt)
    assert got_model.keys() == full_model.keys()
    for k, v in full_model.items():
        assert torch.equal(got_model[k], v), k
    assert got_optim["state"].keys() == full_optim["state"].keys()
    for name, s in full_optim["state"].items():
        for key, v in s.items():
            assert torch.equal(got_optim["state"][name][key], v), (name, key)


def _tiny_model_and_optimizer(seed: int):
    from vlp.config import Config
    from vlp.models.model import build_model
    from vlp.train.optim import param_groups

    cfg = Config()
    cfg.model.name, cfg.loss.temperature = "vlp-micro", "learnable"
    torch.manual_seed(seed)
    model = build_model(cfg.model, cfg.loss)[0]
    return model, lambda m: torch.optim.AdamW(param_groups(m, 0.1), lr=1e-3, fused=True)


def test_fsdp_refuses_what_it_cannot_do(tiny_shards, tmp_path):
    from vlp.config import ConfigError
    from vlp.train.loop import Trainer

    with pytest.raises(ConfigError, match=r"train.parallel=fsdp does not support train.precision=fp16 \(use bf16\)"):
        _config(tiny_shards, tmp_path, "train.parallel=fsdp", "train.precision=fp16")
    with pytest.raises(ConfigError, match="does not support train.compile=true"):
        _config(tiny_shards, tmp_path, "train.parallel=fsdp", "train.compile=true")
    with pytest.raises(ConfigError, match=r"needs >= 2 processes"):
        Trainer(_config(tiny_shards, tmp_path, "train.parallel=fsdp"))


@pytest.mark.multiproc
def test_vlp_eval_reads_a_dcp_checkpoint(runs):
    from vlp.eval.checkpoints import load_model_from_checkpoint

    model, _, _ = load_model_from_checkpoint(str(runs / "fsdp" / "checkpoints" / "step_00000012"))
    final = _weights(runs / "fsdp")  # the consolidated export at the end of the same run
    assert all(torch.equal(v, final[k]) for k, v in model.clip.state_dict().items())


@pytest.mark.multiproc
def test_trainer_resumes_a_two_rank_dcp_checkpoint_in_one_process(runs, tiny_shards, tmp_path):
    """World size 2 -> 1 through the trainer (train.resume_mode=continue allows the change):
    DCP reads the 2-rank shards into the 1-process replica, AdamW state included."""
    from vlp.eval.checkpoints import load_sharded_full
    from vlp.train.loop import Trainer

    src = runs / "fsdp" / "checkpoints" / "step_00000008"
    _copy_checkpoint(src, tmp_path)
    trainer = Trainer(_config(tiny_shards, tmp_path, "train.resume=latest", "train.resume_mode=continue"))
    trainer.maybe_resume()
    assert trainer.world == 1 and trainer.step == 8 and trainer.samples_seen == 128
    saved = load_sharded_full(src)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in trainer.unwrapped.clip.state_dict().items())
    steps = {float(s["step"]) for s in trainer.torch_optimizer.state_dict()["state"].values()}
    assert steps == {8.0}


@pytest.mark.multiproc
def test_incomplete_dcp_checkpoints_are_refused_by_name(runs, tmp_path):
    from vlp.checkpoint import files as ckpt

    for broken, what in [("__1_0.distcp", "__1_0.distcp holds .* bytes, its manifest says"), (".metadata", "no .metadata"),
                         ("meta.pt", "no meta.pt")]:
        path = tmp_path / broken / "step_00000008"
        shutil.copytree(runs / "fsdp" / "checkpoints" / "step_00000008", path)
        if broken.endswith(".distcp"):  # a rank's shard file cut short
            data = (path / broken).read_bytes()
            (path / broken).write_bytes(data[: len(data) // 2])
        else:
            (path / broken).unlink()
        with pytest.raises(ckpt.CheckpointError, match=what):
            ckpt.load_valid(path)
