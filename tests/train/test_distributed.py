"""The gather contract: 2 gloo ranks x batch b == 1 process x batch 2b, through DDP (the
gradient-scale argument is in vlp/distributed.py's docstring).

One module-scoped spawn runs every distributed check; the tests below assert on its results
against single-process references computed here (float64, so agreement is to ~1e-12).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from vlp.distributed import gather_with_grad, get_rank, get_world_size, positive_offset
from vlp.losses.infonce import infonce_loss
from vlp.losses.registry import get_loss
from vlp.losses.siglip import siglip_loss

from dist_utils import run_distributed
from naive_losses import naive_loss



def _load_open_clip_loss():
    """open_clip/loss.py on its own: ``import open_clip`` also builds its model zoo (~8 s in each
    spawned rank on 2 cores); loss.py itself needs only torch. Same file, same code."""
    package = importlib.util.find_spec("open_clip")
    path = Path(package.submodule_search_locations[0]) / "loss.py"
    spec = importlib.util.spec_from_file_location("_open_clip_loss_only", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


oc_loss = _load_open_clip_loss()
F64 = torch.float64
WORLD, B_LOCAL, D_IMG, D_TXT, D = 2, 3, 6, 5, 4
CONFIGS = [("infonce", "same"), ("flatnce", "same"), ("flatnce", "split"), ("siglip", "same"),
           ("dcl", "same"), ("dcl", "split")]
ATOL = 1e-9  # the contract is 1e-6; float64 makes the real agreement ~1e-15


class TinyDualEncoder(nn.Module):
    """Two linear encoders + log-temperature + bias, the smallest model with every loss input."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(D_IMG, D)
        self.text = nn.Linear(D_TXT, D)
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x_img, x_txt):
        img = F.normalize(self.image(x_img), dim=-1)
        txt = F.normalize(self.text(x_txt), dim=-1)
        return img, txt, self.log_scale.exp(), self.logit_bias


def make_problem(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = TinyDualEncoder().to(F64)
    gen = torch.Generator().manual_seed(seed)
    n = WORLD * B_LOCAL
    return {
        "state": model.state_dict(),
        "x_img": torch.randn(n, D_IMG, generator=gen, dtype=F64),
        "x_txt": torch.randn(n, D_TXT, generator=gen, dtype=F64),
        "img_f": F.normalize(torch.randn(n, D, generator=gen, dtype=F64), dim=-1),
        "txt_f": F.normalize(torch.randn(n, D, generator=gen, dtype=F64), dim=-1),
        "gather_w": torch.randn(WORLD, n, 2, generator=gen, dtype=F64),
    }


def train_step(model: nn.Module, x_img, x_txt, name: str, scale_grad: str):
    """What the trainer does: forward, gather with grad, local loss with this rank's offset, backward."""
    img, txt, t, bias = model(x_img, x_txt)
    img_all, txt_all = gather_with_grad(img), gather_with_grad(txt)
    offset = positive_offset(img.shape[0], img_all.shape[0])
    loss, metrics = get_loss(name)(
        img, txt, img_all, txt_all, t, bias, offset=offset, scale_grad=scale_grad
    )
    loss.backward()
    params = model.module if isinstance(model, DDP) else model
    grads = {k: p.grad.detach().clone() for k, p in params.named_parameters()}
    return loss.detach(), metrics, grads


def worker(rank: int, world: int, problem: dict) -> dict:
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    out: dict = {"rank": get_rank(), "world": get_world_size()}

    # gather: rank order, and the backward sums every rank's gradient for this rank's rows
    x = (torch.arange(2 * B_LOCAL, dtype=F64).reshape(B_LOCAL, 2) + 100 * rank).requires_grad_()
    gathered = gather_with_grad(x)
    (gathered * problem["gather_w"][rank]).sum().backward()
    out["gathered"], out["gather_grad"] = gathered.detach(), x.grad.clone()
    out["offset"] = positive_offset(B_LOCAL, WORLD * B_LOCAL)
    try:
        positive_offset(B_LOCAL, WORLD * B_LOCAL + 1)
        out["offset_assert"] = None
    except AssertionError as err:
        out["offset_assert"] = str(err)
    try:  # unequal local batch sizes must raise on every rank, not hang
        gather_with_grad(torch.zeros(2 + rank, 3), check_shapes=True)
        out["shape_error"] = None
    except ValueError as err:
        out["shape_error"] = str(err)

    # every loss through DDP on this rank's slice of the batch
    for name, scale_grad in CONFIGS:
        model = TinyDualEncoder().to(F64)
        model.load_state_dict(problem["state"])
        ddp = DDP(model)
        out[name, scale_grad] = train_step(
            ddp, problem["x_img"][rows], problem["x_txt"][rows], name, scale_grad
        )

    # per-rank parity with open_clip's own distributed losses on the same local features
    t = torch.tensor(12.0, dtype=F64, requires_grad=True)
    bias = torch.tensor(-4.0, dtype=F64, requires_grad=True)
    for name, ours_fn, ref_fn in [
        ("infonce", infonce_loss,
         oc_loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)),
        ("siglip", siglip_loss, oc_loss.SigLipLoss(rank=rank, world_size=world)),
    ]:
        pair = []
        for use_ref in (False, True):
            img = problem["img_f"][rows].clone().requires_grad_()
            txt = problem["txt_f"][rows].clone().requires_grad_()
            if use_ref:
                loss = ref_fn(img, txt, t, bias)
            else:
                img_all, txt_all = gather_with_grad(img), gather_with_grad(txt)
                loss, _ = ours_fn(img, txt, img_all, txt_all, t, bias, offset=rank * B_LOCAL)
            grads = torch.autograd.grad(loss, [img, txt, t, bias], allow_unused=True, materialize_grads=True)
            pair.append((loss.detach(), [g.detach() for g in grads]))
        out["open_clip", name] = pair
    return out


@pytest.fixture(scope="module")
def problem() -> dict:
    return make_problem()


@pytest.fixture(scope="module")
def ranks(problem) -> list[dict]:
    return run_distributed(worker, world_size=WORLD, args=(problem,), timeout_s=180)


def test_without_process_group_helpers_are_trivial():
    x = torch.randn(4, 3, requires_grad=True)
    assert gather_with_grad(x) is x
    assert get_rank() == 0 and get_world_size() == 1
    assert positive_offset(4) == 0 and positive_offset(4, 4) == 0
    with pytest.raises(AssertionError, match="unequal local batch"):
        positive_offset(4, 8)


@pytest.mark.multiproc
def test_rank_helpers(ranks):
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == WORLD for r in ranks)
    assert [r["offset"] for r in ranks] == [0, B_LOCAL]
    assert all("unequal local batch" in r["offset_assert"] for r in ranks)
    assert all("same shape on every rank" in r["shape_error"] for r in ranks)


@pytest.mark.multiproc
def test_gather_concatenates_in_rank_order(ranks):
    expected = torch.cat(
        [torch.arange(2 * B_LOCAL, dtype=F64).reshape(B_LOCAL, 2) + 100 * r for r in range(WORLD)]
    )
    for r in ranks:
        torch.testing.assert_close(r["gathered"], expected, atol=0, rtol=0)


@pytest.mark.multiproc
def test_gather_backward_sums_all_ranks_gradients(ranks, problem):
    """Rank r's L_r = sum(W_r * gathered); d(sum_r' L_r')/dx_r = sum_r' W_r'[rows of r]."""
    w_sum = problem["gather_w"].sum(dim=0)
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res["gather_grad"], w_sum[r * B_LOCAL:(r + 1) * B_LOCAL], atol=1e-12, rtol=0)


@pytest.mark.multiproc
@pytest.mark.parametrize("name,scale_grad", CONFIGS)
def test_two_ranks_equal_one_rank_with_double_batch(ranks, problem, name, scale_grad):
    model = TinyDualEncoder().to(F64)
    model.load_state_dict(problem["state"])
    ref_loss, ref_metrics, ref_grads = train_step(model, problem["x_img"], problem["x_txt"], name, scale_grad)

    local_losses = torch.stack([r[name, scale_grad][0] for r in ranks])
    # the global loss is the mean of the per-rank means (equal local batches)
    torch.testing.assert_close(local_losses.mean(), ref_loss, atol=ATOL, rtol=0)
    for r in ranks:
        loss, metrics, grads = r[name, scale_grad]
        assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-12)
        assert set(grads) == set(ref_grads)
        for key, g in grads.items():  # after DDP averaging, no extra scale factor
            torch.testing.assert_close(g, ref_grads[key], atol=ATOL, rtol=0, msg=f"{name} {key}")
    assert ref_metrics["loss"] == pytest.approx(ref_loss.item(), abs=1e-12)


@pytest.mark.multiproc
@pytest.mark.parametrize("name,scale_grad", CONFIGS)
def test_two_ranks_equal_a_naive_one_process_reference(ranks, problem, name, scale_grad):
    """The same 2-rank results against tests/support/naive_losses.py (per-anchor loops, no vlp code)."""
    model = TinyDualEncoder().to(F64)
    model.load_state_dict(problem["state"])
    value, surrogate = naive_loss(name, scale_grad, *model(problem["x_img"], problem["x_txt"]))
    names, params = zip(*model.named_parameters())
    expected = dict(zip(names, torch.autograd.grad(surrogate, params, allow_unused=True, materialize_grads=True)))
    torch.testing.assert_close(torch.stack([r[name, scale_grad][0] for r in ranks]).mean(), value.detach(),
                               atol=ATOL, rtol=0)
    for r in ranks:
        for key, g in r[name, scale_grad][2].items():
            torch.testing.assert_close(g, expected[key], atol=ATOL, rtol=0, msg=f"{name} {key}")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["infonce", "siglip"])
def test_per_rank_equals_open_clip_distributed_loss(ranks, name):
    """Per rank, value and local-feature/t/bias gradients equal open_clip's distributed losses."""
    for r in ranks:
        (ours, ours_grads), (ref, ref_grads) = r["open_clip", name]
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        for g, e in zip(ours_grads, ref_grads):
            torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
