"""The launch kit parses as accelerate configs, and the CLI surface stays what the README says."""

import pytest
import yaml

from vlp_testing import REPO
from vlp.cli import build_parser

LAUNCH = sorted((REPO / "launch").glob("*.yaml"))


@pytest.mark.parametrize("path", LAUNCH, ids=[p.name for p in LAUNCH])
def test_launch_configs_are_valid_accelerate_configs(path):
    from accelerate.commands.config.config_args import ClusterConfig

    raw = yaml.safe_load(path.read_text())
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_processes == raw["num_processes"] >= cfg.num_machines >= 1
    if cfg.num_machines > 1:
        assert raw["main_process_port"] and "main_process_ip" in raw
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "accelerate launch" in path.read_text()  # header shows the command


def test_slurm_script_runs_accelerate_on_every_node():
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    assert "--ntasks-per-node=1" in text and "srun" in text and "accelerate launch" in text
    assert "\\$SLURM_NODEID" in text  # evaluated per task, not once on the batch host


def test_cli_surface():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"shards", "train", "eval", "compare", "demo"}
    opts = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    positionals = {name: {a.dest for a in p._actions if not a.option_strings} for name, p in sub.choices.items()}
    for name in ("train", "compare", "demo"):  # the config-driven commands: a YAML file + dotted overrides
        assert {"--config", "-c"} <= opts[name] and "overrides" in positionals[name], name
    assert {"--checkpoint", "--model", "--suite", "--shards", "--imagenet", "--templates", "--out",
            "--batch-size", "--precision", "--device"} <= opts["eval"]
    assert {"--samples-per-shard", "--image-format", "--jpeg-quality", "--resize-longest", "--workers",
            "--split"} <= opts["shards"]
    assert "--report-only" in opts["compare"] and "--out" in opts["demo"]


def test_readme_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    commands = [l for l in lines[:4] if l.startswith("bash scripts/setup.sh")]
    assert len(commands) == 2 and "vlp demo" in commands[0] and "pytest" in commands[1]
    assert "pytest" in (REPO / ".ci" / "run").read_text()
