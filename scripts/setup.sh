#!/usr/bin/env bash
# Create .venv in the repo from requirements.lock (exact versions) and install vlp editable.
# Idempotent: reinstalls the locked set only when requirements.lock changed, and re-registers
# vlp only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEBS="openclipart-svg openclipart-png fonts-material-design-icons-iconfont"  # packaged data sets: docs/datasets.md
[ "$(id -u)" != 0 ] || dpkg -s $DEBS >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $DEBS >/dev/null; } || echo "[setup] warning: could not apt-get install $DEBS"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
lock_sha=$(sha256sum requirements.lock | cut -d' ' -f1)
proj_sha=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.lock-sha 2>/dev/null)" != "$lock_sha" ]; then
  echo "[setup] creating .venv from requirements.lock (about 2 minutes)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.lock
  echo "$lock_sha" > .venv/.lock-sha
fi
if [ "$(cat .venv/.project-sha 2>/dev/null)" != "$proj_sha" ]; then
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$proj_sha" > .venv/.project-sha
fi
# The SLURM tests (tests/cli/test_slurm.py, tests/study/test_slurm_map.py) start a 2-node cluster on
# 127.0.0.1 from Debian's packages, the map's with accounting (slurmdbd on a private MariaDB);
# installed here when running as root with apt-get and missing (else those tests skip, saying why).
SLURM_DEBS="slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
slurm_missing=0
for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/sbatch /usr/sbin/slurmdbd /usr/sbin/mariadbd; do
  [ -x "$b" ] || slurm_missing=1
done
if [ "$slurm_missing" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing $SLURM_DEBS (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $SLURM_DEBS >/dev/null \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         $SLURM_DEBS >/dev/null; } \
    || echo "[setup] could not install the SLURM packages; the SLURM tests will skip"
fi
# the versions from the packages' metadata: importing open_clip imports torch._dynamo, which makes
# torch.compile's cache folder in the temp dir
echo "[setup] .venv ready: $(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "open_clip", v("open_clip_torch"))')"
