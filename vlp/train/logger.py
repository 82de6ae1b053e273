"""The run's records: config.yaml, log.jsonl (one JSON object per line), TensorBoard, Weights &
Biases and result.json. Only the main process writes; files open on the first record.

The run folder is a vlp.storage.RunFolder: a local folder gets plain files as they are written;
in a bucket log.jsonl is kept locally and uploaded whole every 30 s, at every checkpoint
(`flush`) and at `close`, tb/ at `close`, config.yaml and result.json when written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class RunLogger:
    def __init__(self, folder, enabled: bool, wandb_project: Optional[str] = None,
                 config: Optional[dict] = None):
        from vlp.storage import RunFolder

        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        self.enabled = enabled
        self.wandb_project, self.config = wandb_project, config
        self._file = None
        self._tb = None
        self._wandb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = self.folder.log_writer("log.jsonl")
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
        from vlp.config import save_config

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


def check_wandb(cfg) -> None:
    """train.wandb_project needs wandb installed: refused now, not at the first log."""
    if cfg.train.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            from vlp.config import ConfigError

            raise ConfigError("config: train.wandb_project is set but wandb is not installed (pip install wandb)")


def show_step(bar, metrics: dict, samples_per_s: float) -> None:
    """The progress bar's postfix: loss, InfoNCE, logit_scale, samples/s."""
    bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}",
                    infonce=f"{metrics.get('infonce', float('nan')):.3f}",
                    scale=f"{metrics.get('logit_scale', float('nan')):.1f}", sps=f"{samples_per_s:.0f}", refresh=False)
