"""Config changes on resume are explicit (issue 21): one table (vlp.checkpoint.resume.RESUME_RULES, read from
each key's declaration, issue 27) says for every key whether a resume applies a new value (and logs
it) or refuses it; a lowered optim.lr is really trained with (the loaded optimizer and scheduler
state would keep the saved one)."""
import json

import pytest

from vlp.checkpoint import resume
from vlp.cli import main
from vlp.config import KEYS, ConfigError
from vlp.experiment import load_config
from vlp_testing import REPO, overrides

TINY = ["model.name=vlp-micro", "data.batch_per_device=16", "optim.lr=2e-3", "optim.warmup_steps=2",
        "optim.schedule=constant", "train.log_every=1", "data.shuffle_buffer=64", "train.samples=64",
        "data.eval_shards=null"]


def cfg_dict(*overrides):
    return load_config(None, ["model.name=vlp-micro", *overrides]).to_dict()


def test_the_table_is_read_from_the_declarations():
    assert list(resume.RESUME_RULES.items()) == [(name, k.resume) for name, k in KEYS.items()]
    assert all(r.kind in (resume.APPLY, resume.LAYOUT, resume.REFUSE) for r in resume.RESUME_RULES.values())
    assert all(r.why for r in resume.RESUME_RULES.values() if r.kind == resume.REFUSE)  # the refusal says why


def test_the_old_lists_are_views_of_the_table():
    from vlp import config

    assert set(config.HARMLESS_KEYS) == {"train.resume", "train.output_dir", "train.checkpoint_every",
                                          "train.keep_last", "train.log_every", "eval.batch_size", "train.break_lock",
                                          "train.save_final"}
    assert {"model.name", "model.hf_text_dir", "model.lock_image", "model.lock_image_unlocked_groups",
            "model.lock_text", "model.lock_text_unlocked_layers", "loss.name",
            "loss.temperature"} <= set(resume.STATE_KEYS)
    assert {"model.name", "model.hf_text_dir", "data.train_shards"} <= set(resume.FIXED_KEYS)
    assert {"data.batch_per_device", "train.accum_steps", "data.num_workers", "train.seed", "data.shuffle_buffer",
            "data.mode", "data.weights", "data.num_samples", "loss.name", "loss.temperature"} == set(resume.LAYOUT_KEYS)


def _applied(saved_cfg: dict, *overrides) -> list[str]:
    """The resume's applied-change lines, checked first as a resume does (check_resume)."""
    saved, cfg = {"config": saved_cfg, "train": {"step": 12}, "world_size": 1}, load_config(None, ["model.name=vlp-micro", *overrides])
    resume.check_resume(saved, cfg, 1, "ckpt.pt")
    return [line.removeprefix("[vlp] resume: ").removesuffix(" from step 12") for line in resume.applied_lines(saved, cfg)]


def test_a_resume_applies_refuses_and_skips():
    saved = cfg_dict("optim.lr=1e-3", "train.seed=1")
    assert _applied(saved, "optim.lr=1e-5", "train.seed=1", "train.resume=latest") == ["optim.lr 0.001 -> 1e-05"]  # train.resume: quiet
    with pytest.raises(ConfigError, match=r"^resume: optim.name: 'adamw' -> 'sgd' \(the saved optimizer state is another "
                                          r"optimizer's\) since ckpt.pt"):
        _applied(saved, "optim.lr=1e-3", "train.seed=2", "optim.name=sgd")
    with pytest.raises(ConfigError, match=r"^resume: train.seed: 1 -> 2 since ckpt.pt; exact resume needs the same data layout"):
        _applied(saved, "optim.lr=1e-3", "train.seed=2")
    assert _applied(saved, "optim.lr=1e-3", "train.seed=2", "train.resume_mode=continue") == [
        "train.resume_mode 'exact' -> 'continue'"]  # train.seed, a layout change, has its own line
    continued = load_config(None, ["model.name=vlp-micro", "train.seed=2", "train.resume_mode=continue"])
    assert resume.layout_changes({"config": saved, "world_size": 2}, continued, 1) == ["world size: 2 -> 1", "train.seed: 1 -> 2"]
    older = {k: dict(v) for k, v in saved.items()}
    del older["train"]["break_lock"], older["optim"]["lr"]  # keys an older vlp did not record
    assert _applied(older, "optim.lr=1e-5", "train.seed=1", "train.break_lock=true") == []


def test_check_resume_refuses_a_refused_key_in_one_line():
    saved = {"config": cfg_dict("loss.tau=0.05"), "world_size": 1}
    with pytest.raises(ConfigError) as e:
        resume.check_resume(saved, load_config(None, ["model.name=vlp-micro", "loss.tau=0.1"]), 1, "ckpt.pt")
    assert "loss.tau: 0.05 -> 0.1 (logit_scale comes from the checkpoint) since ckpt.pt" in str(e.value)
    assert "\n" not in str(e.value)


def _train(shards, out, *extra):
    return ["train", "-c", str(REPO / "configs/demo.yaml"), *overrides(
                f"data.train_shards={shards}", f"train.output_dir={out}", *TINY, *extra)]


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("rules") / "run"
    assert main(_train(tiny_shards["train"], out, "train.checkpoint_every=1", "train.keep_last=0")) == 0
    return out, tiny_shards


def test_apply_optim_changes_makes_the_resumed_optimizer_use_the_new_lr(trained, tmp_path):
    import shutil

    from vlp.train.loop import Trainer

    out, shards = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    cfg = load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={run}", *TINY, "optim.lr=1e-5",
        "optim.weight_decay=0.05", "optim.beta2=0.95", "train.resume=latest", "train.samples=96"])
    trainer = Trainer(cfg)
    _, state = trainer.checkpoints.resume(cfg.train.resume, cfg)
    from vlp.train.optim import follow_config

    follow_config(trainer.torch_optimizer, trainer.scheduler, cfg.optim)
    lines = resume.applied_lines(state, cfg)
    assert "[vlp] resume: optim.lr 0.002 -> 1e-05 from step 4" in lines
    assert "[vlp] resume: optim.weight_decay 0.1 -> 0.05 from step 4" in lines
    groups = trainer.torch_optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-5, 1e-5] and trainer.scheduler.base_lrs == [1e-5, 1e-5]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.05] and groups[1]["betas"] == (0.9, 0.95)
    metrics = trainer.train_step(next(trainer.data.groups(trainer.accum)))
    assert metrics["lr"] == pytest.approx(1e-5)  # the LR schedule goes on from the new peak
    assert [g["lr"] for g in groups] == [pytest.approx(1e-5)] * 2


def test_lowered_lr_on_resume_is_logged_and_trained_with(capsys, trained, tmp_path):
    import shutil

    out, shards = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    assert main(_train(shards["train"], run, "train.resume=latest", "train.samples=96", "optim.lr=1e-5")) == 0
    stdout = capsys.readouterr().out
    assert "[vlp] resume: optim.lr 0.002 -> 1e-05 from step 4" in stdout
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    after = [r["lr"] for r in records if r.get("type") == "train" and r["step"] > 4]
    assert after and all(lr == pytest.approx(1e-5) for lr in after)
