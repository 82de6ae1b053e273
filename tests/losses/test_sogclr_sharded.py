"""SogCLR's owner-sharded u against the replicated table it replaces: 2 and 3 gloo ranks give
bit-identical losses, gradients, metrics and u over several steps (with gradient accumulation's
repeated calls, a skipped and a discarded step); shards saved under 2 ranks reload under 3 and 1 with every
u kept, and training goes on bit-identical; this release's replicated state loads; 64-bit ids
above 2^31 on a lazily allocated 3e9-sample table."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from vlp.losses.common import anchors, check_inputs, fp32_block
from vlp.losses.diagnostics import diagnostics_from_softmax
from vlp.losses.sharded import gamma_at, ids_on, local_row, owner_of, rows_on, shards_needed, update_log_u
from vlp.losses.sogclr import SogCLRLoss, _WeightedObjective

from dist_utils import run_distributed

GAMMA_SCHEDULES = ("constant", "cosine")

# ---------------------------------------------------------------- the reference
# vlp/losses/sogclr.py's SogCLRLoss at 965021a (the replicated table), verbatim but for its name.

def _replicated_all_gather(x: Tensor) -> Tensor:
    """Concatenation over ranks in rank order (no autograd); x itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


class ReplicatedSogCLR:
    """The stateful SogCLR loss: the shared loss signature plus ``ids`` (this rank's anchors'
    sample ids), and ``commit()`` after each optimizer step.

        loss_fn = SogCLRLoss(num_samples, gamma=0.9)
        loss, metrics = loss_fn(img_b, txt_b, img_B, txt_B, t, offset=o, ids=ids_b)
        ...backward, optimizer.step()...
        loss_fn.commit()      # a collective under torch.distributed

    Calling it several times before ``commit`` (gradient accumulation recomputes the same
    anchors) reuses the same u: only the last call's update is committed.
    """

    def __init__(self, num_samples: int, gamma: float = 0.9, gamma_min: Optional[float] = None,
                 schedule: str = "constant", total_steps: int = 1):
        if schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"gamma schedule must be one of {GAMMA_SCHEDULES}, got {schedule!r}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.gamma, self.schedule, self.total_steps = gamma, schedule, total_steps
        self.gamma_min = gamma if gamma_min is None else gamma_min
        self.log_u = torch.full((num_samples, 2), float("-inf"))  # -inf: not seen yet
        self.step = 0
        self.pending: Optional[tuple[Tensor, Tensor]] = None

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
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.log_u.shape[0]):
            raise ValueError(f"sample ids must be in [0, {self.log_u.shape[0]}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        device = img_local.device
        gamma = self.current_gamma
        with fp32_block(device):
            v, v_t, parts, t, bias = anchors(img_local, txt_local, img_global, txt_global,
                                             logit_scale, logit_bias, b, big_b, offset, scale_grad)
            with torch.no_grad():
                log_g = v.detach() - math.log(big_b - 1)  # (2b,) log mean_j exp(d_ij)
                log_g = torch.stack(log_g.split(b), dim=1)  # (b, 2): column 0 image->text
                old = self.log_u[ids].to(device=device, dtype=log_g.dtype)
                new = update_log_u(old, log_g, gamma)
                w = torch.exp(log_g - new).T.reshape(-1)  # (2b,) in v's order: g_i / u_i
            loss = _WeightedObjective.apply(v, v_t, w)
            if bias is not None and scale_grad != "same":
                loss = loss + 0.0 * bias  # cancels in the margins; kept in the graph for DDP
        self.pending = (ids.to(device), new.detach().float())  # on the device: NCCL gathers there
        metrics = diagnostics_from_softmax(parts, t, extra={
            "loss": loss, "sogclr_weight": w.mean(), "sogclr_weight_max": w.max(), "sogclr_gamma": gamma})
        return loss, metrics

    def commit(self) -> None:
        """Write the last call's u into the table on every rank (all-gather), advance gamma's step.
        Call once per optimizer step that was taken; a skipped step calls ``discard()``."""
        if self.pending is None:
            raise RuntimeError("SogCLRLoss.commit() without a loss call since the last commit")
        ids, new = self.pending
        self.pending = None
        ids, new = _replicated_all_gather(ids), _replicated_all_gather(new)
        self.log_u[ids.cpu()] = new.cpu()
        self.step += 1

    def discard(self) -> None:
        """Forget the last call's update (a step skipped for a non-finite loss)."""
        self.pending = None

    def state_dict(self) -> dict:
        return {"log_u": self.log_u.clone(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        log_u = state["log_u"]
        if log_u.shape != self.log_u.shape:
            raise ValueError(f"sogclr state holds {tuple(log_u.shape)[0]} samples, this run's data "
                             f"{self.log_u.shape[0]}: resume needs the same training shards")
        self.log_u = log_u.clone().float()
        self.step = int(state["step"])


# ---------------------------------------------------------------- the runs
N, B_LOCAL, D, STEPS = 40, 12, 8, 4
KW = dict(gamma=0.3, gamma_min=0.1, schedule="cosine", total_steps=6)


def problem(world: int, seed: int, steps: int = STEPS, n: int = N):
    """Per step: (world * B_LOCAL, D) fp32 unit features and ids (a third of them reused from the
    step before, so u's moving average runs; step 1 holds one id twice, on the first and the last
    rank, as a re-read sample: the later one's u is kept); step 2 is a 'discarded' step."""
    gen = torch.Generator().manual_seed(seed)
    big_b = world * B_LOCAL
    img = F.normalize(torch.randn(steps, big_b, D, generator=gen), dim=-1)
    txt = F.normalize(torch.randn(steps, big_b, D, generator=gen), dim=-1)
    ids = [torch.randperm(n, generator=gen)[:big_b]]
    for _ in range(steps - 1):
        fresh = torch.randperm(n, generator=gen)
        keep = ids[-1][: big_b // 3]
        fresh = fresh[~torch.isin(fresh, keep)][: big_b - keep.numel()]
        ids.append(torch.cat([keep, fresh])[torch.randperm(big_b, generator=gen)])
    ids = torch.stack(ids)
    ids[1, -1] = ids[1, 0]
    return img, txt, ids


def run_steps(loss_fn, rank, world, img, txt, ids, calls=2):
    """Each step: ``calls`` loss calls (accumulation recomputes the anchors; the first call of
    step 1 passes other ids, which the last call's replace), backward of the last, commit; step 2
    is skipped as the trainer skips a non-finite step (neither commit nor discard), step 3 calls
    discard() between its calls. Returns per step the loss, metrics and gradients."""
    from vlp.distributed import gather_with_grad

    out = []
    for s in range(img.shape[0]):
        sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        for c in range(calls):
            if (s, c) == (3, 1):
                loss_fn.discard()  # drops the first call's update; the second's is committed
            il = img[s, sl].clone().requires_grad_()
            tl = txt[s, sl].clone().requires_grad_()
            t = torch.tensor(12.0, requires_grad=True)
            step_ids = ids[s, sl].flip(0) if (s, c) == (1, 0) else ids[s, sl]
            loss, metrics = loss_fn(il, tl, gather_with_grad(il), gather_with_grad(tl), t,
                                    offset=rank * B_LOCAL, scale_grad="split", ids=step_ids)
        loss.backward()
        if s != 2:
            loss_fn.commit()
        out.append({"loss": loss.detach(), "metrics": {k: float(v) for k, v in metrics.items()},
                    "grads": (il.grad, tl.grad, t.grad)})
    return out


def _both_worker(rank, world, img, txt, ids, start):
    """The replicated reference and the sharded loss side by side on the same inputs; ``start``:
    None, or (the replicated state, the saved shards of another world size) to resume from."""
    ref = ReplicatedSogCLR(N, **KW)
    sharded = SogCLRLoss(N, **KW)  # rank and world from the process group
    if start is not None:
        ref.load_state_dict(start[0])
        sharded.load_state_dict(s for s in start[1] if s["rank"] in shards_needed(rank, world, s["world_size"]))
        assert torch.equal(sharded.log_u, ref.log_u[ids_on(rank, world, N)])
    ref_out = run_steps(ref, rank, world, img, txt, ids)
    out = run_steps(sharded, rank, world, img, txt, ids)
    return {"ref": ref_out, "out": out, "ref_state": ref.state_dict(), "state": sharded.state_dict()}


def assert_same_runs(ranks):
    for r in ranks:
        for a, b in zip(r["ref"], r["out"]):
            assert torch.equal(a["loss"], b["loss"])
            assert a["metrics"] == b["metrics"]
            for ga, gb in zip(a["grads"], b["grads"]):
                assert torch.equal(ga, gb)


def assemble(states, n=N) -> Tensor:
    """The whole (n, 2) table from every rank's shard (a one-rank load)."""
    whole = SogCLRLoss(n, rank=0, world_size=1)
    whole.load_state_dict(states)
    return whole.log_u


@pytest.fixture(scope="module")
def two_ranks():
    img, txt, ids = problem(2, seed=0)
    return run_distributed(_both_worker, 2, args=(img, txt, ids, None))


@pytest.mark.multiproc
def test_two_ranks_bit_identical_to_replicated(two_ranks):
    assert_same_runs(two_ranks)
    ref_u = two_ranks[0]["ref_state"]["log_u"]
    assert torch.equal(two_ranks[1]["ref_state"]["log_u"], ref_u)  # the reference is replicated
    assert torch.isfinite(ref_u).any(dim=1).sum() > N // 2 and torch.isinf(ref_u).any()
    assert torch.equal(assemble([r["state"] for r in two_ranks]), ref_u)
    for r, ranks_out in enumerate(two_ranks):  # each rank holds its ids only: rows = ceil(N / 2)
        assert ranks_out["state"]["log_u"].shape == (rows_on(r, 2, N), 2) == (N // 2, 2)
        assert ranks_out["state"]["step"] == ranks_out["ref_state"]["step"] == STEPS - 1


@pytest.mark.multiproc
def test_three_ranks_resume_two_rank_shards_bit_identical(two_ranks):
    """Shards saved by 2 ranks, resumed by 3 (each reads only the saved shards it needs), then
    3 more steps: every loss, gradient and u equal the replicated table's resumed run."""
    start = (two_ranks[0]["ref_state"], [r["state"] for r in two_ranks])
    img, txt, ids = problem(3, seed=1)
    three = run_distributed(_both_worker, 3, args=(img, txt, ids, start))
    assert_same_runs(three)
    assert torch.equal(assemble([r["state"] for r in three]), three[0]["ref_state"]["log_u"])
    assert [r["state"]["log_u"].shape[0] for r in three] == [14, 13, 13]  # ceil(40 / 3) at most


@pytest.mark.multiproc
def test_reload_under_any_world_size_keeps_every_u(two_ranks):
    """2 -> 3, 2 -> 1, 2 -> 4 ranks (and back to 2): every sample's u where the new layout puts it."""
    saved = [r["state"] for r in two_ranks]
    full = two_ranks[0]["ref_state"]["log_u"]
    for world in (1, 2, 3, 4):
        for rank in range(world):
            sog = SogCLRLoss(N, rank=rank, world_size=world)
            sog.load_state_dict(saved)  # all shards given: the ones it does not need are skipped
            assert torch.equal(sog.log_u, full[ids_on(rank, world, N)])
            assert sog.step == STEPS - 1
    with pytest.raises(ValueError, match=r"needs the saved shards of ranks \[1\]"):
        SogCLRLoss(N, rank=0, world_size=3).load_state_dict(saved[:1])
    SogCLRLoss(N, rank=0, world_size=4).load_state_dict(saved[:1])  # 0 mod 4 ids: all in shard 0 of 2


@pytest.mark.multiproc
def test_replicated_checkpoint_format_loads(two_ranks):
    """A checkpoint of this release (the replicated {"log_u": (N, 2), "step"}) resumes under the
    sharded table at any world size; a wrong sample count is refused by name."""
    old = two_ranks[0]["ref_state"]
    assert set(old) == {"log_u", "step"}
    for world in (1, 2, 3):
        for rank in range(world):
            sog = SogCLRLoss(N, rank=rank, world_size=world)
            sog.load_state_dict(old)
            assert torch.equal(sog.log_u, old["log_u"][ids_on(rank, world, N)]) and sog.step == old["step"]
    with pytest.raises(ValueError, match="same training shards"):
        SogCLRLoss(N + 1, rank=0, world_size=2).load_state_dict(old)
    with pytest.raises(ValueError, match="same training shards"):
        SogCLRLoss(N + 1, rank=0, world_size=2).load_state_dict([two_ranks[0]["state"]])


def test_shards_needed_and_layout():
    assert shards_needed(1, 2, 2) == [1]  # same world: its own file only
    assert shards_needed(1, 3, 2) == [0, 1]  # gcd 1: every file
    assert shards_needed(3, 256, 512) == [3, 259]  # 512 -> 256 ranks: two files each
    assert shards_needed(5, 512, 256) == [5]
    n = 10
    for world in (1, 2, 3, 4, 11, 12):  # more ranks than samples: empty shards
        every = torch.cat([ids_on(r, world, n) for r in range(world)])
        assert sorted(every.tolist()) == list(range(n))
        for r in range(world):
            assert torch.equal(local_row(ids_on(r, world, n), world), torch.arange(rows_on(r, world, n)))


def test_indexing_above_2_31():
    """Owner and row of ids past int32 (2.3 B samples): int64 math, no wrap-around."""
    ids = torch.tensor([2**31 - 1, 2**31, 2**31 + 1, 2_299_999_999, 3 * 10**9 - 1, 2**32 + 7])
    for world in (1, 2, 3, 512):
        assert torch.equal(owner_of(ids, world) + world * local_row(ids, world), ids)
        assert owner_of(ids, world).dtype == torch.long and (owner_of(ids, world) < world).all()
    assert rows_on(0, 512, 2_300_000_000) == 4_492_188 and rows_on(511, 512, 2_300_000_000) == 4_492_187


def _big_worker(rank, world, img, txt, big_ids, small_ids, n_big):
    import resource

    ref = ReplicatedSogCLR(int(small_ids.max()) + 1, **KW)  # the same anchors, compact ids
    sharded = SogCLRLoss(n_big, **KW)  # 3e9 / world rows, allocated as they are written
    ref_out = run_steps(ref, rank, world, img, txt, small_ids)
    out = run_steps(sharded, rank, world, img, txt, big_ids)
    mine = owner_of(big_ids.reshape(-1), world) == rank
    rows = local_row(big_ids.reshape(-1)[mine], world)
    got = sharded.table.read(rows)
    want = ref.log_u[small_ids.reshape(-1)[mine]]
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"ref": ref_out, "out": out, "same_u": torch.equal(got, want), "rows": len(sharded.table),
            "max_row": int(rows.max()), "rss_gb": rss_gb}


@pytest.mark.multiproc
def test_three_billion_samples_ids_above_2_31():
    """N = 3e9 on 2 ranks (1.5e9 rows each, 12 GB of address space, touched pages only): ids
    above 2^31 give the same losses, gradients and u as the replicated table over compact ids."""
    n_big = 3 * 10**9
    img, txt, small = problem(2, seed=2)
    big = torch.tensor([2**31 - 3, 2**31, 2**31 + 1, 2_299_999_999, n_big - 1, n_big - 2])
    lut = torch.cat([big, torch.arange(N - big.numel()) * 70_000_000 + 7])  # compact id -> big id
    assert lut.unique().numel() == N and int(lut.max()) < n_big
    ranks = run_distributed(_big_worker, 2, args=(img, txt, lut[small], small, n_big))
    assert_same_runs(ranks)
    for r in ranks:
        assert r["same_u"] and r["rows"] == n_big // 2
        assert r["rss_gb"] < 4, f"{r['rss_gb']:.1f} GB resident: the table did not allocate lazily"
    assert max(r["max_row"] for r in ranks) > 2**30
