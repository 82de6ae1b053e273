"""Helpers shared by the top-level tests (a unique module name: conftest.py files collide)."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run_env() -> dict:
    """Environment for subprocesses: one thread each, repo on the path, no GPU."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
