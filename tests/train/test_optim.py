"""optim.name: LARS's trust ratio on a hand-computed case, its exclusions, and the builder."""

import pytest
import torch

from vlp.config import OptimConfig
from vlp.train.optim import LARS, build_optimizer, trust_ratio


def test_lars_step_by_hand():
    """w = (3, 4), g = (0.6, 0.8): ||w|| = 5, ||g|| = 1; wd 0.1, eta 0.001 -> r = 0.005 / 1.5;
    g' = g + 0.1 w = (0.9, 1.2); lr 2: v = 2 r g' = (0.006, 0.008), w = (2.994, 3.992).
    The excluded bias (adapt=False): no decay, r = 1: v = 2 * 0.5 = 1, then 0.9 + 1 = 1.9."""
    w = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = LARS([{"params": [bias], "weight_decay": 0.0, "adapt": False},
                {"params": [w], "weight_decay": 0.1}], lr=2.0, momentum=0.9, eta=0.001)
    assert trust_ratio(torch.tensor(5.0), torch.tensor(1.0), 0.1, 0.001).item() == pytest.approx(0.005 / 1.5)
    w.grad = torch.tensor([0.6, 0.8], dtype=torch.float64)
    bias.grad = torch.tensor([0.5], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([2.994, 3.992], dtype=torch.float64))
    assert bias.item() == pytest.approx(0.0)
    opt.step()  # momentum: bias v = 0.9 * 1 + 2 * 0.5
    assert bias.item() == pytest.approx(-1.9)


def test_trust_ratio_is_one_for_zero_norms():
    assert trust_ratio(torch.tensor(0.0), torch.tensor(2.0), 0.1, 0.001).item() == 1.0
    assert trust_ratio(torch.tensor(3.0), torch.tensor(0.0), 0.1, 0.001).item() == 1.0


def test_builder_marks_exclusions_and_names():
    from vlp.train.optim import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model.register_parameter("logit_scale", torch.nn.Parameter(torch.tensor(2.0)))
    groups = param_groups(model, 0.1)
    lars = build_optimizer(groups, OptimConfig(name="lars", lr=1.0), "cpu")
    excluded, adapted = lars.param_groups
    assert not excluded["adapt"] and excluded["weight_decay"] == 0.0 and len(excluded["params"]) == 4
    assert adapted["adapt"] and adapted["weight_decay"] == 0.1 and [p.shape for p in adapted["params"]] == [(4, 3)]
    assert isinstance(build_optimizer(groups, OptimConfig(name="sgd", lr=1.0), "cpu"), torch.optim.SGD)
    assert isinstance(build_optimizer(groups, OptimConfig(), "cpu"), torch.optim.AdamW)
