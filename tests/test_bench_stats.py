"""`benchmarks/stats.py`: intervals over runs, paired differences, collapse counts and detectable differences mean
what the benchmarks' README says they mean."""

import json
import math
import shutil
from pathlib import Path

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
    assert cell["per_seed"][0] == {"rollout_tokens": 20_000, "train_cpu_minutes": pytest.approx(30.0),
                                   "train_wall_minutes": None}  # the test runs store no wall time


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


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_no_committed_result_file_names_a_path_of_the_machine_that_wrote_it():
    found = {str(path.relative_to(RESULTS)): s for path in sorted(RESULTS.rglob("*.json"))
             for s in _strings(json.loads(path.read_text())) if s.startswith("/") and not any(c.isspace() for c in s)}
    assert not found, f"absolute paths in committed results (common.portable makes them portable): {found}"


def test_paths_are_stored_relative_to_the_checkout_or_the_cache_or_by_name(benchmark_script, tmp_path, monkeypatch):
    common = benchmark_script("common")
    monkeypatch.setenv("TRL_TREE_CACHE", str(tmp_path / "cache"))
    root = common.REPO_ROOT
    assert common.portable_path(str(root / "benchmarks/results/x.runs")) == "benchmarks/results/x.runs"
    assert common.portable_path(str(tmp_path / "cache/benchmarks/warm-a")) == "$TRL_TREE_CACHE/benchmarks/warm-a"
    # written on other machines: another checkout's results, the default cache of another home
    assert common.portable_path("/srv/co/benchmarks/results/t.runs/a.json") == "benchmarks/results/t.runs/a.json"
    assert common.portable_path("/home/u/.cache/trl_tree/benchmarks/warm-b") == "$TRL_TREE_CACHE/benchmarks/warm-b"
    assert common.portable_path("/tmp/g/grpo2x.json") == "grpo2x.json"  # a sitting's scratch output: its name
    assert common.portable_path("relative/x.json") == "relative/x.json"
    assert common.portable_path("/ not a path") == "/ not a path"
    # write_json stores them so, in nested values too; a warm start keeps the folder name that identifies it
    common.write_json(tmp_path / "r.json", {"config": {"model_path": str(tmp_path / "cache/benchmarks/warm-c"),
                                                        "seeds": [0, 1]}, "runs": [{"output": "/tmp/o.json"}]})
    stored = json.loads((tmp_path / "r.json").read_text())
    assert stored == {"config": {"model_path": "$TRL_TREE_CACHE/benchmarks/warm-c", "seeds": [0, 1]},
                      "runs": [{"output": "o.json"}]}


def test_stats_rebuilds_the_committed_report_from_the_run_files_alone(stats, tmp_path):
    """Only the run folders are copied, into a folder elsewhere: the report built there is the committed one,
    number for number (so results/stats.{json,md} are current and need nothing but the run files)."""
    # the learning tables' runs, the map's cells and the staleness arms' runs
    for folder in [*stats.TABLES.values(), stats.MAP_RUNS, *(p.name for p in stats.staleness_tables(RESULTS).values())]:
        if (RESULTS / folder).is_dir():
            shutil.copytree(RESULTS / folder, tmp_path / folder)
    stats.main(["--results", str(tmp_path), "--output", str(tmp_path / "stats.json")])
    assert json.loads((tmp_path / "stats.json").read_text()) == json.loads((RESULTS / "stats.json").read_text())
    assert (tmp_path / "stats.md").read_text() == (RESULTS / "stats.md").read_text()


def test_mcnemar_counts_each_seed_once_and_only_the_discordant_ones(stats):
    # the 10x stress table: TreePO collapsed on all 5 seeds, TreeOPSD on none; paired, that is 5 discordant seeds
    assert stats.mcnemar_p_value(5, 0) == pytest.approx(2 / 32) == stats.mcnemar_p_value(0, 5)
    assert stats.collapse_count_p_value(5, 5, 0, 5) == pytest.approx(0.0079, abs=1e-4)  # Fisher, unpaired: smaller
    assert stats.mcnemar_p_value(0, 0) == 1.0  # every seed concordant: no evidence either way
    assert stats.mcnemar_p_value(3, 1) == pytest.approx(2 * (1 + 4) / 16)  # P(split at least as uneven), two-sided


def test_a_pair_reports_the_paired_collapse_test_beside_fishers(stats, tmp_path):
    def run(method, seed, em):
        (tmp_path / f"{method}-seed{seed}.json").write_text(json.dumps(
            {"method": method, "seed": seed, "heldout_before": 0.344,
             "curve": [{"exact_match": 0.344}, {"exact_match": em, "format_rate": 1.0 if em > 0.05 else 0.0}]}))

    # seeds 0-2: a collapsed where b did not; seed 3: both collapsed (concordant, not counted by McNemar)
    for seed, (a, b) in enumerate([(0.0, 0.5), (0.0, 0.4), (0.0, 0.45), (0.0, 0.0)]):
        run("treepo", seed, a)
        run("treeopsd", seed, b)
    pair = stats.table_report(tmp_path)["pairs"]["treeopsd - treepo"]
    assert pair["collapsed_counts"] == [1, 4]
    assert pair["collapse_mcnemar_p"] == pytest.approx(stats.mcnemar_p_value(0, 3)) == pytest.approx(0.25)
    text = stats.pairs_markdown({"t": {"pairs": {"treeopsd - treepo": pair}}})
    assert "exact McNemar p, two-sided, paired" in text and "Fisher's exact p, two-sided, unpaired" in text
    assert "| 1 / 4 | 0.25 | 0.143 |" in text  # the counts, then McNemar (paired) before Fisher (unpaired)


def test_training_wall_time_leaves_out_the_evaluations(stats):
    run = {"train_seconds": 1000.0, "heldout_before": 0.3, "rollout_tokens": 10_000, "curve": [
        {"eval_seconds": 100.0, "exact_match": 0.3, "train_cpu_seconds": 0.0},
        {"eval_seconds": 140.0, "exact_match": 0.4, "train_cpu_seconds": 1800.0}]}
    assert stats.train_wall_seconds(run) == 760.0
    assert stats.train_wall_seconds({"train_seconds": 5.0, "curve": [{}]}) is None  # an older run file: not known
    cell = stats.efficiency({0: run})
    assert cell["train_wall_minutes"] == pytest.approx(760 / 60)
    assert cell["gain_per_wall_hour"] == pytest.approx(0.1 / (760 / 3600))
    assert cell["gain_per_cpu_hour"] == pytest.approx(0.1 / 0.5)


def test_the_safe_range_sets_the_maps_kl_beside_what_the_learning_runs_did(stats, tmp_path, monkeypatch):
    """Issue 58: a cell (method, scale at E = 4) holds when none of its runs on the stress seeds collapsed, learns when
    its gain's interval is above 0 too; the map's proxy agrees when KL under 0.1 on every tree seed == holds. Seeds
    outside 0-4 and scales the map did not measure are left out."""
    monkeypatch.setitem(stats.TABLES, "lo", "lo.runs")
    monkeypatch.setitem(stats.TABLES, "hi", "hi.runs")

    def run(table, method, seed, em, fmt=1.0):
        folder = tmp_path / f"{table}.runs"
        folder.mkdir(exist_ok=True)
        (folder / f"{method}-seed{seed}.json").write_text(json.dumps(
            {"method": method, "seed": seed, "heldout_before": 0.3, "rollout_tokens": 10_000,
             "curve": [{"exact_match": 0.3}, {"exact_match": em, "format_rate": fmt}]}))

    def cell(method, scale, kls, blocks=4):
        (tmp_path / stats.MAP_RUNS).mkdir(exist_ok=True)
        for seed, kl in enumerate(kls):
            (tmp_path / stats.MAP_RUNS / f"seed{seed}-e{blocks}-{method}-lr{scale}x.json").write_text(json.dumps(
                {"settings": {}, "points": [{"heldout_kl": 9.0}, {"heldout_kl": kl}]}))

    for seed, (lo, hi) in enumerate([(0.40, 0.0), (0.42, 0.01), (0.38, 0.5), (0.41, 0.0), (0.39, 0.02)]):
        run("lo", "treepo", seed, lo)
        run("hi", "treepo", seed, hi, fmt=0.0 if hi < 0.05 else 1.0)
    run("lo", "treepo", 7, 0.0, fmt=0.0)  # a confirmation seed: not one of the cell's seeds
    cell("treepo", 1, [0.01, 0.02])
    cell("treepo", 8, [0.05, 0.09])  # the proxy says it holds; the runs collapsed: disagreement
    cell("treepo", 8, [5.0], blocks=8)  # another E: not read
    assert stats.map_heldout_kl(tmp_path) == {"treepo": {1: [0.01, 0.02], 8: [0.05, 0.09]}}
    best = stats.best_against_best(tmp_path, scales={1: "lo", 8: "hi"})
    rows = {r["scale"]: r for r in stats.safe_range(tmp_path, best)}
    assert rows[1]["seeds"] == [0, 1, 2, 3, 4] and rows[1]["collapsed"] == 0
    assert rows[1]["holds"] and rows[1]["learns"] and rows[1]["proxy_agrees"]
    assert rows[8]["collapsed"] == 4 and rows[8]["below_start"] == 4 and rows[8]["map_holds"]
    assert not rows[8]["holds"] and not rows[8]["learns"] and not rows[8]["proxy_agrees"]
    assert "**no**" in stats.safe_range_markdown(list(rows.values()))


def _stale_run(folder: Path, method: str, seed: int, em128: int, staleness: int = 0, drift: float | None = None,
               **config):
    """A run file of `method` and `seed` with final EM em128/128 (exact in binary: paired differences are exact)
    and, if given, its final drift (`heldout_kl`)."""
    folder.mkdir(exist_ok=True)
    final = {"exact_match": em128 / 128, "format_rate": 1.0, **({} if drift is None else {"heldout_kl": drift})}
    run = {"method": method, "seed": seed, "heldout_before": 44 / 128, "rollout_tokens": 23_000,
           "config": {"max_staleness": staleness, "blocks": 4, "warm_start_sha256": "a" * 16, **config},
           "curve": [{"exact_match": 44 / 128}, final]}
    if staleness:
        run["async"] = {"staleness_mean": 2 / 3, "trainer_wait_seconds": 60.0}
    (folder / f"{method}-seed{seed}.json").write_text(json.dumps(run))


def test_staleness_costs_pair_each_seed_with_the_synchronous_run_of_its_rate(stats, tmp_path, monkeypatch):
    """analysis_plan.md F: per cell d_m(S) = EM(S) − EM(0) per seed, against the synchronous table of the same scale,
    with its paired t-interval and the exact two-sided sign-flip p over the 2^5 sign assignments; the interaction
    d_TreeOPSD(1) − d_TreePO(1) on their common seeds is the plan's primary test; a cell short of the plan's five
    seeds is labelled incomplete, seeds outside them are left out, and none of it before a staleness run exists."""
    scales = {1: "sync_lo", 4: "sync_hi"}
    for name in scales.values():
        monkeypatch.setitem(stats.TABLES, name, f"{name}.runs")
    empty = stats.staleness_report(tmp_path, scales)
    assert empty["cells"] == [] and "no runs yet" in stats.staleness_markdown(empty)

    stale_lo, stale_hi = (tmp_path / "smollm2_learning_e4_lr2e-4_s1.runs", tmp_path / "smollm2_learning_e4_lr8e-4_s1.runs")
    d_treeopsd, interaction = [0, -1, -2, 0, -1], [9, 3, -1, 5, 2]  # in 128ths
    for seed, (opsd, po) in enumerate(zip([64, 66, 60, 70, 62], [56, 52, 58, 54, 50])):
        _stale_run(tmp_path / "sync_hi.runs", "treeopsd", seed, opsd)
        _stale_run(stale_hi, "treeopsd", seed, opsd + d_treeopsd[seed], staleness=1, drift=0.01 * (seed + 1))
        _stale_run(tmp_path / "sync_lo.runs", "treepo", seed, po)
        _stale_run(stale_lo, "treepo", seed, po + d_treeopsd[seed] - interaction[seed], staleness=1)
    _stale_run(stale_hi, "treeopsd", 7, 0, staleness=1)  # not one of the plan's seeds: left out
    for seed in (0, 1, 2):  # S = 2 for TreeOPSD, three of its five seeds so far
        _stale_run(tmp_path / "smollm2_learning_e4_lr8e-4_s2.runs", "treeopsd", seed, 60, staleness=2)
    _stale_run(stale_hi, "flat_grpo", 0, 60, staleness=1)  # no synchronous flat_grpo at 4x: nothing to pair

    report = stats.staleness_report(tmp_path, scales)
    cells = {(c["method"], c["scale"], c["max_staleness"]): c for c in report["cells"]}
    assert set(cells) == {("treepo", 1, 1), ("treeopsd", 4, 1), ("treeopsd", 4, 2), ("flat_grpo", 4, 1)}
    treepo = cells["treepo", 1, 1]["cost"]
    assert treepo["differences"] == {s: (d - i) / 128 for s, (d, i) in enumerate(zip(d_treeopsd, interaction))}
    assert treepo["interval"]["mean"] == pytest.approx(-22 / 5 / 128)
    assert treepo["sign_flip_p"] == 2 / 32  # five losses of one sign: only it and its mirror reach |sum|
    assert cells["treeopsd", 4, 1]["seeds"] == [0, 1, 2, 3, 4] and cells["treeopsd", 4, 1]["complete"]
    # |0 ± 1 ± 2 ± 0 ± 1| reaches 4 in 2 of the 8 signs of the non-zero differences, whatever the zeros' signs
    assert cells["treeopsd", 4, 1]["cost"]["sign_flip_p"] == 8 / 32
    assert not cells["treeopsd", 4, 2]["complete"] and cells["treeopsd", 4, 2]["paired_seeds"] == [0, 1, 2]
    assert cells["flat_grpo", 4, 1]["cost"] is None
    assert cells["treeopsd", 4, 1]["staleness_mean"] == pytest.approx(2 / 3)
    # drift: the stale arm's mean final KL to the warm start; none for an arm whose runs did not measure it
    assert cells["treeopsd", 4, 1]["drift"] == pytest.approx(0.03) and cells["treeopsd", 4, 1]["synchronous_drift"] is None
    assert cells["treepo", 1, 1]["drift"] is None
    assert cells["treeopsd", 4, 1]["shared_build_seeds"] == [0, 1, 2, 3, 4]

    primary = report["interactions"]["treeopsd@4x - treepo@1x at S=1"]
    assert primary["primary"] and primary["complete"]
    assert primary["differences"] == {s: v / 128 for s, v in enumerate(interaction)}
    # |±9 ± 3 ± 1 ± 5 ± 2| >= 18 only with all of 9, 3, 5, 2 on one side: 4 of the 32 assignments
    assert primary["sign_flip_p"] == 4 / 32
    assert primary["interval"]["mean"] == pytest.approx(18 / 5 / 128)
    assert set(report["interactions"]) == {"treeopsd@4x - treepo@1x at S=1"}  # one pair per S with both paired
    text = stats.staleness_markdown(report)
    assert "| treeopsd@4x - treepo@1x at S=1 | primary |" in text and "3 of 5, incomplete" in text
    assert "no synchronous run on these seeds" in text
    assert "| 0.03 / — |" in text  # drift, S / 0

    # both arms in one setting: a stale run trained otherwise than its synchronous pair is refused, naming the field
    _stale_run(stale_lo, "treepo", 4, 50, staleness=1, blocks=2)
    with pytest.raises(ValueError, match=r"treepo-seed4: .*\(blocks: 4 synchronous, 2 stale\)"):
        stats.staleness_report(tmp_path, scales)


def test_a_table_never_counts_a_run_of_another_staleness(stats, tmp_path):
    """The synchronous tables are read at max_staleness 0 and a staleness arm at its own S: a run of another S in
    the folder is an error naming it, never a run of the comparison."""
    _stale_run(tmp_path / "t.runs", "treeopsd", 0, 60)
    _stale_run(tmp_path / "t.runs", "treepo", 0, 60, staleness=1)
    with pytest.raises(ValueError, match=r"t.runs/treepo-seed0.json was trained at max_staleness 1, in a table read "
                                         r"as max_staleness 0"):
        stats.table_report(tmp_path / "t.runs")
    legacy = tmp_path / "old.runs"
    legacy.mkdir()
    (legacy / "treeopsd-seed0.json").write_text(json.dumps({"method": "treeopsd", "seed": 0, "curve": []}))
    assert set(stats.load_runs(legacy)) == {"treeopsd"}  # a run file from before --max_staleness: synchronous
    with pytest.raises(ValueError, match="trained at max_staleness 0, in a table read as max_staleness 1"):
        stats.load_runs(legacy, max_staleness=1)
