"""SogCLR / FastCLIP's global contrastive loss: FlatNCE with a per-sample moving-average normaliser
(Yuan et al. 2022, "Provable Stochastic Optimization for Global Contrastive Learning: Small Batch
Does Not Harm Performance", arXiv 2202.12387; Wei et al. 2024, FastCLIP, arXiv 2407.01445).

For local anchor i (sample id k_i) in each direction, with margins d_ij = t * (s_ij - s_ip) over
the B - 1 gathered negatives (v_i = logsumexp_j d_ij, as in FlatNCE):

    g_i  = mean_j exp(d_ij) = exp(v_i) / (B - 1)
    u_k  <- (1 - gamma) * u_k + gamma * g_i          (per sample, per direction; kept across steps)
    grad = mean_i grad(g_i) / u_k = mean_i (g_i / u_k) * grad(v_i)

So SogCLR is FlatNCE (grad v_i) with anchor weights w_i = g_i / u_k: with gamma = 1, u_k = g_i and
w_i = 1 exactly, which is FlatNCE's gradient. A small gamma averages the normaliser over the
epochs, the estimate of the *global* (all-data) denominator that makes small batches unbiased.
u is kept as log u (exp(v) overflows fp32 at t = 100); a sample seen for the first time starts at
u = g_i (w_i = 1), instead of SogCLR's u = 0 (w_i = 1/gamma on the first visit).

The reported loss value is InfoNCE's (as FlatNCE); ``scale_grad`` as FlatNCE: "same" (t gets the
SogCLR surrogate's gradient) or "infonce" (t gets InfoNCE's gradient).

State: one log u per (sample, direction) (image->text, text->image), keyed by the stream's stable
``sample_id`` (global position of the sample in the shard list, independent of world size,
workers and epoch; int64, up to 2.3 B). It is sharded by owner rank: sample k lives on rank
k % world at local row k // world, so a rank holds ceil(N / world) x 2 fp32 (8 bytes a sample,
O(N / world)). Per optimizer step, under torch.distributed (payloads for a global batch B):

    lookup (each loss call)          all_gather of the ids        B x 8 bytes received per rank
                                     all_to_all, owners -> askers  b x 8 bytes (each gets its old u)
    commit (after the step)          all_to_all, askers -> owners  b x 8 bytes (each owner gets the
                                                                   new u of the rows it holds)

(b = anchors per rank, B = world x b.) The gathered ids tell every rank who owns what, so the
two all_to_alls need no size exchange: they move exactly the rows asked for.
Three collectives a step whatever the world size (the replicated table of before: two
all_gathers of B rows, N x 8 bytes on every rank). A lookup is a round trip (the owner must
learn the ids before it can answer), so two is its floor. That is with one loss call a step
(train.accum=1); with accumulation the trainer calls the loss accum + 1 times a step, each a
lookup (2 collectives), and commits once. Every rank computes its anchors' new u itself from
the old values, with the same ops on the same (b, 2) tensors as the replicated version, so
losses, gradients and u are bit-identical to it (tests/losses/test_sogclr_sharded.py). With
world = 1 there is no collective and the shard is the whole table, as before.

Checkpoints: ``state_dict()`` is this rank's shard (its rows, the layout that names their ids);
save one per rank. ``load_state_dict`` takes the shards of any saved world size (and today's
replicated ``{"log_u": (N, 2), "step"}``) and keeps the rows this rank owns in the current one;
``shards_needed`` says which saved ranks' files a rank must read (only its own when the world
size is unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Optional

import numpy as np

import torch
from torch import Tensor

from vlp.distributed import get_rank, get_world_size
from vlp.losses.common import anchors, check_inputs, fp32_block, softplus_exact
from vlp.losses.diagnostics import diagnostics_from_softmax

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


class _WeightedObjective(torch.autograd.Function):
    """Value mean_i log(1 + e^{v_t,i}) (InfoNCE). Gradient w_i / n on v_i (SogCLR's) and, when v_t
    needs it, InfoNCE's sigma(v_t,i) / n on v_t."""

    @staticmethod
    def forward(ctx, v: Tensor, v_t: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(v_t, w)
        return softplus_exact(v_t).mean()

    @staticmethod
    def backward(ctx, grad: Tensor):
        v_t, w = ctx.saved_tensors
        n = v_t.numel()
        grad_v = w * (grad / n) if ctx.needs_input_grad[0] else None
        grad_v_t = torch.sigmoid(v_t) * (grad / n) if ctx.needs_input_grad[1] else None
        return grad_v, grad_v_t, None


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


class _Table:
    """A rank's shard of log u, (rows, 2) fp32, stored as int32 bits XOR the bits of -inf so
    that zero memory reads as -inf ("not seen yet"): the table is calloc'ed (numpy zeros, pages
    mapped on first write) and grows in resident memory with the samples a run has visited."""

    NEG_INF_BITS = -8388608  # int32 view of float32 -inf (0xff800000)

    def __init__(self, rows: int):
        self.bits = torch.from_numpy(np.zeros((rows, 2), dtype=np.int32))

    def __len__(self) -> int:
        return self.bits.shape[0]

    def read(self, rows: Tensor) -> Tensor:
        """(k, 2) fp32 of local ``rows`` (int64, on the CPU)."""
        return (self.bits[rows] ^ self.NEG_INF_BITS).view(torch.float32)

    def write(self, rows: Tensor, log_u: Tensor) -> None:
        self.bits[rows] = log_u.float().contiguous().view(torch.int32) ^ self.NEG_INF_BITS

    def dense(self) -> Tensor:
        """(rows, 2) fp32 copy of the whole shard."""
        return (self.bits ^ self.NEG_INF_BITS).view(torch.float32)


# ---------------------------------------------------------------- collectives
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _all_gather(x: Tensor, world: int) -> Tensor:
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
    old: Tensor  # (b, 2) fp32, CPU: their log u before this step
    new: Optional[Tensor]  # (b, 2) fp32 on the loss's device: after the last call (None before it)
    routes: Optional[_Routes]  # world > 1


class SogCLRLoss:
    """The stateful SogCLR loss: the shared loss signature plus ``ids`` (this rank's anchors'
    sample ids, int64), and ``commit()`` after each optimizer step.

        loss_fn = SogCLRLoss(num_samples, gamma=0.9, rank=rank, world_size=world)
        loss, metrics = loss_fn(img_b, txt_b, img_B, txt_B, t, offset=o, ids=ids_b)  # collective
        ...backward, optimizer.step()...
        loss_fn.commit()      # a collective under torch.distributed

    Calling it several times before ``commit`` (gradient accumulation recomputes the same
    anchors) reuses the same u: only the last call's update is committed. With world > 1 every
    rank calls it the same number of times with the same b (each call is a collective).
    ``rank``/``world_size`` default to torch.distributed's (0 and 1 without a process group).
    """

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
        self.table = _Table(rows_on(self.rank, self.world, self.num_samples))
        self.step = 0
        self.pending: Optional[_Pending] = None

    @property
    def log_u(self) -> Tensor:
        """(rows, 2) fp32 copy of this rank's shard, row k = sample rank + world * k (with one
        rank: the whole table, row = sample id); -inf where a sample was not seen yet."""
        return self.table.dense()

    @property
    def current_gamma(self) -> float:
        return gamma_at(self.step, self.total_steps, self.gamma, self.gamma_min, self.schedule)

    def __call__(self, img_local: Tensor, txt_local: Tensor, img_global: Tensor, txt_global: Tensor,
                 logit_scale: Tensor, logit_bias: Tensor | None = None, *, offset: int = 0,
                 scale_grad: str = "same", ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        b, big_b = check_inputs(img_local, txt_local, img_global, txt_global, offset, scale_grad)
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() != b:
            raise ValueError(f"sogclr needs one sample id per local anchor: {ids.numel()} ids for b={b}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            raise ValueError(f"sample ids must be in [0, {self.num_samples}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        device = img_local.device
        looked_up = self._lookup(ids, device)  # collective (the first call of a step, world > 1)
        gamma = self.current_gamma
        with fp32_block(device):
            v, v_t, parts, t, bias = anchors(img_local, txt_local, img_global, txt_global,
                                             logit_scale, logit_bias, b, big_b, offset, scale_grad)
            with torch.no_grad():
                log_g = v.detach() - math.log(big_b - 1)  # (2b,) log mean_j exp(d_ij)
                log_g = torch.stack(log_g.split(b), dim=1)  # (b, 2): column 0 image->text
                old = looked_up.old.to(device=device, dtype=log_g.dtype)
                new = update_log_u(old, log_g, gamma)
                w = torch.exp(log_g - new).T.reshape(-1)  # (2b,) in v's order: g_i / u_i
            loss = _WeightedObjective.apply(v, v_t, w)
            if bias is not None and scale_grad != "same":
                loss = loss + 0.0 * bias  # cancels in the margins; kept in the graph for DDP
        self.pending = looked_up._replace(new=new.detach().float())  # on the device: NCCL gathers there
        metrics = diagnostics_from_softmax(parts, t, extra={
            "loss": loss, "sogclr_weight": w.mean(), "sogclr_weight_max": w.max(), "sogclr_gamma": gamma})
        return loss, metrics

    def _lookup(self, ids: Tensor, device: torch.device) -> _Pending:
        """The old log u of this rank's anchors ``ids``: from the local table (one rank) or from
        their owners: all_gather the global batch's ids (B x 8 bytes), then each owner sends
        every rank the rows it asked for (all_to_all, b x 8 bytes a rank). Every call looks up
        afresh (no rank ever decides alone to skip a collective); the table only changes in
        ``commit``, so repeated calls of a step get the same values."""
        if self.world == 1:
            return _Pending(ids, self.table.read(ids), None, None)
        every = _all_gather(ids.to(device), self.world).cpu()  # (B,) int64 in rank order
        routes = _routes(every, self.rank, self.world)
        answers = self.table.read(routes.rows).to(device)  # asker-major: the order of `mine`
        got = _all_to_all(answers, routes.per_asker, routes.per_owner).cpu()  # owner-major
        old = torch.empty(ids.shape[0], 2)
        old[routes.to_owner] = got
        return _Pending(ids, old, None, routes)

    def commit(self) -> None:
        """Write the last call's u into the owners' shards (under torch.distributed an all_to_all:
        each rank sends each owner its anchors' new u), advance gamma's step. Call once per
        optimizer step that was taken; a skipped step calls ``discard()``."""
        if self.pending is None:
            raise RuntimeError("SogCLRLoss.commit() without a loss call since the last commit")
        p = self.pending
        self.pending = None
        if self.world == 1:
            self.table.write(p.ids, p.new.cpu())
        else:
            r = p.routes
            got = _all_to_all(p.new[r.to_owner.to(p.new.device)], r.per_owner, r.per_asker).cpu()
            self.table.write(r.rows, got)  # global-batch order: a repeated id keeps its last u
        self.step += 1

    def discard(self) -> None:
        """Forget the last call's update (a step skipped for a non-finite loss); no collective."""
        self.pending = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """This rank's shard: ``log_u`` (rows, 2) fp32, row k = sample rank + world_size * k
        (ids_on), with the layout that names those ids; save one per rank. No collective."""
        return {"log_u": self.table.dense(), "step": self.step, "rank": self.rank,
                "world_size": self.world, "num_samples": self.num_samples}

    def shards_needed(self, saved_world: int) -> list[int]:
        """The saved ranks whose shards this rank must read to resume (see `shards_needed`)."""
        return shards_needed(self.rank, self.world, saved_world)

    def load_state_dict(self, states: Mapping | Iterable[Mapping]) -> None:
        """Restore the rows this rank owns from saved shards of any world size: one state dict or
        an iterable of them (a generator keeps one in memory at a time). It needs the saved
        ranks ``shards_needed(rank, world_size, saved_world)`` (others are skipped), or one
        replicated state of before (``{"log_u": (num_samples, 2), "step"}``). No collective."""
        if isinstance(states, Mapping):
            states = [states]
        steps, seen, saved_world, replicated = set(), set(), None, False
        for state in states:
            log_u = state["log_u"]
            if "world_size" not in state:  # this release's replicated table
                if log_u.shape != (self.num_samples, 2):
                    raise ValueError(f"sogclr state holds {tuple(log_u.shape)[0]} samples, this run's data "
                                     f"{self.num_samples}: resume needs the same training shards")
                mine = ids_on(self.rank, self.world, self.num_samples)
                self.table.write(torch.arange(mine.numel()), log_u[mine])
                replicated = True
            else:
                if int(state["num_samples"]) != self.num_samples:
                    raise ValueError(f"sogclr state holds {state['num_samples']} samples, this run's data "
                                     f"{self.num_samples}: resume needs the same training shards")
                w_s, r_s = int(state["world_size"]), int(state["rank"])
                if saved_world not in (None, w_s):
                    raise ValueError(f"sogclr shards of {saved_world} and {w_s} ranks mixed in one load")
                saved_world = w_s
                if r_s not in shards_needed(self.rank, self.world, w_s):
                    continue
                ids = ids_on(r_s, w_s, self.num_samples)
                if log_u.shape != (ids.numel(), 2):
                    raise ValueError(f"sogclr shard of rank {r_s}/{w_s} holds {tuple(log_u.shape)[0]} rows, "
                                     f"expected {ids.numel()}")
                keep = owner_of(ids, self.world) == self.rank
                self.table.write(local_row(ids[keep], self.world), log_u[keep])
                seen.add(r_s)
            steps.add(int(state["step"]))
        if not replicated:
            if saved_world is None:
                raise ValueError("sogclr: no saved state given to load")
            missing = sorted(set(shards_needed(self.rank, self.world, saved_world)) - seen)
            if missing:
                raise ValueError(f"sogclr: rank {self.rank} of {self.world} needs the saved shards of ranks "
                                 f"{missing} (of {saved_world})")
        if len(steps) != 1:
            raise ValueError(f"sogclr shards were saved at different steps: {sorted(steps)}")
        self.step = steps.pop()
        self.pending = None
