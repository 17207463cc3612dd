"""`benchmarks/bench_blocks.py`: its measurements mean what the README says, and the script runs end to end.

The benchmark's figures depend on the machine and the sampled trees and are never asserted; what is asserted is what
holds on every run: at θ_old every turn's log-ratio and the held-out KL are exactly zero, the signed gap counts a
turn past its teacher as negative, and the JSON has one point per block for every schedule, method and learning rate.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench_blocks(benchmark_script):
    return benchmark_script("bench_blocks")


def test_the_signed_gap_is_positive_short_of_the_teacher_and_negative_past_it(bench_blocks):
    q = torch.tensor([0.75, 0.25, 0.5, 0.7])
    p = torch.tensor([0.60, 0.20, 0.9, 0.5])  # short of q; past q (downward); no direction (q = 1/2); short
    gaps = bench_blocks.target_gaps(torch.logit(p), q)
    assert gaps["directed_turns"] == 3
    assert gaps["gap_mean"] == pytest.approx((0.15 - 0.05 + 0.20) / 3)
    assert gaps["past_fraction"] == pytest.approx(1 / 3)
    assert gaps["abs_s_max"] == pytest.approx(float(torch.logit(torch.tensor(0.9))))
    assert gaps["abs_logit_q_mean"] == pytest.approx(float(torch.logit(q[[0, 1, 3]]).abs().mean()))


def test_the_clip_fraction_counts_only_ratios_past_the_range_in_the_advantages_direction(bench_blocks):
    ratios = torch.tensor([1.3, 1.3, 0.7, 0.7, 1.1])
    A = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])  # clipped: 1.3 with A > 0, 0.7 with A < 0
    inputs = SimpleNamespace(logps=torch.log(ratios), old_logps=torch.zeros(5), turn_ids=torch.arange(5),
                             credit=SimpleNamespace(A=A))
    assert bench_blocks.clip_fraction(inputs, 0.2, 0.2) == pytest.approx(2 / 5)


def test_held_out_kl_is_zero_at_the_reference_and_positive_once_the_policy_moves(bench_blocks):
    from trl_tree.testing import tiny_model_path

    model, _ = bench_blocks.load_model(tiny_model_path())
    ids = list(range(3, 23))
    kl = bench_blocks.HeldOutKL(model, [(ids, [0] * 10 + [1] * 10)], temperature=1.0)
    assert kl(model) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    assert kl(model) > 1e-4


def test_measuring_drift_draws_nothing_and_leaves_the_models_mode(bench_blocks):
    """The learning runs measure their drift between training steps (bench_learning's `heldout_kl`): the measure must
    not change what the run samples next (torch's generator) nor how it trains (the model's train mode)."""
    from trl_tree.testing import tiny_model_path

    model, _ = bench_blocks.load_model(tiny_model_path(), attention_dropout=0.5)
    ids = list(range(3, 23))
    model.train()
    kl = bench_blocks.HeldOutKL(model, [(ids, [0] * 10 + [1] * 10)], temperature=1.0)
    before = torch.get_rng_state()
    assert kl(model) == 0.0  # eval mode: no dropout, so the same forward twice
    assert torch.equal(torch.get_rng_state(), before) and model.training


def test_the_quick_run_writes_every_block_of_every_schedule_method_and_rate_and_reuses_its_runs(tmp_path):
    output = tmp_path / "blocks.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_blocks.py"), "--quick", "--output", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert first.returncode == 0, first.stderr[-4000:]
    result = json.loads(output.read_text())
    blocks = result["config"]["blocks"]
    for schedule in ("revisit", "disjoint"):
        for method in ("treeopsd", "treepo", "clip"):
            points = result["schedules"][schedule]["blocks"][method]["1x"]
            assert [p["block"] for p in points] == list(range(blocks + 1))
            assert points[0]["abs_s_max"] == 0.0 and points[0]["heldout_kl"] == pytest.approx(0.0, abs=1e-6)
            assert all(key in points[-1] for key in ("gap_mean", "past_fraction", "abs_s_mean", "clip_fraction"))
    assert output.with_suffix(".png").is_file()
    # each run file says which machine's rounding made it (docs/design.md, section 7)
    from trl_tree.testing import kernel_fingerprint

    run = json.loads((tmp_path / "blocks.runs" / "disjoint-clip-lr1x.json").read_text())
    assert run["environment"]["kernel_fingerprint"] == kernel_fingerprint()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("done before") == 6  # every run read back, none trained again
    output.unlink()
    (tmp_path / "blocks.runs" / "disjoint-clip-lr1x.json").unlink()
    report = subprocess.run([*command, "--report_only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-4000:]
    assert report.stdout.count("missing") == 1 and output.is_file()
    assert "clip" not in json.loads(output.read_text())["schedules"]["disjoint"]["blocks"]


def test_the_caption_names_the_blocks_of_the_schedules_that_ran_only(bench_blocks):
    args = SimpleNamespace(blocks=8, disjoint_blocks=4)
    assert bench_blocks.schedule_blocks(args, {"disjoint": {}}) == "4 (disjoint)"
    assert bench_blocks.schedule_blocks(args, {"revisit": {}, "disjoint": {}}) == "8 (revisit) or 4 (disjoint)"


def test_the_largest_stable_scale_stops_at_the_first_scale_that_crosses_on_any_seed(bench_blocks):
    kl = {1.0: [0.01, 0.02], 2.0: [0.03, 0.05], 4.0: [0.2, 0.05], 8.0: [0.05, 0.04]}
    assert bench_blocks.largest_stable_scale(kl, 0.1) == 2.0  # 8x is under again, but 4x crossed first
    assert bench_blocks.largest_stable_scale(kl, 1.0) == 8.0
    assert bench_blocks.largest_stable_scale(kl, 0.005) is None


def test_a_scale_counts_toward_the_largest_stable_scale_only_once_every_tree_seed_has_run(bench_blocks):
    by_scale = {1.0: [{"seed": 0, "heldout_kl": 0.01}, {"seed": 1, "heldout_kl": 0.02}],
                2.0: [{"seed": 0, "heldout_kl": 0.03}]}  # seed 1 at 2x not run yet: it could still cross
    kl = bench_blocks.complete_scales(by_scale, [0, 1])
    assert kl == {1.0: [0.01, 0.02]}
    assert bench_blocks.largest_stable_scale(kl, 0.1) == 1.0
    by_scale[2.0].append({"seed": 1, "heldout_kl": 0.05})  # now run, and under
    assert bench_blocks.largest_stable_scale(bench_blocks.complete_scales(by_scale, [0, 1]), 0.1) == 2.0


def test_the_map_reads_back_every_run_file_name_it_writes(bench_blocks):
    for seed, blocks, method, scale in ((0, 4, "treeopsd", 1.0), (12, 8, "treeopsd_no_anchor", 16.0),
                                        (1, 2, "treepo_anchor", 0.5), (3, 16, "clip", 2.5)):
        name = bench_blocks.run_file_name(bench_blocks.map_run_name(seed, blocks), method, scale)
        match = bench_blocks.MAP_RUN_FILE.fullmatch(name)
        assert match and (int(match[1]), int(match[2]), match[3], float(match[4])) == (seed, blocks, method, scale)


def test_settings_added_later_leave_earlier_run_files_matching(bench_blocks):
    args = bench_blocks.parse_args(["--quick"])
    settings = bench_blocks.run_settings(args)
    assert "tree_choice" not in settings and "measure" not in settings and "tree_seeds" not in settings
    args.tree_choice = "sampled"
    assert bench_blocks.run_settings(args)["tree_choice"] == "sampled"


def test_the_ablation_variants_set_the_loss_and_its_zero_credit_anchor(bench_blocks):
    trainer, base = SimpleNamespace(args=None), SimpleNamespace(loss="treeopsd", zero_credit_anchor=None)
    for method, expected in (("treeopsd_no_anchor", ("treeopsd", False)), ("treepo_anchor", ("treepo", True)),
                             ("clip", ("grpo", None))):
        bench_blocks.with_loss(trainer, base, method)
        assert (trainer.args.loss, trainer.args.zero_credit_anchor) == expected
    assert base.loss == "treeopsd" and base.zero_credit_anchor is None  # the trainer's own config is not changed


def test_the_quick_stability_map_writes_every_cell_and_reads_them_back(tmp_path):
    output = tmp_path / "map.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_blocks.py"), "--quick", "--map_blocks", "2,1",
               "--tree_seeds", "0,1", "--tree_choice", "sampled", "--measure", "last",
               "--methods", "treeopsd,treeopsd_no_anchor,treepo_anchor", "--output", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    first = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-4000:]
    result = json.loads(output.read_text())
    for blocks in ("1", "2"):
        for method in ("treeopsd", "treeopsd_no_anchor", "treepo_anchor"):
            points = result["cells"][blocks][method]["1"]
            assert [p["seed"] for p in points] == [0, 1]
            assert all(p["block"] == int(blocks) and "heldout_kl" in p for p in points)
            assert method in result["largest_stable_scale"][blocks]
    assert len(list((tmp_path / "map.runs").glob("seed*-e*-*.json"))) == 12
    assert output.with_suffix(".png").is_file()
    again = subprocess.run([*command, "--report_only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "missing" not in again.stdout
    # a sitting that runs (or reports) one cell rewrites the map's files: they must still hold every stored cell
    part = [*command[:command.index("--map_blocks")], "--map_blocks", "1", "--tree_seeds", "0", "--methods", "treeopsd",
            "--tree_choice", "sampled", "--measure", "last", "--output", str(output), "--report_only"]
    partial = subprocess.run(part, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert partial.returncode == 0, partial.stderr[-4000:]
    assert json.loads(output.read_text())["cells"] == result["cells"]
