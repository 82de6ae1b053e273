"""Host syncs per training step, counted, and the device feed.

A host sync is any read of a tensor's value by Python: Tensor.item / tolist / cpu / numpy /
__bool__ / __float__ / __int__ (on CUDA each one waits for the device; on CPU they are the same
calls, so counting them here counts what a GPU run would wait for). The trainer makes one per
step (the fused finite-loss + preemption flag) and one more on logging steps (the metrics)."""

import signal
from collections import Counter

import pytest
import torch

import forked
from vlp_testing import PYTHON, REPO, run_env
from vlp.experiment import load_config
from vlp.train import preempt
from vlp.data.train_data import Batch, DeviceFeed, image_output
from vlp.train.loop import Trainer

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def _cfg(shards, out, *extra):
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", "model.name=vlp-micro",
        "data.batch_per_device=16", "data.num_workers=1", "data.shuffle_buffer=64", "train.samples=160",
        "train.eval_every=0", "train.checkpoint_every=0", "train.save_final=false", *extra])


@pytest.fixture
def count_reads(monkeypatch):
    """Counts Python reads of tensor values in this process (the loader worker is another)."""
    counts: Counter = Counter()

    def counting(name, original):
        def read(self, *args, **kwargs):
            if not counts["(host side)"]:
                counts[name] += 1
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    return counts


def _syncs_per_step(trainer, counts) -> list[int]:
    """Reads made between the starts of consecutive steps (a step's logging included). The
    token ids are trimmed while still on the host (DualEncoder.trim_text; on CUDA they move to
    the device after it): its reads of a host tensor are no device sync and are not counted."""
    marks = []
    step = trainer.train_step
    trim = trainer.unwrapped.trim_text

    def host_side(text):
        counts["(host side)"] += 1
        try:
            return trim(text)
        finally:
            counts["(host side)"] -= 1

    trainer.unwrapped.trim_text = host_side

    def marked(batches):
        marks.append(sum(v for k, v in counts.items() if k in READS))
        return step(batches)

    trainer.train_step = marked
    trainer.train()
    marks.append(sum(v for k, v in counts.items() if k in READS))
    return [b - a for a, b in zip(marks, marks[1:])]


@pytest.mark.parametrize("log_every", [4, 1])
def test_one_host_sync_per_step_and_one_more_when_logging(tiny_shards, tmp_path, count_reads, log_every):
    trainer = Trainer(_cfg(tiny_shards, tmp_path, f"train.log_every={log_every}"))
    per_step = _syncs_per_step(trainer, count_reads)
    assert len(per_step) == 10
    for k, n in enumerate(per_step, start=1):
        if k == 2:  # measured_step (peak memory, once per run) may read more; the rest may not
            continue
        logged = k % log_every == 0 or k == 10
        assert n == (2 if logged else 1), (k, n, per_step, dict(count_reads))


def test_preemption_agreed_in_the_fused_flag_stops_after_that_step(tiny_shards, tmp_path):
    trainer = Trainer(_cfg(tiny_shards, tmp_path, "train.log_every=100"))
    step = trainer.train_step

    def signalled_at_3(batches):
        if trainer.step == 2:  # the signal arrives before step 3's flag is agreed
            trainer.preemption._handle(signal.SIGUSR1, None)
        return step(batches)

    trainer.train_step = signalled_at_3
    with pytest.raises(preempt.Preempted, match="preempted at step 3"):
        trainer.train()
    assert trainer.step == 3


def test_nonfinite_flag_from_the_same_collective(tiny_shards, tmp_path):
    trainer = Trainer(_cfg(tiny_shards, tmp_path))
    assert trainer._finite(torch.tensor(1.0)) and trainer.preemption.agreed is False
    assert not trainer._finite(torch.tensor(float("nan")))
    trainer.preemption.received = signal.SIGTERM
    assert trainer._finite(torch.tensor(2.0)) and trainer.preemption.agreed is True
    assert trainer.preemption.should_stop() and trainer.preemption.agreed is None  # taken once


def test_device_feed_is_a_passthrough_on_cpu():
    batch = Batch(torch.zeros(2, 4, 4, 3, dtype=torch.uint8), torch.ones(2, 5, dtype=torch.long), torch.arange(2))
    group = [batch]
    assert DeviceFeed(torch.device("cpu"))(group) is group
    moved = batch.images_to("cpu", non_blocking=True)
    assert torch.equal(moved.image, batch.image) and moved.text is batch.text


@pytest.mark.multiproc
def test_decode_gpu_is_refused_without_cuda_in_one_line(tiny_shards, tmp_path):
    assert image_output("cpu", torch.device("cpu")) == "uint8"
    assert image_output("cpu", torch.device("cuda")) == "region"
    assert image_output("gpu", torch.device("cuda")) == "jpeg"
    if torch.cuda.is_available():
        pytest.skip("this box has CUDA: data.decode=gpu is allowed")
    proc = forked.run([PYTHON, "-m", "vlp", "train", "-c", str(REPO / "configs/demo.yaml"),
                           f"data.train_shards={tiny_shards['train']}", f"train.output_dir={tmp_path / 'run'}",
                           "model.name=vlp-micro", "data.decode=gpu"],
                          capture_output=True, text=True, env=run_env(), timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlp: error: data.decode=gpu needs a CUDA device"), proc.stderr
