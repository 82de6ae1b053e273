#!/usr/bin/env bash
# Create .venv in the repo from requirements.lock (exact versions) and install vlp editable.
# Idempotent: reinstalls only when requirements.lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.lock-sha
want=$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] creating .venv from requirements.lock (about 2 minutes)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch, open_clip; print("torch", torch.__version__, "open_clip", open_clip.__version__)')"
