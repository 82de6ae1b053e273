"""Per-sample state of the moving-average losses (SogCLR's u, FastCLIP's u, iSogCLR's u and
temperatures), sharded by owner rank; the one machinery vlp/losses/{sogclr,fastclip,isogclr}.py share.

State: ``WIDTH`` fp32 columns per sample, keyed by the stream's stable ``sample_id`` (int64, up to
2.3 B); sample k lives on rank k % world at local row k // world (docs/losses.md, "The per-sample
state"). Column 0 is always a log u, -inf for "not seen yet" (a zero page of the table). Per
optimizer step (B = world x b, W = 4 x WIDTH bytes a sample):

    lookup (each loss call)          all_gather of the ids        B x 8 bytes received per rank
                                     all_to_all, owners -> askers  b x W bytes (each gets its old row)
    commit (after the step)          all_to_all, askers -> owners  b x W bytes (each owner gets the
                                                                   new rows of the samples it holds)

The gathered ids tell every rank who owns what, so the two all_to_alls need no size exchange. A
lookup is a round trip (the owner must learn the ids before it can answer), so two is its
floor. With accumulation the trainer calls the loss accum + 1 times a step and commits once.

Checkpoints: ``state_dict()`` is this rank's shard; ``load_state_dict`` takes the shards of any
saved world size and keeps the rows this rank owns; ``shards_needed`` says which saved ranks'
files a rank must read (only its own when the world size is unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Optional

import numpy as np

import torch
from torch import Tensor

from vlp.distributed import get_rank, get_world_size

GAMMA_SCHEDULES = ("constant", "cosine")


def gamma_at(step: int, total: int, gamma: float, gamma_min: float, schedule: str) -> float:
    """gamma at optimizer step ``step`` of ``total``: constant, or FastCLIP's cosine decay from
    ``gamma`` to ``gamma_min`` over the run (then ``gamma_min``)."""
    if schedule == "constant":
        return gamma
    progress = min(1.0, step / max(1, total))
    return gamma_min + (gamma - gamma_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def update_log_u(log_u_old: Tensor, log_g: Tensor, gamma: float) -> Tensor:
    """log((1 - gamma) u + gamma g) in the log domain; an unseen sample (log u = -inf) starts at g."""
    if gamma >= 1.0:
        return log_g.clone()
    mixed = torch.logaddexp(log_u_old + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isfinite(log_u_old), mixed, log_g)


# ---------------------------------------------------------------- owner layout (int64 throughout)
def owner_of(ids: Tensor, world: int) -> Tensor:
    """The rank that holds sample ``ids``' u: id % world."""
    return torch.remainder(ids, world)


def local_row(ids: Tensor, world: int) -> Tensor:
    """The row of sample ``ids`` in its owner's shard: id // world."""
    return torch.div(ids, world, rounding_mode="floor")


def rows_on(rank: int, world: int, num_samples: int) -> int:
    """Rows of rank ``rank``'s shard: the ids k < num_samples with k % world == rank."""
    return (num_samples - rank + world - 1) // world


def ids_on(rank: int, world: int, num_samples: int) -> Tensor:
    """(rows_on,) int64 sample ids of rank ``rank``'s shard, by row: rank + world * row."""
    return rank + world * torch.arange(rows_on(rank, world, num_samples), dtype=torch.long)


def shards_needed(rank: int, world: int, saved_world: int) -> list[int]:
    """The saved ranks (of a ``saved_world``-rank run) whose shards hold rows that ``rank`` owns
    under ``world``: ids k = rank (mod world) fall in saved shard k % saved_world, which runs over
    the saved ranks = rank (mod gcd). Same world size: only its own; 2 -> 3 ranks: all of them."""
    g = math.gcd(world, saved_world)
    return [r for r in range(saved_world) if r % g == rank % g]


class Table:
    """A rank's shard, (rows, width) fp32, stored as int32 bits XOR the bits of -inf so that zero
    memory reads as -inf ("not seen yet"): the table is calloc'ed (numpy zeros, pages mapped on
    first write) and grows in resident memory with the samples a run has visited."""

    NEG_INF_BITS = -8388608  # int32 view of float32 -inf (0xff800000)

    def __init__(self, rows: int, width: int = 2):
        self.bits = torch.from_numpy(np.zeros((rows, width), dtype=np.int32))

    def __len__(self) -> int:
        return self.bits.shape[0]

    def read(self, rows: Tensor) -> Tensor:
        """(k, width) fp32 of local ``rows`` (int64, on the CPU)."""
        return (self.bits[rows] ^ self.NEG_INF_BITS).view(torch.float32)

    def write(self, rows: Tensor, log_u: Tensor) -> None:
        self.bits[rows] = log_u.float().contiguous().view(torch.int32) ^ self.NEG_INF_BITS

    def dense(self) -> Tensor:
        """(rows, width) fp32 copy of the whole shard."""
        return (self.bits ^ self.NEG_INF_BITS).view(torch.float32)


# ---------------------------------------------------------------- collectives
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def all_gather_ranks(x: Tensor, world: int) -> Tensor:
    """(world * n, ...) concatenation over ranks in rank order of every rank's (n, ...) ``x``."""
    dist = _dist()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous())
    return out


def _all_to_all(x: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` to rank r; returns what every rank sent here, in rank
    order (a plain copy of the bits)."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    _dist().all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
    return out


class _Routes(NamedTuple):
    """Who holds what for one step's global batch, the same on every rank (from its gathered ids)."""

    mine: Tensor  # (m,) positions in the global batch (rank order) of the ids this rank owns
    rows: Tensor  # (m,) their rows in this rank's shard
    to_owner: Tensor  # (b,) this rank's anchors ordered by owner (stable): the order rows travel in
    per_owner: list[int]  # how many of this rank's anchors each rank owns
    per_asker: list[int]  # how many of the ids this rank owns each rank asked for


def _routes(every: Tensor, rank: int, world: int) -> _Routes:
    owners = owner_of(every, world)  # (B,)
    mine = (owners == rank).nonzero().squeeze(1)
    b = every.shape[0] // world
    own = owners[rank * b:(rank + 1) * b]
    per_asker = torch.bincount(torch.div(mine, b, rounding_mode="floor"), minlength=world)
    return _Routes(mine, local_row(every[mine], world), torch.sort(own, stable=True).indices,
                   torch.bincount(own, minlength=world).tolist(), per_asker.tolist())


class _Pending(NamedTuple):
    """The last loss call's lookup and update, kept for ``commit``."""

    ids: Tensor  # (b,) int64, CPU: this rank's anchors
    old: Tensor  # (b, width) fp32, CPU: their state before this step
    new: Optional[Tensor]  # (b, width) fp32 on the loss's device: after the last call (None before it)
    routes: Optional[_Routes]  # world > 1


class ShardedState:
    """The stateful-loss interface over an owner-sharded table of ``WIDTH`` fp32 columns per
    sample: ``_lookup`` (the old rows of this rank's anchors), ``_stage`` (the new rows of the
    last call), ``commit()`` / ``discard()``, checkpoint shards, and the moving-average rate
    gamma (constant or FastCLIP's cosine schedule). A subclass's ``__call__`` is the loss.

    Calling the loss several times before ``commit`` (gradient accumulation recomputes the same
    anchors) reuses the same old rows: only the last call's update is committed. With world > 1
    every rank calls it the same number of times with the same b (each call is a collective).
    ``rank``/``world_size`` default to torch.distributed's (0 and 1 without a process group).
    """

    NAME = "sogclr"  # in error messages
    STATE_KEY = "log_u"  # the shard's key in state_dict()
    WIDTH = 2

    def __init__(self, num_samples: int, gamma: float = 0.9, gamma_min: Optional[float] = None,
                 schedule: str = "constant", total_steps: int = 1, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None):
        if schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"gamma schedule must be one of {GAMMA_SCHEDULES}, got {schedule!r}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.world = int(world_size if world_size is not None else get_world_size())
        self.rank = int(rank if rank is not None else get_rank())
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world})")
        self.num_samples = int(num_samples)
        self.gamma, self.schedule, self.total_steps = gamma, schedule, total_steps
        self.gamma_min = gamma if gamma_min is None else gamma_min
        self.table = Table(rows_on(self.rank, self.world, self.num_samples), self.WIDTH)
        self.step = 0
        self.pending: Optional[_Pending] = None
        self.held: Optional[_Pending] = None  # this step's rows looked up ahead (`hold`)
        self.staged: Optional[Tensor] = None  # the last call's new rows

    @property
    def current_gamma(self) -> float:
        return gamma_at(self.step, self.total_steps, self.gamma, self.gamma_min, self.schedule)

    def _check_ids(self, ids, b: int) -> Tensor:
        """(b,) int64 CPU sample ids of this rank's anchors, checked against the table."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() != b:
            raise ValueError(f"{self.NAME} needs one sample id per local anchor: {ids.numel()} ids for b={b}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            raise ValueError(f"sample ids must be in [0, {self.num_samples}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids

    def _lookup(self, ids: Tensor, device: torch.device) -> _Pending:
        """The old rows of this rank's anchors ``ids``: from the local table (one rank) or from
        their owners: all_gather the global batch's ids (B x 8 bytes), then each owner sends
        every rank the rows it asked for (all_to_all). Every call looks up afresh (no rank ever
        decides alone to skip a collective); the table only changes in ``commit``, so repeated
        calls of a step get the same values."""
        if self.held is not None:
            return self.held
        if self.world == 1:
            return _Pending(ids, self.table.read(ids), None, None)
        every = all_gather_ranks(ids.to(device), self.world).cpu()  # (B,) int64 in rank order
        routes = _routes(every, self.rank, self.world)
        answers = self.table.read(routes.rows).to(device)  # asker-major: the order of `mine`
        got = _all_to_all(answers, routes.per_asker, routes.per_owner).cpu()  # owner-major
        old = torch.empty(ids.shape[0], self.WIDTH)
        old[routes.to_owner] = got
        return _Pending(ids, old, None, routes)

    def _stage(self, looked_up: _Pending, new: Tensor) -> None:
        """Keep the call's new rows (b, WIDTH) for ``commit`` (on the device: NCCL moves them there)."""
        self.pending = looked_up._replace(new=new.detach().float())
        self.staged = self.pending.new  # a replayed CUDA graph writes its rows here again

    def hold(self, ids: Tensor, device, into: Tensor) -> None:
        """Look up this step's old rows now (collectives, host copies) into the static device
        buffer ``into`` (b, WIDTH); the step's loss calls read them there and ``commit`` writes
        the rows the last call (or a CUDA graph's replay of it) staged. For a step replayed as a
        graph (vlp.train.static_step): nothing in the loss call reaches the host."""
        self.held = None
        ids = self._check_ids(ids, torch.as_tensor(ids).numel())
        looked_up = self._lookup(ids, device)
        into.copy_(looked_up.old, non_blocking=True)
        self.held = looked_up._replace(old=into)

    def commit(self) -> None:
        """Write the last call's rows into the owners' shards (under torch.distributed an
        all_to_all: each rank sends each owner its anchors' new rows), advance gamma's step. Call
        once per optimizer step that was taken; a skipped step calls ``discard()``."""
        if self.held is not None and self.pending is None and self.staged is not None:
            self.pending = self.held._replace(new=self.staged)  # a replayed graph staged its rows
        if self.pending is None:
            raise RuntimeError(f"{type(self).__name__}.commit() without a loss call since the last commit")
        p = self.pending
        self.pending = self.held = None
        if self.world == 1:
            self.table.write(p.ids, p.new.cpu())
        else:
            r = p.routes
            got = _all_to_all(p.new[r.to_owner.to(p.new.device)], r.per_owner, r.per_asker).cpu()
            self.table.write(r.rows, got)  # global-batch order: a repeated id keeps its last row
        self.step += 1

    def discard(self) -> None:
        """Forget the last call's update (a step skipped for a non-finite loss); no collective."""
        self.pending = self.held = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """This rank's shard: ``STATE_KEY`` (rows, WIDTH) fp32, row k = sample rank + world_size * k
        (ids_on), with the layout that names those ids; save one per rank. No collective."""
        return {self.STATE_KEY: self.table.dense(), "step": self.step, "rank": self.rank,
                "world_size": self.world, "num_samples": self.num_samples}

    def shards_needed(self, saved_world: int) -> list[int]:
        """The saved ranks whose shards this rank must read to resume (see `shards_needed`)."""
        return shards_needed(self.rank, self.world, saved_world)

    def _load_replicated(self, state: Mapping) -> None:
        raise ValueError(f"{self.NAME} state without a world_size: not a shard of this loss")

    def _check_samples(self, count: int) -> None:
        if count != self.num_samples:
            raise ValueError(f"{self.NAME} state holds {count} samples, this run's data "
                             f"{self.num_samples}: resume needs the same training shards")

    def load_state_dict(self, states: Mapping | Iterable[Mapping]) -> None:
        """Restore the rows this rank owns from saved shards of any world size: one state dict or
        an iterable of them (a generator keeps one in memory at a time). It needs the saved
        ranks ``shards_needed(rank, world_size, saved_world)`` (others are skipped). No collective."""
        if isinstance(states, Mapping):
            states = [states]
        steps, seen, saved_world, replicated = set(), set(), None, False
        for state in states:
            steps.add(int(state["step"]))
            if "world_size" not in state:  # a loss's older replicated table (SogCLR)
                self._load_replicated(state)
                replicated = True
                continue
            self._check_samples(int(state["num_samples"]))
            w_s, r_s = int(state["world_size"]), int(state["rank"])
            if saved_world not in (None, w_s):
                raise ValueError(f"{self.NAME} shards of {saved_world} and {w_s} ranks mixed in one load")
            saved_world = w_s
            if r_s in shards_needed(self.rank, self.world, w_s):
                self._load_shard(state[self.STATE_KEY], r_s, w_s)
                seen.add(r_s)
        if not replicated:
            if saved_world is None:
                raise ValueError(f"{self.NAME}: no saved state given to load")
            missing = sorted(set(shards_needed(self.rank, self.world, saved_world)) - seen)
            if missing:
                raise ValueError(f"{self.NAME}: rank {self.rank} of {self.world} needs the saved shards of ranks "
                                 f"{missing} (of {saved_world})")
        if len(steps) != 1:
            raise ValueError(f"{self.NAME} shards were saved at different steps: {sorted(steps)}")
        self.step = steps.pop()
        self.pending = None

    def _load_shard(self, rows: Tensor, r_s: int, w_s: int) -> None:
        """Keep the rows of saved rank r_s's shard (of a w_s-rank run) that this rank owns."""
        ids = ids_on(r_s, w_s, self.num_samples)
        if rows.shape != (ids.numel(), self.WIDTH):
            raise ValueError(f"{self.NAME} shard of rank {r_s}/{w_s} holds {tuple(rows.shape)} "
                             f"rows x columns, expected {(ids.numel(), self.WIDTH)}")
        keep = owner_of(ids, self.world) == self.rank
        self.table.write(local_row(ids[keep], self.world), rows[keep])
