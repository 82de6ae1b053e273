"""A tiny LiT model as fixtures: a timm image tower config and a tiny BERT sentence-transformers folder
(tests/models/test_towers.py, tests/train/test_feature_cache.py, tests/study/test_compare_map.py)."""
import json

import pytest
import torch

from vlp_testing import REPO

MICRO = json.loads((REPO / "vlp/models/model_configs/vlp-micro.json").read_text())


@pytest.fixture(scope="module")
def timm_json(tmp_path_factory):
    """timm's test_efficientnet (BatchNorm) at 32 px as the image tower."""
    path = tmp_path_factory.mktemp("cfg") / "vlp-fc-timm.json"
    path.write_text(json.dumps({"embed_dim": 32, "text_cfg": MICRO["text_cfg"], "vision_cfg": {
        "timm_model_name": "test_efficientnet", "timm_model_pretrained": False, "timm_pool": "avg",
        "timm_proj": "linear", "image_size": 32}}))
    return str(path)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny BERT as a sentence-transformers folder (mean pooling)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "heart", "face", "of", "cat", "flag", "man",
             "emoji", "dog"]
    (root / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=40)).save_pretrained(root)
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return str(root)
