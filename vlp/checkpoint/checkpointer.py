"""The checkpointer: one per run, over one RunFolder (local or bucket), with the parts that own
state registered as SHARED, PER_RANK or RANK_FILES (docs/checkpoints.md). A checkpoint is listed
once whole (step_N.pt by a rename or one PUT; step_N/ once its META_FILE, written last, is
there); a failed save is one line on every rank and removes what it wrote; what killed saves
left goes at the next start; resume=latest sets aside what fails.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable, Optional

from vlp.checkpoint import integrity, resume
from vlp.config import ConfigError
from vlp.distributed import barrier, gather_object, get_rank, get_world_size, is_main
from vlp.checkpoint.storage import SIDECAR, RunFolder, remove_local
from vlp.checkpoint.files import (CKPT_RE, META_FILE, CheckpointError, load, load_sharded, load_valid, rank_file,
                                  ranks_name, save_file, write_failed, write_shards)
from vlp.util import first_line, pid_alive

SHARED, PER_RANK, RANK_FILES = "shared", "per_rank", "rank_files"
# what saves leave until they finish: .NAME.tmp-PID[-rRANK]; without a PID: the temp names of earlier releases
_TEMP = re.compile(r"^\.(step_\d+(?:\.pt|\.ranks)?(?:\.manifest\.json)?)\.tmp(?:-(\d+)(?:-r\d+)?)?$")


def list_checkpoints(folder: RunFolder) -> list[str]:
    """Names of the whole checkpoints in `folder`, oldest step first."""
    found = [(int(m.group(1)), name) for name in folder.listdir() if (m := CKPT_RE.match(name))
             and (m.group(2) or folder.exists(f"{name}/{META_FILE}"))]
    return [name for _, name in sorted(found)]


def _remove(folder: RunFolder, name: str) -> None:
    """Delete checkpoint `name` and its companions; a folder's META_FILE first (unlisted at once)."""
    if not name.endswith(".pt"):
        folder.remove(f"{name}/{META_FILE}")
    for member in (name, name + SIDECAR, ranks_name(name)):
        folder.remove(member, tree=True)


def prune(folder: RunFolder, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (0: keep all); the names deleted."""
    old = list_checkpoints(folder)[:-keep_last] if keep_last > 0 else []
    for name in old:
        _remove(folder, name)
    return old


def set_aside(folder: RunFolder, name: str) -> str:
    """Rename a bad checkpoint NAME.corrupt (kept for inspection, never listed); the new name."""
    folder.move(name, name + ".corrupt")
    if folder.exists(name + SIDECAR):
        folder.move(name + SIDECAR, name + ".corrupt" + SIDECAR)
    return name + ".corrupt"


def clean(folder: RunFolder) -> list[str]:
    """At start (one writer, vlp.checkpoint.lock), remove what killed saves left: temp names of dead
    writers, a folder without its META_FILE, per-rank files of no checkpoint; the names removed."""
    listed, removed = set(list_checkpoints(folder)), []
    for name in folder.listdir():
        temp, step = _TEMP.match(name), CKPT_RE.match(name)
        if (temp and not (temp.group(2) and pid_alive(int(temp.group(2))))) \
                or (step and name not in listed and not step.group(2)) \
                or (name.endswith(".ranks") and not listed & {name[:-6], name[:-6] + ".pt"}):
            folder.remove(name, tree=True)
            removed.append(name)
    return removed


def fetch(folder: RunFolder, name: str) -> Path:
    """A local path of checkpoint `name` (itself, or a download) with its per-rank files (and an
    earlier release's sidecar) beside it."""
    path = folder.download(name)
    for extra in (name + SIDECAR, ranks_name(name)):
        with contextlib.suppress(FileNotFoundError):
            folder.download(extra)
    return path


def latest_valid(folder: RunFolder) -> tuple[Optional[tuple[str, Path, dict]], list[tuple[str, str]]]:
    """((where, local path, state) of the newest checkpoint that loads and checks, or None;
    [(name, why)] of the newer ones that do not)."""
    rejected = []
    for name in reversed(list_checkpoints(folder)):
        path = None
        try:
            path = fetch(folder, name)
            return (folder.path(name), path, load_valid(path)), rejected
        except (CheckpointError, FileNotFoundError) as e:  # messages name the checkpoint, not a download
            rejected.append((name, str(e) if path is None else str(e).replace(str(path), folder.path(name))))
    return None, rejected


class Checkpointer:
    def __init__(self, folder: RunFolder, tensors, keep_last: int = 0, facts: Optional[dict] = None,
                 say: Callable[[str], None] = print):
        self.folder, self.tensors, self.keep_last, self.facts, self.say = folder, tensors, keep_last, dict(facts or {}), say
        self.parts: list[tuple[str, object, str]] = []
        self.relayouts: dict[str, Optional[Callable]] = {}  # PER_RANK parts: their entries after a layout change
        self.saved_step: Optional[int] = None

    def register(self, key: str, part, scope: str = SHARED, relayout: Optional[Callable] = None) -> None:
        """Save and load `part`'s state_dict() under `key`. A PER_RANK part may give
        relayout(saved, cfg, world_size) -> one entry per rank, for a resume under another layout
        (without one, its ranks start fresh: None)."""
        self.parts.append((key, part, scope))
        if scope == PER_RANK:
            self.relayouts[key] = relayout

    def save(self, step: int) -> str:
        """Write step `step`'s checkpoint, then prune to keep_last; a collective. Its path or URL.
        A step saved already (a stop right after a checkpoint) is not written twice."""
        name = f"step_{step:08d}" + ("" if self.tensors.sharded else ".pt")
        if step == self.saved_step:
            return self.folder.path(name)
        if self.tensors.sharded and is_main():
            _remove(self.folder, name)  # left by an earlier run stopped at this step: never half old, half new
        self._agree(self.folder.wait, name)  # the previous upload's error, on every rank
        meta = self._meta()
        try:
            if any(scope == RANK_FILES for _, _, scope in self.parts):
                meta["rank_files"] = self._save_rank_files(name)
            (self._save_dcp if self.tensors.sharded else self._save_pt)(name, meta)
        except CheckpointError:
            if self.tensors.sharded and is_main():  # a folder without its META_FILE: never listed, removed
                with contextlib.suppress(Exception):  # (a lost bucket: nothing to remove there)
                    _remove(self.folder, name)
            raise
        self.saved_step = step
        return self.folder.path(name)

    def _states(self, scope: str) -> dict:
        return {key: part.state_dict() for key, part, s in self.parts if s == scope}

    def _meta(self) -> dict:
        """The facts and every part's state; per-rank parts gathered (a collective)."""
        mine = self._states(PER_RANK)
        ranks = gather_object([mine])
        return {**self.facts, **self._states(SHARED), **{key: [r[key] for r in ranks] for key in mine}}

    def _agree(self, write: Callable, name: str, stage: Optional[Path] = None):
        """`write()` on every rank; when any failed, all raise the first one's line and remove
        their `stage`. Returns every rank's result, in rank order."""
        result, error = None, None
        try:
            result = write()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            error = str(write_failed(self.folder.path(name), e, stage or Path(".")))
        answers = gather_object([(error, result)])
        failed = [e for e, _ in answers if e]
        if failed:
            if stage is not None:
                remove_local(stage)
            agreed = CheckpointError(failed[0])
            agreed.echo = not is_main()  # the same line on every rank: printed once (vlp.cli)
            raise agreed
        return [r for _, r in answers]

    def _save_rank_files(self, name: str) -> int:
        """Each rank's RANK_FILES parts into NAME.ranks/, complete before the checkpoint appears."""
        world = get_world_size()
        member = rank_file(name, get_rank(), world)
        stage, state = self.folder.stage(member), self._states(RANK_FILES)
        self._agree(lambda: (save_file(state, stage), self.folder.put(stage, member)), name, stage)
        return world

    def _save_pt(self, name: str, meta: dict) -> None:
        """One .pt of full tensors and the parts, by the main process, published in the background."""
        stage = self.folder.stage(name) if is_main() else None
        self._agree(lambda: stage and save_file({**self.tensors.state_dict(), **meta}, stage), name, stage)
        if stage is not None:
            self.folder.remove(name + SIDECAR)  # an earlier release's, for other bytes
            self.folder.publish(stage, name, then=lambda: prune(self.folder, self.keep_last))

    def _save_dcp(self, name: str, meta: dict) -> None:
        """A DCP folder: every rank writes its shards and puts them under NAME/, then rank 0 the
        manifest of all files and, last, META_FILE."""
        stage = self.folder.stage(name, tag=f"r{get_rank()}")

        def shards():
            digests = write_shards(self.tensors.sharded_state(), stage)
            self.folder.put(stage, name)
            return digests

        digests = {k: v for ranks in self._agree(shards, name, stage) for k, v in ranks.items()}
        meta_stage = self.folder.stage(f"{name}/{META_FILE}") if is_main() else None

        def commit():
            if meta_stage is not None:
                save_file(meta, meta_stage)
                manifest = integrity.manifest_bytes({**digests, META_FILE: integrity.entry(meta_stage)})
                self.folder.write_bytes(f"{name}/{integrity.DIR_MANIFEST}", manifest)
                self.folder.put(meta_stage, f"{name}/{META_FILE}")  # last: the commit
                prune(self.folder, self.keep_last)

        self._agree(commit, name, meta_stage)

    def resume(self, spec: str, cfg) -> Optional[tuple[str, dict]]:
        """Remove what killed saves left, then find the checkpoint `spec`, fit it to this run (vlp.checkpoint.resume),
        load every part and say what changed: (where, state), or None when starting fresh."""
        for name in clean(self.folder) if is_main() else []:
            self.say(f"[vlp] removed {name} in {self.folder.url}: left by a checkpoint save that was killed")
        if not spec:
            return None
        found = self.find(spec)
        if found is None:
            self.say(f"[vlp] resume=latest: no checkpoint in {self.folder.url}, starting fresh")
            return None
        where, path, state = found
        try:
            state = resume.fit(state, cfg, get_world_size(), where, self.relayouts)
            self._load(state, path)
        except (RuntimeError, KeyError, ValueError) as e:  # parameters or optimizer groups differ
            if isinstance(e, (ConfigError, CheckpointError)):  # a refused change; a damaged per-rank file
                raise
            changes = resume.changed_settings(state.get("config"), cfg.to_dict())
            raise CheckpointError(f"checkpoint {where} does not fit this run ({'; '.join(changes) or first_line(e)}): "
                                  "resume needs the same model and loss; use a new train.output_dir to start over") from None
        finally:
            self.folder.drop_downloads()
        changed = resume.layout_changes(state, cfg, get_world_size())  # e.g. world size: 2 -> 1
        if changed:  # train.resume_mode=continue (else refused by fit)
            self.say(f"[vlp] layout changed since {where}: {'; '.join(changed)} (train.resume_mode=continue)")
        for line in resume.applied_lines(state, cfg):
            self.say(line)  # e.g. "optim.lr 1e-3 -> 1e-5 from step 12" (vlp.checkpoint.resume.RESUME_RULES)
        return where, state

    def _load(self, state: dict, path: Path) -> None:
        if path.is_dir():  # DCP reshards to this run's layout, whichever strategy saved it
            target = self.tensors.sharded_state()
            load_sharded(target, path)
            self.tensors.load_sharded(target)
        else:
            self.tensors.load_state_dict(state)
        for key, part, scope in self.parts:
            if scope == RANK_FILES and "rank_files" in state:
                world = state["rank_files"]
                part.load_state_dict(load(path.parent / rank_file(path.name, r, world))[key]
                                     for r in part.shards_needed(world))
            elif key in state:
                part.load_state_dict(state[key])

    def find(self, spec: str) -> Optional[tuple[str, Path, dict]]:
        """(where, local path, state) of `spec`, or for "latest" the newest checkpoint that loads
        and checks; newer ones that fail are set aside, saying so."""
        if spec != "latest":
            return spec, Path(spec), load_valid(spec)
        found, rejected = latest_valid(self.folder)
        barrier()  # every rank has read its copy before one is renamed
        if found is None and rejected:
            more = f" (and {len(rejected) - 1} more)" if len(rejected) > 1 else ""
            raise CheckpointError(f"no valid checkpoint in {self.folder.url}: {rejected[0][1]}{more}")
        for name, reason in rejected if is_main() else []:
            kept = set_aside(self.folder, name)
            self.say(f"[vlp] skipped {reason}; kept as {kept}; falling back to {Path(found[0]).name if found else '-'}")
        return found

    def newest_valid(self) -> str:
        """For messages: the checkpoint a user should resume from, in words."""
        self.folder.wait()
        found, _ = latest_valid(self.folder)
        self.folder.drop_downloads()
        return f"the last valid checkpoint is {found[0]}" if found else f"no valid checkpoint exists in {self.folder.url}"

    def close(self) -> None:
        """Wait for the upload in flight (raising its error); remove the local copies."""
        self.folder.close()
