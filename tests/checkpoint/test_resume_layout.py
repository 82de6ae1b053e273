"""Resume on a changed layout (vlp/checkpoint/resume.py): refused by name in exact mode; with
train.resume_mode=continue the run goes on from the same global sample, and the epoch it was in
is finished under the new layout with no sample repeated or skipped."""
import json

import pytest

from vlp_testing import REPO
from vlp.config import ConfigError
from vlp.experiment import load_config
from vlp.train.loop import Trainer

TINY = ["model.name=vlp-micro", "optim.lr=1e-3", "optim.warmup_steps=2", "train.log_every=1",
        "data.shuffle_buffer=32", "train.eval_every=0"]


def _cfg(shards, out, *extra):
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", "data.eval_shards=null", f"train.output_dir={out}",
        *TINY, *extra])


def _key_recorder(cfg) -> Trainer:
    """A Trainer whose `keys` records the keys of every batch it trains on, (epoch, keys)."""
    t = Trainer(cfg)
    t.keys, stream = [], t.data.stream

    def recording():
        for batch in stream():
            t.keys.append((batch["epoch"], list(batch["key"])))
            yield batch
    t.data.stream = recording
    return t


def test_changed_batch_is_refused_by_name_then_continues_the_epoch(tiny_shards, tmp_path):
    # 160 training pairs; batch 8 -> 20 batches per epoch; stop after 8 of them (64 samples)
    first = _key_recorder(_cfg(tiny_shards, tmp_path, "data.batch_per_device=8", "train.samples=64"))
    first.train()

    with pytest.raises(ConfigError, match=r"data.batch_per_device: 8 -> 12.*"
                                          r"train.resume_mode=continue.*sample 64"):
        Trainer(_cfg(tiny_shards, tmp_path, "data.batch_per_device=12", "train.samples=160",
                     "train.resume=latest")).train()

    second = _key_recorder(_cfg(tiny_shards, tmp_path, "data.batch_per_device=12", "data.num_workers=2",
                               "train.samples=160", "train.resume=latest", "train.resume_mode=continue"))
    result = second.train()
    # 96 samples were left of epoch 0: exactly 8 batches of 12, read under the new layout
    assert result["samples_seen"] == 160 and result["step"] == 8 + 8
    assert {epoch for epoch, _ in second.keys} == {0}
    seen_before = [k for _, keys in first.keys for k in keys]
    seen_after = [k for _, keys in second.keys for k in keys]
    assert len(seen_before) == 64 and len(seen_after) == 96
    assert not set(seen_before) & set(seen_after)
    assert len(set(seen_before + seen_after)) == 160  # the whole epoch, each pair once
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["samples_seen"] for r in log if "infonce" in r][-1] == 160


def test_changed_seed_and_workers_are_named(tiny_shards, tmp_path):
    Trainer(_cfg(tiny_shards, tmp_path, "data.batch_per_device=8", "train.samples=32")).train()
    with pytest.raises(ConfigError) as err:
        Trainer(_cfg(tiny_shards, tmp_path, "data.batch_per_device=8", "train.samples=64",
                     "train.seed=1", "data.num_workers=1", "train.resume=latest")).train()
    assert "data.num_workers: 0 -> 1" in str(err.value) and "train.seed: 0 -> 1" in str(err.value)
    with pytest.raises(ConfigError, match="model.name: 'vlp-micro' -> 'vlp-demo'"):
        Trainer(_cfg(tiny_shards, tmp_path, "data.batch_per_device=8", "train.samples=64",
                     "model.name=vlp-demo", "train.resume=latest", "train.resume_mode=continue")).train()
