"""A non-editable install works outside the clone: build the wheel from a copy of the sources,
install it into a fresh venv in a temp folder (its dependencies come from the test's own
environment through a .pth line, so nothing is downloaded), and run the CLI from there."""
import pytest
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from vlp_testing import REPO

pytestmark = pytest.mark.multiproc  # the tier (docs/testing.md): every test here starts processes

SOURCES = ("pyproject.toml", "README.md", "vlp", "data_pipelines", "configs", "eval", "launch")  # the card's folders


def _run(cmd, cwd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1"},
                          capture_output=True, text=True, timeout=300, **kw)


def test_wheel_installed_outside_the_clone_runs_the_cli(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                  str(tmp_path / "dist"), str(src)], cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("vlp-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"vlp/defaults/demo.yaml", "vlp/defaults/compare_small_batch.yaml",
            "vlp/models/model_configs/vlp-tiny.json", "vlp/eval/imagenet_synsets.txt"} <= set(names)
    tops = {n.split("/")[0] for n in names if not n.startswith("vlp-")}
    assert tops == {"vlp"}, tops  # the card's data_pipelines/ and eval/ stay in the clone: no generic top-level names

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    # the test env's packages (torch, open_clip, pip ...) after the venv's own: its site dir is
    # added as a plain path, so the clone's editable-install hook there is not run
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib.stdout.strip(), "test_env.pth").write_text(ours + "\n")
    install = _run([str(py), "-m", "pip", "install", "--no-deps", str(wheel)], cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-2000:]

    where = _run([str(py), "-c", "import vlp.demo, vlp.study.compare; print(vlp.demo.__file__); "
                  "print(vlp.demo.DEFAULT_CONFIG.is_file() and vlp.study.compare.DEFAULT_CONFIG.is_file())"],
                 cwd=tmp_path)
    assert where.stdout.split() == [str(Path(purelib.stdout.strip()) / "vlp" / "demo.py"), "True"], where
    assert not Path(where.stdout.split()[0]).is_relative_to(REPO)  # by path, not by spelling: /tmp/r1.tmp is not in /tmp/r1
    for command in ("demo", "compare", "eval"):
        out = _run([str(venv / "bin" / "vlp"), command, "--help"], cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.startswith(f"usage: vlp {command}"), (command, out.stderr[-1000:])


def test_the_cards_top_level_folders_are_there_and_not_packages():
    """shared/DESIGN.md's layout: vlp/ data_pipelines/ configs/ eval/ tests/ launch/. data_pipelines/
    (data-preparation recipes) and eval/ (eval suites) are folders a newcomer reads, each with a
    README, never importable packages (an installed `eval` or `data_pipelines` would shadow others')."""
    for name in ("vlp", "data_pipelines", "configs", "eval", "tests", "launch"):
        assert (REPO / name).is_dir(), name
    for name in ("data_pipelines", "eval"):
        assert (REPO / name / "README.md").is_file() and not (REPO / name / "__init__.py").exists(), name

