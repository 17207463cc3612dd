"""`benchmarks/stats.py`: intervals over runs, paired differences, collapse counts and detectable differences mean
what the benchmarks' README says they mean."""

import json
import math

import pytest


@pytest.fixture
def stats(benchmark_script):
    return benchmark_script("stats")


@pytest.mark.parametrize("p, df, expected", [(0.975, 1, 12.706204736), (0.975, 2, 4.302652730), (0.975, 4, 2.776445105),
                                             (0.8, 2, 1.060660172), (0.975, 30, 2.042272456), (0.5, 3, 0.0)])
def test_t_quantiles_match_the_tables(stats, p, df, expected):
    assert stats.t_quantile(p, df) == pytest.approx(expected, abs=1e-6)
    assert stats.t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-6)


def test_the_t_interval_is_over_runs_and_the_issues_stress_interval_straddles_zero(stats):
    # the three paired stress-setting differences of issue 40: +0.109, +0.531, +0.359 -> about [-0.19, +0.86]
    interval = stats.t_interval([0.109375, 0.53125, 0.359375])
    assert interval.n == 3 and interval.mean == pytest.approx(1 / 3, abs=1e-3)
    assert interval.low == pytest.approx(-0.19, abs=0.01) and interval.high == pytest.approx(0.86, abs=0.01)
    assert interval.low < 0 < interval.high
    # the half-width is t_{0.975, n-1} sd / sqrt(n)
    assert interval.high - interval.mean == pytest.approx(4.302652730 * interval.sd / math.sqrt(3), rel=1e-9)


def test_one_run_has_no_interval(stats):
    interval = stats.t_interval([0.4])
    assert (interval.low, interval.high, interval.sd) == (0.4, 0.4, 0.0)
    assert "no interval" in interval.text()


def test_paired_differences_use_only_common_seeds(stats):
    assert stats.paired_differences({0: 0.1, 1: 0.2, 2: 0.3}, {1: 0.5, 2: 0.1, 3: 0.9}) == pytest.approx(
        {1: 0.3, 2: -0.2})


def test_the_detectable_difference_shrinks_as_one_over_root_n_and_is_larger_unpaired(stats):
    sd = 0.05
    d3, d12 = stats.detectable_difference(sd, 3), stats.detectable_difference(sd, 12)
    assert d12 < d3
    # large n: the normal approximation (z_{0.975} + z_{0.8}) sd / sqrt(n) = 2.8016 sd / sqrt(n)
    assert stats.detectable_difference(sd, 2000) == pytest.approx(2.8016 * sd / math.sqrt(2000), rel=2e-3)
    assert stats.detectable_difference(sd, 5, paired=False) > stats.detectable_difference(sd, 5)
    assert stats.detectable_difference(sd, 1) == math.inf
    n = stats.runs_needed(sd, 0.04)
    assert stats.detectable_difference(sd, n) <= 0.04 < stats.detectable_difference(sd, n - 1)


def test_a_run_collapses_when_its_answers_lose_their_form_or_almost_all_fail(stats):
    assert stats.collapsed({"format_rate": 0.0, "exact_match": 0.0})
    assert stats.collapsed({"format_rate": 0.98, "exact_match": 0.0})
    assert stats.collapsed({"format_rate": 0.3, "exact_match": 0.2})
    assert not stats.collapsed({"format_rate": 1.0, "exact_match": 0.117})


def test_the_table_report_reads_run_files(stats, tmp_path):
    def run(method, seed, em, fmt):
        point = {"exact_match": em, "format_rate": fmt}
        (tmp_path / f"{method}-seed{seed}.json").write_text(json.dumps(
            {"method": method, "seed": seed, "heldout_before": 0.344, "curve": [{"exact_match": 0.344}, point]}))

    for seed, (a, b) in enumerate([(0.008, 0.117), (0.0, 0.531), (0.0, 0.359)]):
        run("treepo", seed, a, 0.0)
        run("treeopsd", seed, b, 1.0)
    report = stats.table_report(tmp_path)
    assert report["methods"]["treepo"]["collapsed_count"] == 3
    assert report["methods"]["treeopsd"]["collapsed_count"] == 0
    # every TreePO run ended below its warm start (0.344); of TreeOPSD's only the one that lost answers, not its form
    assert report["methods"]["treepo"]["below_start_count"] == 3
    assert report["methods"]["treeopsd"]["below_start_count"] == 1
    pair = report["pairs"]["treeopsd - treepo"]
    assert list(pair["differences"]) == [0, 1, 2]
    assert pair["interval"]["mean"] == pytest.approx((0.109 + 0.531 + 0.359) / 3, abs=1e-3)
    # the pair carries its collapse counts in the label's order and Fisher's p of them, over the same seeds
    assert pair["collapsed_counts"] == [0, 3]
    assert pair["collapse_p"] == pytest.approx(stats.collapse_count_p_value(0, 3, 3, 3))
    assert "3 of 3" in stats.markdown({"stress": report})


def test_identical_values_give_no_interval_and_no_detectable_difference(stats):
    assert "identical" in stats.t_interval([0.2, 0.2]).text()
    run = {"method": "m", "seed": 0, "heldout_before": 0.3}
    a = {s: {**run, "seed": s, "curve": [{"exact_match": 0.4, "format_rate": 1.0}]} for s in (0, 1)}
    b = {s: {**run, "seed": s, "curve": [{"exact_match": 0.5, "format_rate": 1.0}]} for s in (0, 1)}
    pair = stats.comparison(a, b)
    assert pair["differences"] == pytest.approx({0: 0.1, 1: 0.1}) and pair["detectable_difference"] is None


def test_fisher_exact_of_collapse_counts(stats):
    assert stats.collapse_count_p_value(3, 3, 0, 3) == pytest.approx(0.1)  # 2 / C(6, 3)
    assert stats.collapse_count_p_value(0, 3, 0, 3) == pytest.approx(1.0)
    assert stats.collapse_count_p_value(5, 5, 0, 5) == pytest.approx(2 / 252)
    # [[3, 1], [1, 5]]: the tables with its margins as or less likely than it: 15/210 + 24/210 + 1/210 (as scipy.stats.fisher_exact)
    assert stats.collapse_count_p_value(3, 4, 1, 6) == pytest.approx(40 / 210)


def test_best_against_best_picks_each_methods_best_screened_scale_and_pairs_the_bests(stats, tmp_path):
    """A method's best scale is the highest mean EM on the screen seeds among the scales that ran all of them (a
    tie goes to the lower rate); the bests are paired over their common seeds, and for the confirmation over those
    outside the screen; efficiency is the gain per token and per training CPU hour."""
    tables = {1: "one", 2: "two", 4: "four"}

    def run(scale, method, seed, em, cpu_seconds=1800.0):
        folder = tmp_path / stats.TABLES[tables[scale]]
        folder.mkdir(exist_ok=True)
        (folder / f"{method}-seed{seed}.json").write_text(json.dumps(
            {"method": method, "seed": seed, "heldout_before": 0.25, "rollout_tokens": 20_000,
             "curve": [{"exact_match": 0.25}, {"exact_match": em, "format_rate": 1.0,
                                               "train_cpu_seconds": cpu_seconds}]}))

    stats.TABLES.update({name: f"{name}.runs" for name in tables.values()})
    try:
        for seed, em in enumerate([0.35, 0.45]):
            run(1, "treeopsd", seed, em)
            run(2, "treeopsd", seed, em)  # the same mean as 1x: the tie goes to the lower rate
            run(1, "treepo", seed, em - 0.05)
        run(4, "treeopsd", 0, 0.9)  # the best single run, but seed 1 is missing: not eligible
        run(2, "treepo", 0, 0.9)
        run(2, "treepo", 1, 0.0)  # mean 0.45 > 0.35: the best, collapsed run and all
        run(1, "treeopsd", 2, 0.5)  # seed 2, outside the screen: the only seed the confirmation pairs
        run(2, "treepo", 2, 0.3)
        run(2, "treeopsd", 2, 0.9)  # would make 2x treeopsd's best if the screen looked past seeds 0 and 1
        report = stats.best_against_best(tmp_path, scales=tables)
    finally:
        for name in tables.values():
            del stats.TABLES[name]
    assert report["best_scale"] == {"treeopsd": 1, "treepo": 2}
    pair = report["pairs"]["treeopsd@1x - treepo@2x"]
    assert pair["differences"] == {0: pytest.approx(0.35 - 0.9), 1: pytest.approx(0.45), 2: pytest.approx(0.2)}
    assert report["confirmation"]["treeopsd@1x - treepo@2x"]["differences"] == {2: pytest.approx(0.2)}
    cell = report["grid"]["treepo"][1]
    assert cell["gain_per_10k_tokens"] == pytest.approx(0.10 / 2)  # mean gain 0.10 over 20k tokens
    assert cell["gain_per_cpu_hour"] == pytest.approx(0.2)  # 0.10 in half a CPU hour
    assert "**best**" in stats.best_markdown(report)
    assert cell["per_seed"][0] == {"rollout_tokens": 20_000, "train_cpu_minutes": pytest.approx(30.0)}


def test_the_best_against_best_figure_draws_every_best_and_the_confirmation(stats, tmp_path):
    pytest.importorskip("matplotlib")
    cell = {"seeds": [0, 1], "exact_match": {0: 0.4, 1: 0.5}, "gain": {0: 0.06, 1: 0.16}, "collapsed_count": 0,
            "em_interval": dict(n=2, mean=0.45, sd=0.07, low=-0.19, high=1.09, confidence=0.95),
            "per_seed": {0: {"rollout_tokens": 2e4, "train_cpu_minutes": 20.0},
                         1: {"rollout_tokens": 2.2e4, "train_cpu_minutes": None}}}  # a run that predates CPU time
    pair = {"differences": {2: 0.01, 3: -0.03}, "detectable_difference": 0.3, "equivalence_p": 0.4,
            "interval": dict(n=2, mean=-0.01, sd=0.03, low=-0.26, high=0.24, confidence=0.95)}
    one_seed = {**pair, "differences": {2: 0.01}, "detectable_difference": None, "equivalence_p": None}
    report = {"screen_seeds": [0, 1], "best_scale": {"treeopsd": 4, "treepo": 1},
              "grid": {"treeopsd": {4: cell}, "treepo": {1: cell}},
              "confirmation": {"treeopsd@4x - treepo@1x": pair, "treeopsd@4x - grpo@2x": one_seed}}
    path = tmp_path / "best.png"
    assert stats.best_figure(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stats._pair_label("treeopsd@4x - treepo@1x") == "TreeOPSD 4× − TreePO 1×"


def test_the_sign_flip_test_counts_sign_assignments_at_least_as_extreme(stats):
    # all n differences of one sign: only that assignment and its mirror reach the observed |sum|
    assert stats.sign_flip_p_value([0.1, 0.2, 0.05, 0.3]) == pytest.approx(2 / 16)
    assert stats.sign_flip_p_value([0.1, -0.1]) == 1.0  # a sum of 0 is reached by every assignment
    # {+3, +1, −1}: sum 3; |±3 ± 1 ± 1| >= 3 for 6 of the 8 assignments, all but the two where both 1s oppose the 3
    assert stats.sign_flip_p_value([3, 1, -1]) == pytest.approx(6 / 8)
    # beyond the exact range the sampled p-value agrees with the exact one to sampling error
    many = [0.1, -0.08, 0.05, -0.11, 0.02, 0.13, -0.04, 0.06, -0.01, 0.09, -0.02, 0.01, 0.04, -0.05]
    exact = stats.sign_flip_p_value(many)
    assert 0.3 < exact < 0.7  # a p-value the sampling could miss by much, were it wrong
    assert stats.sign_flip_p_value(many, exact_up_to=10, draws=20000) == pytest.approx(exact, abs=0.02)


def test_tost_says_equivalent_exactly_when_the_90_percent_interval_lies_inside_the_margin(stats):
    for values in ([0.01, -0.02, 0.03, 0.0, 0.015], [0.05, 0.02, 0.06, 0.03], [0.1, -0.1, 0.11, -0.09, 0.0, 0.02]):
        interval = stats.t_interval(values, confidence=0.90)
        for margin in (0.02, 0.04, 0.08, 0.2):
            inside = -margin < interval.low and interval.high < margin
            assert (stats.equivalence_p_value(values, margin) < 0.05) == inside
    assert stats.equivalence_p_value([0.3], 0.04) is None and stats.equivalence_p_value([0.1, 0.1], 0.04) is None


def test_the_looks_replay_the_design_seed_by_seed_and_end_at_the_whole_comparison(stats):
    diffs = {7: 0.1, 2: -0.02, 3: 0.01, 5: 0.03, 4: -0.05}
    looks = stats.looks(diffs)
    assert [k["seeds"] for k in looks] == [3, 4, 5] and [k["last_seed"] for k in looks] == [4, 5, 7]  # seed order
    whole = stats.t_interval(list(diffs.values()))
    assert (looks[-1]["mean"], looks[-1]["sd"], looks[-1]["low"]) == pytest.approx((whole.mean, whole.sd, whole.low))
    assert looks[-1]["equivalence_p"] == pytest.approx(stats.equivalence_p_value(list(diffs.values()), 0.04))
    for k in looks:  # the runs a look asks for detect the margin, one fewer does not
        n = k["runs_needed_for_margin"]
        assert stats.detectable_difference(k["sd"], n) <= stats.EQUIVALENCE_MARGIN
        assert stats.detectable_difference(k["sd"], n - 1) > stats.EQUIVALENCE_MARGIN
