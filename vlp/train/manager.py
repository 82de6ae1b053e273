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
from vlp.distributed import barrier, get_rank, get_world_size, is_main
from vlp.train import checkpoint as ckpt


class CheckpointManager:
    def __init__(self, out_dir: Path, keep_last: int, strategy, say: Callable[[str], None]):
        self.dir = Path(out_dir) / "checkpoints"
        self.keep_last, self.strategy, self.say = keep_last, strategy, say

    def path(self, step: int) -> Path:
        """Where step `step`'s checkpoint is (or would be) written."""
        return self.dir / (f"step_{step:08d}" if self.strategy.sharded else f"step_{step:08d}.pt")

    def save(self, step: int, model, optimizer, meta: dict, rank_state: Optional[dict] = None) -> Optional[Path]:
        """Write step `step` (the strategy's format) and prune to the last `keep_last`; all ranks
        meet before it returns. The path on the writing ranks, None on the others. `rank_state`:
        this rank's own state (sharded, O(N / world)), one file per rank beside the checkpoint,
        complete before the checkpoint is visible; meta["rank_files"] records the world size."""
        if rank_state is not None:
            meta = {**meta, "rank_files": get_world_size()}
            ckpt.save_rank_files(ckpt.rank_dir(self.path(step)), rank_state, get_rank(), get_world_size())
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
            return Path(resume), self.load_checked(resume)
        found = ckpt.latest_valid(self.dir, self.load_checked)
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

    @staticmethod
    def load_checked(path) -> dict:
        """A checkpoint's state (tensors, or a DCP directory's meta) after its checks, its
        per-rank files included."""
        state = ckpt.load_valid(path)
        if "rank_files" in state:
            ckpt.check_rank_files(path, state["rank_files"])
        return state

    def rank_states(self, path, ranks: list[int], saved_world: int):
        """The per-rank states of `ranks` saved beside checkpoint `path` (one in memory at a time)."""
        return ckpt.load_rank_files(path, ranks, saved_world)

    def newest_valid(self) -> str:
        """For messages: the checkpoint a user should resume from, in words."""
        try:
            found = ckpt.latest_valid(self.dir, self.load_checked)
        except ckpt.CheckpointError:
            found = None
        return f"the last valid checkpoint is {found[0]}" if found else f"no valid checkpoint exists in {self.dir}"
