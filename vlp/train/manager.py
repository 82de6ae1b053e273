"""The checkpoint policy of a run: where checkpoints go, keep-last-k, which one a resume starts
from (falling back past damaged ones), and what to tell the user when training must stop.

    checkpoints = CheckpointManager(out_dir, keep_last, strategy, say=print_on_main)
    path = checkpoints.save(step, model, optimizer, meta)    # a collective: every rank calls it
    found = checkpoints.find(cfg.train.resume)               # (path, state) or None

The formats (a .pt of full tensors, a DCP directory of shards) are the strategy's
(vlp.train.strategy); the file-level rules (atomic writes, checks, set-aside) vlp.train.checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from data_pipelines.messages import first_line
from vlp.config import ConfigError
from vlp.distributed import barrier, is_main
from vlp.train import checkpoint as ckpt


class CheckpointManager:
    def __init__(self, out_dir: Path, keep_last: int, strategy, say: Callable[[str], None]):
        self.dir = Path(out_dir) / "checkpoints"
        self.keep_last, self.strategy, self.say = keep_last, strategy, say

    def path(self, step: int) -> Path:
        """Where step `step`'s checkpoint is (or would be) written."""
        return self.dir / (f"step_{step:08d}" if self.strategy.sharded else f"step_{step:08d}.pt")

    def save(self, step: int, model, optimizer, meta: dict) -> Optional[Path]:
        """Write step `step` (the strategy's format) and prune to the last `keep_last`; all ranks
        meet before it returns. The path on the writing ranks, None on the others."""
        path = self.strategy.write_checkpoint(self.dir, step, model, optimizer, meta)
        if is_main():
            ckpt.prune(self.dir, self.keep_last)
        barrier()
        return path

    def clean(self) -> None:
        """Remove temp files of killed saves (main process), saying so."""
        if is_main():
            for tmp in ckpt.remove_stale_temps(self.dir):
                self.say(f"[vlp] removed {tmp.name}: temp file of a checkpoint save that was killed")

    def find(self, resume: str) -> Optional[tuple[Path, dict]]:
        """(path, state) to resume from: `resume` itself, or for "latest" the newest checkpoint
        that loads and checks (ckpt.check_state). Each newer one passed over is renamed to
        *.corrupt (kept, never resumed from again nor overwritten) and named in the log."""
        if resume != "latest":
            return Path(resume), ckpt.load_valid(resume)
        found = ckpt.latest_valid(self.dir)
        barrier()  # every rank has read its file before one is renamed
        if found is None:
            return None
        path, state, rejected = found
        for bad, reason in rejected:
            if is_main():
                kept = ckpt.set_aside(bad)
                self.say(f"[vlp] skipped {reason}; kept as {kept.name}; falling back to {path.name}")
        return path, state

    def resume(self, resume: str, load: Callable[[dict, Path], None], config: dict) -> Optional[Path]:
        """Remove killed saves' temps, then (train.resume set) find the checkpoint and `load(state,
        path)` it; the path, or None when starting fresh. A checkpoint whose tensors do not fit
        the model is refused in one line naming the settings that differ."""
        self.clean()
        if not resume:
            return None
        found = self.find(resume)
        if found is None:
            self.say(f"[vlp] resume=latest: no checkpoint in {self.dir}, starting fresh")
            return None
        path, state = found
        try:
            load(state, path)
        except (RuntimeError, KeyError, ValueError) as e:  # parameters or optimizer groups differ
            if isinstance(e, ConfigError):
                raise
            changes = ckpt.changed_settings(state.get("config"), config)
            why = "; ".join(changes) if changes else first_line(e)
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this run ({why}): resume needs the same "
                                       "model and loss; use a new train.output_dir to start over") from None
        return path

    def newest_valid(self) -> str:
        """For messages: the checkpoint a user should resume from, in words."""
        try:
            found = ckpt.latest_valid(self.dir)
        except ckpt.CheckpointError:
            found = None
        return f"the last valid checkpoint is {found[0]}" if found else f"no valid checkpoint exists in {self.dir}"
