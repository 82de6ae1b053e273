"""The checkpoint policy of a run: where checkpoints go, keep-last-k, which one a resume starts
from (falling back past damaged ones), and what to tell the user when training must stop.

    checkpoints = CheckpointManager(folder, keep_last, strategy, say=print_on_main)  # folder: a RunFolder
    path = checkpoints.save(step, model, optimizer, meta)    # a collective: every rank calls it
    found = checkpoints.find(cfg.train.resume)               # (path, state) or None
    checkpoints.close()                                      # at exit: the upload in flight ends

The formats (a .pt of full tensors, a DCP directory of shards) are the strategy's
(vlp.train.strategy); the file-level rules (atomic writes, checks, set-aside) vlp.train.checkpoint's.

A run folder in a bucket (vlp.storage.RunFolder, `train.output_dir=s3://...`): every rank
saves into its own local stage folder, which is uploaded with the checkpoint's manifest written
last (only then does `resume: latest` see it). A checkpoint only the main process writes (a
.pt, no per-rank files) is uploaded in the background, waited for before the next save and at
exit; one with files from every rank (a DCP directory, step_N.ranks/) is uploaded by each rank
its own part, then committed by rank 0 (in the foreground: O(checkpoint / world) per rank).
A resume downloads the newest committed checkpoint (every rank its own copy), checked
against its manifest; one that fails is set aside (NAME.corrupt.json) and the next is tried.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

from vlp.util import first_line
from vlp import integrity, storage
from vlp.config import ConfigError
from vlp.distributed import barrier, gather_object, get_rank, get_world_size, is_main
from vlp.train import checkpoint as ckpt


class CheckpointManager:
    def __init__(self, folder, keep_last: int, strategy, say: Callable[[str], None]):
        self.folder = folder if isinstance(folder, storage.RunFolder) else storage.RunFolder(folder)
        self.remote = self.folder.remote
        self.dir = self.folder.path("checkpoints") if self.remote else Path(self.folder.root) / "checkpoints"
        self.keep_last, self.strategy, self.say = keep_last, strategy, say
        self.fetched_from: Optional[str] = None  # the URL of the checkpoint a bucket resume downloaded

    def _base(self, step: int) -> str:
        return f"step_{step:08d}" if self.strategy.sharded else f"step_{step:08d}.pt"

    def path(self, step: int):
        """Where step `step`'s checkpoint is (or would be) written (a URL in a bucket)."""
        return f"{self.dir}/{self._base(step)}" if self.remote else self.dir / self._base(step)

    def save(self, step: int, model, optimizer, meta: dict, rank_state: Optional[dict] = None) -> Optional[Path]:
        """Write step `step` (the strategy's format) and prune to the last `keep_last`; all ranks
        meet before it returns. The path on the writing ranks, None on the others. `rank_state`:
        this rank's own state (sharded, O(N / world)), one file per rank beside the checkpoint,
        complete before the checkpoint is visible; meta["rank_files"] records the world size."""
        if self.remote:
            return self._save_remote(step, model, optimizer, meta, rank_state)
        if rank_state is not None:
            meta = {**meta, "rank_files": get_world_size()}
            ckpt.save_rank_files(ckpt.rank_dir(self.path(step)), rank_state, get_rank(), get_world_size())
        path = self.strategy.write_checkpoint(self.dir, step, model, optimizer, meta)
        if is_main():
            ckpt.prune(self.dir, self.keep_last)
        barrier()
        return path

    def _save_remote(self, step: int, model, optimizer, meta: dict, rank_state: Optional[dict]) -> Optional[str]:
        """`save` into a bucket: a local stage per rank, then the upload (class docstring)."""
        self.folder.wait()  # the previous upload: done, its error raised here
        stage, rank, world = self.folder.stage_dir(), get_rank(), get_world_size()
        name = f"checkpoints/{self._base(step)}"
        if rank_state is not None:
            meta = {**meta, "rank_files": world}
            ckpt.atomic_save(rank_state, ckpt.rank_file(stage / storage.companion(self._base(step)), rank, world))
        written = self.strategy.write_checkpoint(stage, step, model, optimizer, meta)
        parts = _staged_parts(stage)  # (local path, name) of what this rank wrote
        if world == 1 or (rank_state is None and not self.strategy.sharded):  # only the main process's
            if written is not None:
                self.folder.publish(written, name, self.keep_last or None, before=[p for p in parts if p[1] != name])
            else:
                shutil.rmtree(stage, ignore_errors=True)  # another rank's: nothing staged here
            barrier()
            return self.folder.path(name) if written is not None else None
        if is_main():  # every rank's part: uploaded by its rank, committed by rank 0
            for _, member in parts:
                self.folder.discard(member)
        barrier()
        entries = gather_object([(member, local.is_dir(), self.folder.upload_part(local, member))
                                 for local, member in parts])
        if is_main():
            for member in sorted({m for m, _, _ in entries}, key=lambda m: m != storage.companion(name)):
                self.folder.commit(member, [o for m, _, objs in entries if m == member for o in objs],
                                   "dir" if any(d for m, d, _ in entries if m == member) else "file")
            if self.keep_last:
                self.folder.prune(self.keep_last)
        barrier()
        shutil.rmtree(stage, ignore_errors=True)
        return self.folder.path(name) if is_main() or self.strategy.sharded else None

    def close(self) -> None:
        """Wait for the upload in flight (raising its error) and remove the local stage copies."""
        self.folder.close()

    def clean(self) -> None:
        """Remove temp files of killed saves (main process), saying so."""
        if self.remote:
            for name in self.folder.remove_uncommitted() if is_main() else []:
                self.say(f"[vlp] removed {self.folder.path(name)}: objects of a checkpoint upload that was killed")
            return
        if is_main():
            for tmp in ckpt.remove_stale_temps(self.dir):
                self.say(f"[vlp] removed {tmp.name}: temp file of a checkpoint save that was killed")

    def find(self, resume: str) -> Optional[tuple[Path, dict]]:
        """(path, state) to resume from: `resume` itself, or for "latest" the newest checkpoint
        that loads and checks (ckpt.check_state). Each newer one passed over is renamed to
        *.corrupt (kept, never resumed from again nor overwritten) and named in the log."""
        if resume != "latest":
            return Path(resume), self.load_checked(resume)
        if self.remote:
            return self._find_remote()
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

    def _find_remote(self) -> Optional[tuple[Path, dict]]:
        """`find("latest")` in a bucket: the newest committed checkpoint that downloads, matches
        its manifest and checks; the newer ones that fail are set aside (NAME.corrupt.json)."""
        rejected, found = [], None
        for name in reversed(self.folder.committed_checkpoints()):
            try:
                path = self.fetch(name)
                found = (path, self.load_checked(path))
                self.fetched_from = self.folder.path(name)
                break
            except (storage.IntegrityError, ckpt.CheckpointError, FileNotFoundError) as e:
                rejected.append((name, str(e)))
        barrier()  # every rank has its copy before one is set aside
        for bad, reason in rejected if is_main() else []:
            kept = self.folder.set_aside(bad)
            self.say(f"[vlp] skipped {reason}; kept as {self.folder.path(kept)}; "
                     + (f"falling back to {self.folder.path(f'checkpoints/{found[0].name}')}" if found else "none left"))
        if found is None and rejected:
            raise ckpt.CheckpointError(f"no valid checkpoint in {self.dir}: {rejected[0][1]}")
        return found

    def fetch(self, name: str) -> Path:
        return fetch_checkpoint(self.folder, name)

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
        return self.fetched_from if self.remote and resume == "latest" else path

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
        if self.remote:
            names = self.folder.committed_checkpoints()
            return (f"the last committed checkpoint is {self.folder.path(names[-1])}" if names
                    else f"no committed checkpoint exists in {self.dir}")
        try:
            found = ckpt.latest_valid(self.dir, self.load_checked)
        except ckpt.CheckpointError:
            found = None
        return f"the last valid checkpoint is {found[0]}" if found else f"no valid checkpoint exists in {self.dir}"


def _staged_parts(stage: Path) -> list[tuple[Path, str]]:
    """(local path, checkpoint member name) of what a rank saved into its stage folder: the
    checkpoint (a DCP rank's files are left in DCP's temp folder `.step_N.tmp` on ranks > 0),
    its per-rank folder. A .pt's checksum sidecar is deleted: the bucket manifest holds its digest."""
    parts = []
    for entry in sorted(stage.iterdir()):
        base = entry.name
        if base.endswith(".pt.manifest.json"):
            entry.unlink()
            continue
        if base.startswith(".") and base.endswith(".tmp"):
            base = base[1:-len(".tmp")]
        parts.append((entry, f"checkpoints/{base}"))
    return parts


def fetch_checkpoint(folder, name: str) -> Path:
    """A local copy of committed checkpoint `name` of a bucket RunFolder with its per-rank
    files, checked against its manifest; a .pt gets back its checksum sidecar (the digest the
    manifest holds), so vlp.train.checkpoint verifies it as it does a local one."""
    path = folder.fetch(name)
    if path.is_file():
        obj = folder.manifest(name)["objects"][0]
        integrity.write_manifest(path, {path.name: {"size": obj["bytes"], integrity.ALGORITHM: obj["sha256"]}})
    try:
        folder.fetch(storage.companion(name))
    except FileNotFoundError:
        pass  # a checkpoint without per-rank files
    return path
