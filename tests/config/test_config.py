from pathlib import Path

import pytest

from vlp.config import Config, ConfigError
from vlp.experiment import load_config

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"  # not cwd-relative


def test_demo_config_loads_with_overrides():
    cfg = load_config(DEMO, ["loss.name=flatnce", "data.batch_per_device=32", "optim.lr=1e-4", "train.samples=2e5"])
    assert isinstance(cfg, Config)
    assert cfg.loss.name == "flatnce"
    assert cfg.data.batch_per_device == 32
    assert cfg.optim.lr == 1e-4
    assert cfg.train.samples == 200000 and isinstance(cfg.train.samples, int)


@pytest.mark.parametrize("override, needle", [
    (["loss.nme=flatnce"], "unknown key 'loss.nme'"),
    (["bogus.x=1"], "unknown key 'bogus'"),
    (["data.batch_per_device=abc"], "data.batch_per_device must be int"),
    (["data.batch_per_device=0"], "data.batch_per_device must be > 0"),
    (["loss.name=nce"], "loss.name must be one of"),
    (["loss.temperature=split"], "only applies to loss.name=flatnce"),
    (["train.resume=/nope/ckpt.pt"], "train.resume must be 'latest' or an existing checkpoint"),
    (["loss"], "must look like key.sub=value"),
])
def test_bad_config_is_one_clear_error(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, override)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("loss: 3\n")
    with pytest.raises(ConfigError, match="loss must be a mapping"):
        load_config(notmap)


def test_temperature_default_depends_on_loss():
    assert load_config(DEMO, ["loss.name=flatnce"]).loss.temperature == "split"
    assert load_config(DEMO, ["loss.name=infonce"]).loss.temperature == "learnable"
    assert load_config(DEMO, ["loss.name=siglip"]).loss.temperature == "learnable"
    assert load_config(DEMO, ["loss.name=flatnce", "loss.temperature=fixed"]).loss.temperature == "fixed"


def test_overrides_are_parsed_once_each():
    from vlp.config import parse_overrides

    assert parse_overrides(["optim.lr=1e-3", "grid.seeds=[0, 1]", "data.eval_shards=", "train.output_dir=a b",
                            "data.weights=1::2", "x.y={a: 1}"]) == [
        ("optim.lr", "1e-3"), ("grid.seeds", [0, 1]), ("data.eval_shards", None), ("train.output_dir", "a b"),
        ("data.weights", "1::2"), ("x.y", {"a": 1})]
    assert parse_overrides(["data.mode=split", "data.modes=x", "dat.mode=y"])  # prefixes of names, not of keys
    # (YAML 1.1 reads 1e-3 as a string; the field's type turns it into a float: test_demo_config_loads...)


@pytest.mark.parametrize("overrides, message", [
    (["data.train_shards=A.tar", "data.train_shards=B.tar"],
     "config: overrides 'data.train_shards=A.tar' and 'data.train_shards=B.tar' both set data.train_shards: "
     "give each key once"),
    (["optim.lr=1", "optim.lr=1"], "config: overrides 'optim.lr=1' and 'optim.lr=1' both set optim.lr: give each "
     "key once"),
    (["optim.lr=1", "optim={lr: 2}"], "config: overrides 'optim.lr=1' and 'optim={lr: 2}' both set optim.lr: give "
     "each key once"),
    (["train.output_dir=a\nb"], "config: override 'train.output_dir=a\\nb' holds a line break: give each override "
     "on one line"),
    (["train.output_dir=a\rb"], "config: override 'train.output_dir=a\\rb' holds a line break: give each override "
     "on one line"),
    (["train.output_dir\n=a"], "config: override 'train.output_dir\\n=a' holds a line break: give each override "
     "on one line"),
])
def test_repeated_or_multi_line_overrides_are_one_line(overrides, message):
    """A command line gives each key once (vlp.cli: parse_overrides(once=True)); a line break is
    refused wherever overrides are read."""
    from vlp.config import parse_overrides

    with pytest.raises(ConfigError) as e:
        parse_overrides(overrides, once=True)
    assert str(e.value) == message
    if "line break" in message:
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, overrides)
        assert str(e.value) == message


def test_a_program_may_replace_its_own_earlier_overrides():
    """Lists a program builds (the demo's settings, then the user's) are read in order, later items
    replacing earlier ones; only a user's command line must give each key once."""
    cfg = load_config(DEMO, ["train.samples=64", "optim={lr: 0.1, warmup_steps: 0}", "train.samples=96", "optim.lr=0.2"])
    assert (cfg.train.samples, cfg.optim.lr, cfg.optim.warmup_steps) == (96, 0.2, 0)
