"""The launch kit parses as accelerate configs, and the CLI surface stays what the README says."""

import pytest
import yaml

import forked
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
    per_node = text[text.index("per_node='"):]
    per_node = per_node[:per_node.index("'", len("per_node='"))]  # the single-quoted per-task script
    assert '--machine_rank "$SLURM_NODEID"' in per_node  # evaluated per task, not once on the batch host


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


# ----------------------------------------------------------------------------- repeated and multi-line overrides
# (issue 28, item 8) argparse keeps the last of a repeated option and YAML folds a line break into a
# space, each without a word: `vlp train ... data.train_shards=A.tar data.train_shards=B.tar` trained
# on B alone. Each is refused in one line, exit 2, before anything is written.
DEMO = str(REPO / "configs" / "demo.yaml")


def _refused(capsys, tmp_path, monkeypatch, argv) -> str:
    """Run the CLI in an empty working folder; return its one error line after checking that the
    status is 2, stdout is empty and nothing was written (the folder is still empty)."""
    from vlp.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("vlp: error: "), (rc, out, err)
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    return err.strip()


@pytest.mark.parametrize("command", [["train", "-c", DEMO], ["compare", "--quick"], ["demo", "--out", "out"]])
def test_repeated_override_key_is_refused(capsys, tmp_path, monkeypatch, command):
    err = _refused(capsys, tmp_path, monkeypatch, [*command, "data.train_shards=A.tar", "train.seed=1",
                                                   f"train.output_dir={tmp_path / 'out'}", "data.train_shards=B.tar"])
    assert err == ("vlp: error: config: overrides 'data.train_shards=A.tar' and 'data.train_shards=B.tar' both set "
                   "data.train_shards: give each key once")


def test_a_section_and_a_key_in_it_are_refused(capsys, tmp_path, monkeypatch):
    err = _refused(capsys, tmp_path, monkeypatch, ["train", "-c", DEMO, "optim={lr: 0.1}", "data.train_shards=A.tar",
                                                   "optim.lr=0.2"])
    assert err == ("vlp: error: config: overrides 'optim={lr: 0.1}' and 'optim.lr=0.2' both set optim.lr: give each "
                   "key once")


@pytest.mark.parametrize("command", [["train", "-c", DEMO], ["compare"], ["demo", "--out", "out"]])
@pytest.mark.parametrize("value", ["a\nb", "a\r\nb", "\n"])
def test_line_break_in_an_override_is_refused(capsys, tmp_path, monkeypatch, command, value):
    err = _refused(capsys, tmp_path, monkeypatch, [*command, "data.train_shards=A.tar", f"train.output_dir={value}"])
    assert err == (f"vlp: error: config: override {'train.output_dir=' + value!r} holds a line break: "
                   "give each override on one line")


@pytest.mark.parametrize("option", ["--shards", "--out", "--checkpoint", "--model", "--suite", "--batch-size"])
def test_eval_refuses_a_repeated_option(capsys, tmp_path, monkeypatch, option):
    first, second = ("8", "16") if option == "--batch-size" else (str(tmp_path / "a"), str(tmp_path / "b"))
    other = ["--model", "vlp-micro"] if option != "--model" else ["--checkpoint", str(tmp_path / "c.pt")]
    err = _refused(capsys, tmp_path, monkeypatch, ["eval", *other, option, first, "--precision", "fp32", option, second])
    shown = (int(first), int(second)) if option == "--batch-size" else (first, second)
    assert err == f"vlp: error: {option} is given twice ({shown[0]!r} and {shown[1]!r}): give it once"


@pytest.mark.parametrize("argv", [["train", "-c", "a.yaml", "--config", "b.yaml"], ["compare", "-c", "a", "-c", "b"],
                                  ["shards", "openmoji", "out", "--workers", "1", "--workers", "2"]])
def test_every_single_valued_option_is_given_once(capsys, tmp_path, monkeypatch, argv):
    err = _refused(capsys, tmp_path, monkeypatch, argv)
    assert err.startswith("vlp: error: --") and "is given twice (" in err and err.endswith("): give it once")


def test_repeatable_options_still_repeat():
    args = build_parser().parse_args(["eval", "--classes", "a", "--classes", "b", "--wds", "c", "--wds", "d"])
    assert (args.classes, args.wds) == (["a", "b"], ["c", "d"])


@pytest.mark.multiproc
def test_repeated_option_status_of_a_real_process(tmp_path):
    from vlp_testing import PYTHON, run_env

    out = tmp_path / "out"
    proc = forked.run([PYTHON, "-m", "vlp", "eval", "--model", "vlp-micro", "--shards", "a.tar", "--out", str(out),
                           "--out", str(tmp_path / "other")], cwd=tmp_path, env=run_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr == f"vlp: error: --out is given twice ({str(out)!r} and {str(tmp_path / 'other')!r}): give it once\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
