"""train.cuda_graphs's step (vlp/train/static_step.py), run eagerly on CPU with its static
buffers, device-side learning rate and device-side skip, equals Trainer.train_step to 1e-6 in
fp32 over 20 steps for every loss of the registry, through a forced non-finite step (weights and
AdamW state bit-untouched), with accumulation, through a resume, and on 2 gloo ranks. The
capture itself needs a GPU (bench/gpu.sh); CPU runs refuse the key in one line."""
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed
from vlp_testing import REPO, run_env
from vlp.config import ConfigError
from vlp.experiment import load_config
from vlp.losses.registry import NAMES
from vlp.train.loop import Trainer
from vlp.train.static_step import StaticStep

STEPS, BAD = 20, 6  # steps compared; the 0-based step given a NaN image


def _cfg(shards, out, loss, *extra):
    return load_config(None, [
        "model.name=vlp-micro", f"data.train_shards={shards['train']}", f"train.output_dir={out}",
        "data.batch_per_device=8", f"loss.name={loss}", "train.samples=160", "optim.lr=1e-3",
        "optim.warmup_steps=3", "optim.grad_clip=1.0", "train.log_every=5", "optim.weight_decay=0.1", *extra])


def _pair(shards, tmp_path, loss, *extra):
    """(eager, static) trainers from one config, the same initial weights."""
    eager, static = (Trainer(_cfg(shards, tmp_path / name, loss, *extra)) for name in ("eager", "static"))
    static.unwrapped.load_state_dict(eager.unwrapped.state_dict())
    static.static_step = StaticStep(static, capture=False)
    return eager, static


def _with_nan(t, group: list) -> list:
    """`group` with its images through the device transform (a float batch, which the step passes
    through) and the first image all NaN: a non-finite loss for every loss of the registry."""
    from dataclasses import replace

    images = t.data.device_images(group[0].image).clone()
    images[0] = float("nan")
    return [replace(group[0], image=images), *group[1:]]


def _batches(t, n=STEPS):
    groups = t.data.groups(t.accum)
    try:
        return [next(groups) for _ in range(n)]
    finally:
        groups.close()


def _state(t) -> dict:
    """Weights and optimizer state (moments, step counts), by name, as copies."""
    out = {f"w.{n}": p.detach().clone() for n, p in t.unwrapped.named_parameters()}
    names = {id(p): n for n, p in t.unwrapped.named_parameters()}
    for p, s in t.torch_optimizer.state.items():
        out.update({f"o.{names[id(p)]}.{k}": v.detach().clone() for k, v in s.items()})
    return out


def _assert_close(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys() and len(a) > 20
    for k in a:
        torch.testing.assert_close(b[k].double(), a[k].double(), atol=atol, rtol=0, msg=k)


def _run_both(eager, static, batches, first=0):
    """Both trainers over `batches`; step BAD gets a NaN image: the static step leaves everything
    bit-untouched and its skip count is read only at the next log step."""
    for i, group in enumerate(batches, start=first):
        before = _state(static) if i == BAD else None
        group = _with_nan(eager, group) if i == BAD else group
        m_e, m_s = eager.train_step(group), static.train_step(group)
        assert m_s["lr"] == m_e["lr"]
        if i == BAD:
            after = _state(static)
            assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed state"
            assert static.nonfinite_total == 0 and eager.nonfinite_total == 1  # not read yet: no host sync
        if static.step % 5 == 0:  # a log step: the device counters are read
            assert static.nonfinite_total == eager.nonfinite_total
            assert ("nonfinite" in m_s) == ("nonfinite" in m_e)
            if "nonfinite" not in m_e:
                assert abs(m_s["loss"] - m_e["loss"]) < 1e-6
        _assert_close(_state(eager), _state(static))


@pytest.mark.parametrize("loss", NAMES)
def test_static_step_equals_eager_for_every_loss(tiny_shards, tmp_path, loss):
    eager, static = _pair(tiny_shards, tmp_path, loss)
    _run_both(eager, static, _batches(eager))
    assert static.nonfinite_total == eager.nonfinite_total == 1
    assert isinstance(static.torch_optimizer.param_groups[0]["lr"], torch.Tensor)  # the device lr
    buffers = static.static_step.buffers  # text lengths 8 and 16: two token buffers, one image buffer
    assert sorted(buffers) == [8, 16] and buffers[8][0].image is buffers[16][0].image
    if eager.loss_spec.stateful:
        key = eager.loss.STATE_KEY
        torch.testing.assert_close(static.loss.state_dict()[key], eager.loss.state_dict()[key], atol=1e-6, rtol=0)
        assert static.loss.step == eager.loss.step == STEPS - 1


@pytest.mark.parametrize("loss", ["infonce", "sogclr"])
def test_static_step_with_accumulation(tiny_shards, tmp_path, loss):
    eager, static = _pair(tiny_shards, tmp_path, loss, "train.accum_steps=2", "data.batch_per_device=4")
    _run_both(eager, static, _batches(eager))


def test_static_step_through_a_resume(tiny_shards, tmp_path):
    """Static steps 0..9, a checkpoint, a new trainer resumed from it: steps 10..19 equal an
    uninterrupted eager run's (the saved tensor lr is replaced by the config's schedule)."""
    eager, static = _pair(tiny_shards, tmp_path, "fastclip")
    batches = _batches(eager)
    _run_both(eager, static, batches[:10])
    static.save_checkpoint()
    resumed = Trainer(_cfg(tiny_shards, tmp_path / "static", "fastclip", "train.resume=latest"))
    resumed.static_step = StaticStep(resumed, capture=False)
    resumed.maybe_resume()
    assert resumed.step == 10 and resumed.nonfinite_total == 1
    _run_both(eager, resumed, batches[10:], first=10)


@pytest.mark.multiproc
def test_cuda_graphs_on_cpu_is_one_error_line(tiny_shards, tmp_path):
    with pytest.raises(ConfigError, match="train.cuda_graphs=true needs a CUDA device"):
        Trainer(_cfg(tiny_shards, tmp_path, "infonce", "train.cuda_graphs=true"))
    cmd = [sys.executable, "-m", "vlp", "train", "-c", "configs/demo.yaml", f"data.train_shards={tiny_shards['train']}",
           f"train.output_dir={tmp_path / 'cli'}", "model.name=vlp-micro", "train.cuda_graphs=true"]
    out = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "vlp: error: config: train.cuda_graphs=true needs a CUDA device (this run trains on cpu): "
        "set train.cuda_graphs=false"]


@pytest.mark.parametrize("extra,named", [("train.parallel=fsdp", "train.parallel=fsdp"),
                                         ("optim.name=lars", "optim.name=lars"),
                                         ("train.precision=fp16", "train.precision=fp16"),
                                         ("loss.gamma_schedule=cosine", "loss.gamma_schedule=cosine")])
def test_what_cannot_be_captured_is_refused_by_name(tiny_shards, tmp_path, extra, named):
    with pytest.raises(ConfigError, match=f"train.cuda_graphs=true does not run with {named}"):
        _cfg(tiny_shards, tmp_path, "infonce", "train.cuda_graphs=true", extra)


def _two_ranks(rank, world, shards, root):
    """2 gloo ranks: an eager and a static DDP trainer on the same per-rank batches."""
    from pathlib import Path

    from accelerate.state import AcceleratorState

    os.environ.update(ACCELERATE_USE_CPU="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    out = []
    for name in ("eager", "static"):
        AcceleratorState._reset_state()
        t = Trainer(_cfg(shards, Path(root) / name, "sogclr", "data.batch_per_device=4"))
        if name == "static":
            t.static_step = StaticStep(t, capture=False)
        for i, group in enumerate(_batches(t, 12)):  # a NaN image on rank 0 only: both ranks skip
            t.train_step(_with_nan(t, group) if i == BAD and rank == 0 else group)
        assert t.world == 2
        out.append((_state(t), t.nonfinite_total, t.loss.state_dict()["log_u"]))
    return out


@pytest.mark.multiproc
def test_static_step_equals_eager_on_two_ranks(tiny_shards, tmp_path):
    ranks = run_distributed(_two_ranks, 2, (tiny_shards, str(tmp_path)), timeout_s=300)
    assert len(ranks) == 2
    for (eager, n_e, u_e), (static, n_s, u_s) in ranks:
        _assert_close(eager, static)
        assert n_e == n_s == 1
        torch.testing.assert_close(u_s, u_e, atol=1e-6, rtol=0)


def test_no_host_read_between_sync_steps(tiny_shards, tmp_path, monkeypatch):
    """A read of a tensor's value by Python (on CUDA: a wait for the device) happens only on
    sync steps (log_every=5): the skip counters, then the logged metrics; none on other steps.
    The tokens are trimmed while still on the host: those reads are no device sync (as in
    tests/test_host_syncs.py) and are not counted."""
    t = Trainer(_cfg(tiny_shards, tmp_path, "infonce"))
    t.static_step = StaticStep(t, capture=False)
    batches = _batches(t, 10)
    reads, host_side = [], [0]
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def read(self, *a, _o=original, _n=name, **k):
            if not host_side[0]:
                reads.append(_n)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    trim = t.unwrapped.trim_text

    def trim_on_host(text):
        host_side[0] += 1
        try:
            return trim(text)
        finally:
            host_side[0] -= 1

    t.unwrapped.trim_text = trim_on_host
    per_step = []
    for group in batches:
        del reads[:]
        metrics = t.train_step(group)
        if t.step % 5 == 0:
            assert metrics["loss"] > 0
        per_step.append(list(reads))
    assert per_step[4] == per_step[9] == ["tolist", "tolist"], per_step  # counters, metrics
    assert all(not per_step[k] for k in (0, 1, 2, 3, 5, 6, 7, 8)), per_step


def test_decode_auto_resolves_by_device():
    """data.decode's default: nvjpeg on the device where the run trains on CUDA, the workers on CPU."""
    from vlp.data.train_data import image_output

    assert load_config(None, []).data.decode == "auto"
    assert image_output("auto", torch.device("cuda")) == "jpeg"
    assert image_output("auto", torch.device("cpu")) == "uint8"
    assert image_output("cpu", torch.device("cuda")) == "region"


def test_a_run_of_nonfinite_steps_between_syncs_stops_the_run(tiny_shards, tmp_path):
    """Through Trainer.train: NaN at steps 2..5 (4 in a row, max_nonfinite=3), finite after; the
    counters are read at step 10 (log_every=10), which stops the run with the last good weights."""
    import json

    t = Trainer(_cfg(tiny_shards, tmp_path, "infonce", "train.log_every=10", "train.max_nonfinite=3",
                     "train.save_final=false"))
    t.static_step = StaticStep(t, capture=False)
    real = t.loss.fn

    def flaky(*args, **kw):
        loss, metrics = real(*args, **kw)
        return (loss * float("nan") if 1 <= t.step <= 4 else loss), metrics

    t.loss.fn = flaky
    with pytest.raises(FloatingPointError, match="4 non-finite losses in a row at step 10; saved the last good"):
        t.train()
    assert t.nonfinite_total == 4 and t.weights_finite()
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["type"] == "train"] == [10]
