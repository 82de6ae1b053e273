"""The run's records: config.yaml, log.jsonl (one JSON object per line), TensorBoard, Weights &
Biases and result.json. Only the main process writes; files open on the first record.

The run folder is a vlp.checkpoint.storage.RunFolder: a local folder gets plain files as they are written;
in a bucket log.jsonl is kept locally and uploaded whole every 30 s, at every checkpoint
(`flush`) and at `close`, tb/ at `close`, config.yaml and result.json when written."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Optional

from vlp.config import ConfigError, save_config


class RunLogger:
    def __init__(self, folder, enabled: bool, wandb_project: Optional[str] = None,
                 config: Optional[dict] = None):
        """Writes nothing yet; a wandb_project without wandb installed is refused now, not at the first log."""
        if wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError("config: train.wandb_project is set but wandb is not installed (pip install wandb)")
        self.folder = folder  # the run's vlp.checkpoint.storage.RunFolder
        self.enabled = enabled
        self.wandb_project, self.config = wandb_project, config
        self._file = None
        self._tb = None
        self._wandb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = LogWriter(self.folder, "log.jsonl")
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.folder.local_dir("tb")))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
        if self.wandb_project:
            if self._wandb is None:
                import wandb  # present: the trainer refused train.wandb_project without it

                where = self.folder.cache_dir if self.folder.remote else self.folder.root
                self._wandb = wandb.init(project=self.wandb_project, config=self.config, dir=str(where))
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def save_config(self, cfg) -> None:
        """config.yaml (main process), creating a local run folder."""
        if not self.folder.remote:
            Path(self.folder.root).mkdir(parents=True, exist_ok=True)
        with self.folder.file("config.yaml") as path:
            save_config(cfg, path)

    def write_result(self, result: dict) -> None:
        with self.folder.file("result.json") as path:
            path.write_text(json.dumps(result, indent=2))

    def flush(self) -> None:
        """Upload log.jsonl now (a bucket run folder; a no-op locally)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
            self.folder.sync_dir("tb")
        if self._wandb is not None:
            self._wandb.finish()


def show_step(bar, metrics: dict, samples_per_s: float) -> None:
    """The progress bar's postfix: loss, InfoNCE, logit_scale, samples/s."""
    bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}",
                    infonce=f"{metrics.get('infonce', float('nan')):.3f}",
                    scale=f"{metrics.get('logit_scale', float('nan')):.1f}", sps=f"{samples_per_s:.0f}", refresh=False)


class LogWriter:
    """An appending text log (``log.jsonl``): locally a file flushed on every line; in a bucket a
    local copy (started from the object: a resumed run keeps its history) uploaded whole every
    ``upload_every_s``, on ``flush()`` and on ``close()``."""

    def __init__(self, folder, name: str, upload_every_s: float = 30.0):
        self.folder, self.name, self.upload_every_s = folder, name, upload_every_s
        self._last_upload, self._dirty = time.monotonic(), False
        self._local = folder.cache_dir / "logs" / name if folder.remote else folder.local_dir("") / name
        self._local.parent.mkdir(parents=True, exist_ok=True)
        if folder.remote:
            try:
                self._local.write_bytes(folder.read_bytes(name))
            except FileNotFoundError:
                self._local.write_bytes(b"")
        self._file = open(self._local, "a")

    def write(self, line: str) -> None:
        """Append one line (a newline is added when missing)."""
        self._file.write(line if line.endswith("\n") else line + "\n")
        self._file.flush()
        self._dirty = True
        if self.folder.remote and time.monotonic() - self._last_upload >= self.upload_every_s:
            self.flush()

    def flush(self) -> None:
        """Upload the whole log now (a no-op locally)."""
        self._file.flush()
        if self.folder.remote and self._dirty:
            self.folder.put(self._local, self.name, keep=True)
            self._dirty = False
        self._last_upload = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
