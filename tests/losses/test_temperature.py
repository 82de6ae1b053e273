"""vlp.losses.temperature: one LossConfig -> init, trainability, gradient routing and clamp."""
import math

import pytest
import torch

from vlp.config import ConfigError, LossConfig
from vlp.experiment import load_config
from vlp.losses.siglip import siglip_init
from vlp.losses.temperature import MIN_LOG_SCALE, temperature_policy


@pytest.mark.parametrize("name,mode,scale_grad,trainable", [
    ("infonce", None, "same", True), ("flatnce", None, "split", True), ("siglip", None, "same", True),
    ("flatnce", "learnable", "same", True), ("infonce", "fixed", "same", False),
    ("flatnce", "split", "split", True)])
def test_mode_decides_routing_and_trainability(name, mode, scale_grad, trainable):
    policy = temperature_policy(LossConfig(name=name, temperature=mode))
    assert (policy.scale_grad, policy.trainable) == (scale_grad, trainable)


def test_initial_values():
    clip = temperature_policy(LossConfig(name="infonce"))
    assert clip.init_log_scale == math.log(1 / 0.07) and clip.init_logit_bias is None  # open_clip's default
    sig = temperature_policy(LossConfig(name="siglip"))
    assert (sig.init_log_scale, sig.init_logit_bias) == tuple(siglip_init())
    set_tau = temperature_policy(LossConfig(name="siglip", tau=0.05, temperature="fixed"))
    assert set_tau.init_log_scale == math.log(20.0) and set_tau.init_logit_bias == siglip_init().logit_bias


def test_clamp_bounds():
    policy = temperature_policy(LossConfig(max_logit_scale=50.0))
    high, low = torch.tensor(10.0), torch.tensor(-3.0)
    policy.clamp_(high)
    policy.clamp_(low)
    assert high.item() == pytest.approx(math.log(50.0)) and low.item() == MIN_LOG_SCALE


def test_split_only_for_flatnce_and_old_name_still_read(capsys):
    with pytest.raises(ValueError, match="split only applies to loss.name=flatnce"):
        temperature_policy(LossConfig(name="siglip", temperature="split"))
    cfg = load_config(None, ["loss.name=flatnce", "loss.temperature=infonce"])
    assert cfg.loss.temperature == "split"
    assert capsys.readouterr().err.strip() == "vlp: note: loss.temperature=infonce is now called 'split'"


def test_default_tau_checked_against_the_clamp():
    with pytest.raises(ConfigError, match="initial logit_scale 14.29 above loss.max_logit_scale=10.0"):
        load_config(None, ["loss.max_logit_scale=10"])
    assert load_config(None, ["loss.name=siglip", "loss.max_logit_scale=10"]).loss.tau is None  # t = 10 fits


@pytest.mark.parametrize("transform", ["augment", "eval"])
def test_the_build_decides_policy_and_train_transform_once(tiny_shards, tmp_path, monkeypatch, transform):
    """(issue 27) build_model computes the policy (once) and the train transform; the Trainer reads
    both from what build_model returned and decides neither again."""
    from vlp.models import model as model_module
    from vlp.models.model import build_model
    from vlp.train.loop import Trainer

    cfg = load_config(None, ["model.name=vlp-micro", "loss.name=flatnce", "loss.tau=0.05", "data.batch_per_device=8",
                             f"data.train_shards={tiny_shards['train']}", "data.eval_shards=null", "train.samples=16",
                             f"data.train_transform={transform}", f"train.output_dir={tmp_path / 'run'}"])
    calls = []
    monkeypatch.setattr(model_module, "temperature_policy", lambda loss: calls.append(loss) or temperature_policy(loss))
    trainer = Trainer(cfg)
    assert calls == [cfg.loss]  # one build, one policy
    assert trainer.temperature is trainer.unwrapped.temperature == temperature_policy(cfg.loss)
    assert trainer.temperature.scale_grad == "split" and trainer.temperature.init_log_scale == math.log(20.0)
    _, _, train_tf, eval_tf = build_model(cfg.model, cfg.loss, data_cfg=cfg.data)
    assert repr(trainer.train_transform) == repr(eval_tf if transform == "eval" else train_tf)
    assert ("RandomResizedCrop" in repr(trainer.train_transform)) == (transform == "augment")
    assert trainer.data.transform is trainer.train_transform
