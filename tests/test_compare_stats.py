"""vlp.study.stats on hand-computed numbers."""
import math

import pytest

from vlp.study.stats import bootstrap_ci, paired_difference, seed_summary, t975, verdict


def test_seed_summary_by_hand():
    # values 1, 2, 3, 6: mean 3, deviations -2 -1 0 3, sum sq 14, var 14/3, std 2.1602
    s = seed_summary([1.0, 2.0, 3.0, 6.0])
    assert s["n"] == 4 and s["mean"] == 3.0
    assert s["std"] == pytest.approx(math.sqrt(14 / 3))
    half = 3.182 * math.sqrt(14 / 3) / 2  # t_{0.975, 3} * std / sqrt(4)
    assert (s["lo"], s["hi"]) == (pytest.approx(3 - half), pytest.approx(3 + half))
    one = seed_summary([0.5, None, float("nan")])
    assert one == {"n": 1, "mean": 0.5, "std": 0.0, "lo": None, "hi": None}
    assert seed_summary([]) is None


def test_paired_difference_by_hand():
    # per seed: 0.30-0.25, 0.32-0.26, 0.28-0.25 = 0.05, 0.06, 0.03 -> mean 0.04667, sd 0.01528
    arm = {0: 0.30, 1: 0.32, 2: 0.28, 7: 0.9}  # seed 7 has no reference: ignored
    ref = {0: 0.25, 1: 0.26, 2: 0.25}
    d = paired_difference(arm, ref)
    assert d["n"] == 3 and sorted(d["diffs"]) == [0, 1, 2]
    assert d["mean"] == pytest.approx(0.14 / 3)
    assert d["std"] == pytest.approx(math.sqrt(7e-4 / 3))  # sum of squared deviations 14e-4 / 3, over n - 1
    assert d["lo"] == pytest.approx(0.14 / 3 - 4.303 * math.sqrt(7e-4 / 3) / math.sqrt(3), rel=1e-9)
    assert d["resolved"] and d["lo"] > 0
    # a difference whose CI straddles 0 is not resolved
    d2 = paired_difference({0: 0.3, 1: 0.2}, {0: 0.25, 1: 0.25})
    assert d2["mean"] == pytest.approx(0.0) and not d2["resolved"]
    assert not paired_difference({0: 0.3}, {0: 0.1})["resolved"]  # one seed: no CI


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(9) == 2.262 and t975(100) == 1.960
    with pytest.raises(ValueError):
        t975(0)


def test_bootstrap_ci_degenerate_and_spread():
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0)
    lo, hi = bootstrap_ci([0.0] * 50 + [1.0] * 50, n_boot=2000, seed=1)
    # binomial: mean 0.5, se 0.05 -> roughly [0.40, 0.60]
    assert 0.37 <= lo <= 0.43 and 0.57 <= hi <= 0.63
    assert bootstrap_ci([0.0] * 50 + [1.0] * 50, n_boot=2000, seed=1) == (lo, hi)  # deterministic


def test_verdict_sentence():
    diffs = {"flatnce": paired_difference({0: 0.30, 1: 0.32, 2: 0.28}, {0: 0.25, 1: 0.26, 2: 0.25}),
             "sogclr": paired_difference({0: 0.3, 1: 0.2}, {0: 0.25, 1: 0.25})}
    text = verdict(diffs, "infonce", "test mean R@10")
    assert text.startswith("Paired by seed, test mean R@10 minus infonce's: resolved (95 % CI excludes 0): "
                           "flatnce +4.7 points, 95 % CI [+0.9, +8.5], n=3. not resolved: sogclr +0.0 points")
    assert verdict({}, "infonce", "R@1") == "No paired differences to infonce on R@1 yet."
