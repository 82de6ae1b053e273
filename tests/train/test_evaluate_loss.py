"""vlp eval builds the model of a checkpoint's saved config (its loss decides logit_bias), and
reads an open_clip file of a sigmoid-loss model without guessing its loss."""
import torch

from vlp.config import Config, LossConfig, ModelConfig

from vlp.experiment import check
from vlp.eval.checkpoints import load_model_from_checkpoint
from vlp.models.model import build_model, export_open_clip


def test_saved_config_decides_the_loss_and_open_clip_files_load_without_one(tmp_path):
    cfg = check(Config(model=ModelConfig(name="vlp-micro"), loss=LossConfig(name="siglip")))
    model = build_model(cfg.model, cfg.loss)[0]
    with torch.no_grad():
        model.clip.logit_bias.fill_(-7.5)
    ours = tmp_path / "step_1.pt"
    torch.save({"model": model.clip.state_dict(), "config": cfg.to_dict()}, ours)
    loaded, *_ = load_model_from_checkpoint(str(ours))
    assert loaded.clip.logit_bias.item() == -7.5  # built as SigLIP from the config, bias restored

    exported = tmp_path / "open_clip_model.pt"
    export_open_clip(model, exported)
    plain, *_ = load_model_from_checkpoint(str(exported), model_name="vlp-micro")
    assert getattr(plain.clip, "logit_bias", None) is None  # no loss is inferred from a key
    for name, p in plain.clip.state_dict().items():
        assert torch.equal(p, model.clip.state_dict()[name]), name
