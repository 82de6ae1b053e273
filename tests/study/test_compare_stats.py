"""vlp.study.stats on hand-computed numbers: t quantiles and p-values from the t distribution's
closed forms at 1 and 2 degrees of freedom, Holm from its definition, a least-squares line by hand."""
import math

import pytest

from vlp.study.stats import (bootstrap_ci, holm, linear_fit, paired_difference, seed_summary, t_quantile, t_test_p,
                             verdict)


def test_seed_summary_by_hand():
    # values 1, 2, 3, 6: mean 3, deviations -2 -1 0 3, sum sq 14, var 14/3, std 2.1602
    s = seed_summary([1.0, 2.0, 3.0, 6.0])
    assert s["n"] == 4 and s["mean"] == 3.0
    assert s["std"] == pytest.approx(math.sqrt(14 / 3))
    half = 3.182446305284263 * math.sqrt(14 / 3) / 2  # t_{0.975, 3} * std / sqrt(4)
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
    assert d["lo"] == pytest.approx(0.14 / 3 - 4.302652729749464 * math.sqrt(7e-4 / 3) / math.sqrt(3), rel=1e-9)
    # paired t: t^2 = mean^2 / (var / n) = 28; with 2 df, P(|T| > t) = 1 - t / sqrt(2 + t^2) = 1 - sqrt(14 / 15)
    assert d["p"] == pytest.approx(1 - math.sqrt(14 / 15), rel=1e-9)
    assert d["resolved"] and d["lo"] > 0
    # a difference whose CI straddles 0 is not resolved
    d2 = paired_difference({0: 0.3, 1: 0.2}, {0: 0.25, 1: 0.25})
    assert d2["mean"] == pytest.approx(0.0) and not d2["resolved"]
    assert not paired_difference({0: 0.3}, {0: 0.1})["resolved"]  # one seed: no CI


def test_t_quantiles():
    # df = 1 is Cauchy: t_{0.975} = tan(0.475 pi); df = 2: t_q = (2q - 1) sqrt(2 / (1 - (2q - 1)^2)) at q = 0.975
    assert t_quantile(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-12)
    assert t_quantile(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95 ** 2)), rel=1e-12)
    for df, table in ((3, 3.182), (9, 2.262), (30, 2.042), (100, 1.984)):  # the printed tables, 3 decimals
        assert abs(t_quantile(df) - table) < 5e-4
    assert t_quantile(10 ** 6) == pytest.approx(1.959964, abs=1e-5)  # the normal's
    assert t_quantile(1, level=0.5) == pytest.approx(1.0)  # Cauchy's quartile
    with pytest.raises(ValueError):
        t_quantile(0)


def test_t_test_p_by_hand():
    # 1 df (Cauchy): P(|T| > t) = 1 - 2 arctan(t) / pi; values 1 and 3: mean 2, std sqrt(2), t = 2 / (sqrt 2 / sqrt 2) = 2
    assert t_test_p(2.0, math.sqrt(2.0), 2) == pytest.approx(1 - 2 * math.atan(2.0) / math.pi, rel=1e-12)
    assert t_test_p(0.3, 0.0, 3) == 0.0 and t_test_p(0.0, 0.0, 3) == 1.0 and t_test_p(0.3, 0.1, 1) is None


def test_holm_from_its_definition():
    # m = 4 sorted: d .005 <= .05/4, a .01 <= .05/3, c .03 > .05/2: stop, so c and b (.04 < .05 alone) stay unresolved
    out = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005, "e": None})
    assert {k: v["holm"] for k, v in out.items()} == {"a": True, "b": False, "c": False, "d": True}
    # adjusted p_(i) = max_{j <= i} (m - j + 1) p_(j): d 4 x .005, a 3 x .01, c 2 x .03, b max(.06, .04)
    assert {k: round(v["p_holm"], 12) for k, v in out.items()} == {"d": 0.02, "a": 0.03, "c": 0.06, "b": 0.06}
    assert all(v["m"] == 4 for v in out.values())  # e (no test: one seed) is not in the family
    assert holm({"x": 0.7, "y": 0.9}) == {"x": {"p_holm": 1.0, "holm": False, "m": 2},
                                          "y": {"p_holm": 1.0, "holm": False, "m": 2}}  # capped at 1
    assert holm({}) == {} and holm({"only": 0.049})["only"]["holm"]  # one test: Holm is the test itself


def test_linear_fit_by_hand():
    # (0, 0), (1, 1), (2, 3): Sxx = 2, Sxy = 3, slope 1.5, intercept -1/6, SSE = 1/6, se = sqrt(SSE / 1 / Sxx)
    fit = linear_fit([0, 1, 2], [0, 1, 3])
    se = math.sqrt((1 / 6) / 2)
    assert fit["n"] == 3 and fit["slope"] == pytest.approx(1.5) and fit["intercept"] == pytest.approx(-1 / 6)
    half = math.tan(0.475 * math.pi) * se  # t_{0.975, 1}
    assert (fit["lo"], fit["hi"]) == (pytest.approx(1.5 - half), pytest.approx(1.5 + half))
    assert fit["r"] == pytest.approx(3 / math.sqrt(2 * 42 / 9))
    assert linear_fit([1, 2], [1, 2]) is None and linear_fit([1, 1, 1], [1, 2, 3]) is None


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
