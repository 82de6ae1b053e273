"""The run's records: log.jsonl (one JSON object per line), TensorBoard and Weights & Biases.
Only the main process writes; files open on the first record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class RunLogger:
    def __init__(self, out_dir: Path, enabled: bool, wandb_project: Optional[str] = None,
                 config: Optional[dict] = None):
        self.out_dir, self.enabled = Path(out_dir), enabled
        self.wandb_project, self.config = wandb_project, config
        self._file = None
        self._tb = None
        self._wandb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.out_dir / "log.jsonl", "a")
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
        if self.wandb_project:
            if self._wandb is None:
                import wandb  # present: the trainer refused train.wandb_project without it

                self._wandb = wandb.init(project=self.wandb_project, config=self.config, dir=str(self.out_dir))
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()
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
