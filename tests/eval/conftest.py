"""Shared fixtures for eval tests: a tiny open_clip model built from a config file (no weights,
no downloads). File-writing helpers live in eval_helpers.py."""
import json

import pytest
import torch

TINY_CFG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """(model, tokenizer, transform) of a 2-layer ViT/text tower CLIP, random init, eval mode."""
    import open_clip

    cfg_dir = tmp_path_factory.mktemp("open_clip_cfg")
    (cfg_dir / "vlp-eval-tiny.json").write_text(json.dumps(TINY_CFG))
    open_clip.add_model_config(cfg_dir)
    torch.manual_seed(0)
    model = open_clip.create_model("vlp-eval-tiny", pretrained=None).eval()
    tokenizer = open_clip.get_tokenizer("vlp-eval-tiny")
    transform = open_clip.image_transform(32, is_train=False)
    return model, tokenizer, transform
