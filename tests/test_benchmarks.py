"""The benchmarks still run, and the packing paths they rely on are exact.

Each benchmark runs once with its tiny settings, as a subprocess (exactly as a reader would run it), and must write
JSON with the keys its README and readers use. The figures themselves depend on the machine and are never asserted.
The last tests cover the two packing fixes the benchmarks motivated: the flex_attention `BlockMask` is built from the
DFS intervals (never the [T, T] mask) with exactly the blocks `create_block_mask` finds, and path rows are forwarded
without a custom mask, so the "paths" layout runs on kernels that only do causal attention.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.trees import PAD, branching_tree, tiny_model
from trl_tree.core.packing import _padding_sees_itself, block_mask, pack_trees, packed_token_logps

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str, tmp_path: Path) -> dict:
    output = tmp_path / f"{Path(script).stem}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    process = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert process.returncode == 0, f"{script} failed:\n{process.stdout[-4000:]}\n{process.stderr[-4000:]}"
    return json.loads(output.read_text())


def dotted(result: dict, key: str):
    value = result
    for part in key.split("."):
        value = value[part]
    return value


def test_bench_step_quick_writes_the_keys_of_the_issue(tmp_path):
    result = run_benchmark("bench_step.py", "--quick", tmp_path=tmp_path)
    for key in ("grpo.step_seconds", "treeopsd_tree.step_seconds", "treeopsd_paths.step_seconds",
                "treeopsd_tree.forward_tokens", "treeopsd_tree.unique_tokens", "grpo.generated_tokens_per_leaf",
                "treeopsd_tree.generated_tokens_per_leaf", "grpo.peak_memory_mib", "treeopsd_tree.generation_seconds",
                "treeopsd_tree.training_seconds", "treeopsd_paths.forward_tokens",
                "treeopsd_tree.sampling_seconds_per_1k_generated", "flat_grpo.sampling_seconds_per_1k_generated"):
        assert isinstance(dotted(result, key), (int, float)), key
    assert "treeopsd_tree.forward_tokens / treeopsd_tree.unique_tokens" in result["ratios"]
    for value in result["ratios"].values():  # one repeat: its ratio is the run's
        assert value["per_repeat"] == [pytest.approx(value["value"])]
    assert all(len(result[v]["per_batch"]) == 1 for v in ("grpo", "treeopsd_tree", "treeopsd_paths", "flat_grpo"))


def test_bench_step_chunked_variants_sample_in_chunks(tmp_path):
    result = run_benchmark("bench_step.py", "--quick", "--variants", "treeopsd_chunked,flat_chunked",
                           "--generation_chunk_tokens", "4", tmp_path=tmp_path)
    for variant in ("treeopsd_chunked", "flat_chunked"):
        assert isinstance(result[variant]["sampling_cpu_seconds_per_1k_generated"], float)
    # a turn longer than 4 tokens needs several calls; whole turns would take at most max_turns per batch
    assert result["treeopsd_chunked"]["generate_calls"] > result["config"]["max_turns"]
    key = "treeopsd_chunked.sampling_cpu_seconds_per_1k_generated / flat_chunked.sampling_cpu_seconds_per_1k_generated"
    assert key in result["ratios"]


def test_bench_generation_quick_compares_whole_turns_with_chunks(tmp_path):
    result = run_benchmark("bench_generation.py", "--quick", tmp_path=tmp_path)
    variants = {row["variant"]: row for row in result["variants"]}
    assert set(variants) == {"whole turns", "chunks of 4"}
    for row in variants.values():
        for key in ("cpu_seconds", "cpu_vs_whole_turns", "row_steps_per_generated", "same_answers"):
            assert isinstance(row[key], float), key
    assert variants["chunks of 4"]["calls"] > variants["whole turns"]["calls"]


def test_bench_memory_quick_reports_each_tree_size_and_a_capped_rerun_with_the_same_tokens(tmp_path):
    result = run_benchmark("bench_memory.py", "--quick", tmp_path=tmp_path)
    *uncapped, capped = result["rows"]
    assert [(row["M"], row["N"]) for row in uncapped] == [(2, 1), (4, 1)]
    for row in result["rows"]:
        for key in ("store_peak_bytes", "call_peak_bytes", "prefilled_tokens", "sampling_python_peak_bytes",
                    "packed_bytes", "saved_for_backward_bytes", "saved_in_attention_bytes", "step_rss_mib"):
            assert isinstance(row[key], (int, float)), key
        # the store holds each distinct root-to-leaf history once (less the last sampled token of each), no more
        assert row["store_peak_tokens"] <= row["path_tokens"]
    assert capped["cap_bytes"] is not None and capped["store_peak_bytes"] <= capped["cap_bytes"]
    assert capped["same_tokens_as_uncapped"] is True


@pytest.mark.parametrize("task", ["search", "calculator"])
def test_bench_learning_quick_writes_curves_and_a_summary_per_method(tmp_path, task):
    result = run_benchmark("bench_learning.py", "--quick", "--task", task, "--plot", str(tmp_path / "plot.png"),
                           tmp_path=tmp_path)
    assert set(result["summary"]) == set(result["runs"]) == {"grpo", "treepo", "treeopsd"}
    for method, seeds in result["runs"].items():
        assert len(seeds) == 1
        curve = seeds[0]["curve"]
        assert [p["generation_batches"] for p in curve] == [0, 1], method
        assert {"exact_match", "f1", "format_rate", "reward", "rollout_tokens"} <= set(curve[-1])
        for key in ("final_exact_match_mean", "final_exact_match_std", "final_reward_mean", "rollout_tokens_mean"):
            assert isinstance(result["summary"][method][key], float)
        assert len(curve[-1]["per_question"]["exact_match"]) == len(curve[-1]["per_question"]["reward"]) == 2
        assert curve[-1]["train_cpu_seconds"] >= curve[0]["train_cpu_seconds"] >= 0
        if task == "search":  # drift from the warm start (the run's first point), on scripted held-out trajectories
            assert curve[0]["heldout_kl"] == 0.0 and curve[-1]["heldout_kl"] >= 0.0
        else:  # the calculator has no scripted search to teacher-force
            assert "heldout_kl" not in curve[-1]
    assert set(result["paired_differences"]) == {"treeopsd - treepo", "treeopsd - grpo", "treepo - grpo"}


def test_bench_learning_flat_grpo_samples_g_independent_trajectories_on_trl_trees_loop(tmp_path):
    """Issue 58's control: GRPO at the trees' implementation. Each prompt gets G whole trajectories, no branching (a
    leaf per trajectory, every trajectory's tokens its own), and the report pairs it with TRL's GRPO by seed."""
    result = run_benchmark("bench_learning.py", "--quick", "--methods", "flat_grpo,grpo", tmp_path=tmp_path)
    (run,) = result["runs"]["flat_grpo"]
    (batch,) = run["batches"]
    assert batch["leaves"] == 2 * 8  # --quick: 2 prompts, G = 8
    assert batch["leaf_action_tokens"] == batch["generated_tokens"]  # nothing shared: no tree
    assert run["rollout_tokens"] == batch["generated_tokens"]
    assert set(result["paired_differences"]) == {"flat_grpo - grpo"}


def test_bench_learning_keeps_each_tree_runs_pages_with_tree_view(tmp_path):
    """`--tree_view DIR`: the runs train in a temporary folder; their rollout-tree pages are kept, one folder a run."""
    run_benchmark("bench_learning.py", "--quick", "--methods", "grpo,treeopsd", "--tree_view", str(tmp_path / "view"),
                  tmp_path=tmp_path)
    assert (tmp_path / "view" / "treeopsd-seed0" / "index.html").is_file()
    assert list((tmp_path / "view" / "treeopsd-seed0").glob("step_*.html"))
    assert not (tmp_path / "view" / "grpo-seed0").exists()  # GRPOTrainer writes no tree pages


def test_bench_learning_num_eval_evaluates_the_first_questions_of_the_same_world(tmp_path):
    """`--num_eval N` (the quick SmolLM2 demo): fewer held-out questions, the same corpus and cached warm start."""
    result = run_benchmark("bench_learning.py", "--quick", "--methods", "treeopsd", "--num_eval", "1",
                           tmp_path=tmp_path)
    curve = result["runs"]["treeopsd"][0]["curve"]
    assert len(curve[-1]["per_question"]["exact_match"]) == 1  # --quick's 2 held-out questions, the first only
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--quick", "--num_eval",
                              "3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "--num_eval 3: choose 1 to 2" in refused.stderr


def test_bench_scaling_quick_sweeps_every_axis_with_exact_counts(tmp_path):
    """`bench_scaling.py --quick`: two points on each axis, tree and flat at each, exponents, summary and plot. Its
    policy is scripted (every turn `action_tokens` long, turns - 1 tool calls, fixed-length observations), so the
    token counts are exact and these invariants hold at every point, whatever the machine; no timing is checked."""
    plot = tmp_path / "scaling.png"
    result = run_benchmark("bench_scaling.py", "--quick", "--plot", str(plot), tmp_path=tmp_path)
    assert plot.is_file() and plot.stat().st_size > 0
    assert set(result["sweeps"]) == {"leaves", "turns", "observation_tokens", "prompts"}
    assert result["summary"] and all(isinstance(line, str) for line in result["summary"])
    action = result["config"]["action_tokens"]
    for axis, sweep in result["sweeps"].items():
        assert len(sweep["points"]) == 2, axis
        assert sweep["points"][0]["x"] < sweep["points"][1]["x"], axis
        for variant in ("tree", "flat"):
            assert set(sweep["exponents"][variant]) >= {"generation_cpu_seconds", "training_cpu_seconds",
                                                         "step_cpu_seconds_per_leaf"}
        for row in sweep["points"]:
            point, tree, flat = row["point"], row["tree"], row["flat"]
            m, n, turns, prompts = (point["num_initial_rollouts"], point["num_branches"], point["turns"],
                                    point["prompts"])
            assert row["K"] == m * (n + 1) and row["G"] * 2 == m * (2 + n)  # the matched budget M(1 + N/2) = G
            assert tree["leaves"] == prompts * row["K"] and flat["leaves"] == prompts * row["G"]
            for side in (tree, flat):
                assert side["forward_tokens"] == side["unique_tokens"]  # packed: every unique token once
                assert side["unique_tokens"] <= side["flat_tokens"]
                for cost in ("generation_cpu_seconds", "training_cpu_seconds", "generated_tokens", "forward_tokens"):
                    assert side[f"{cost}_per_leaf"] * side["leaves"] == pytest.approx(side[cost])
                    assert side[f"{cost}_per_unique_token"] * side["unique_tokens"] == pytest.approx(side[cost])
                for key in ("generation_cpu_seconds", "training_cpu_seconds", "generation_memory_mib",
                            "training_memory_mib", "step_cpu_seconds_per_leaf"):
                    assert isinstance(side[key], float), key
            # the flat group samples every turn of every trajectory; the tree its M trajectories whole and each of its
            # M·N continuations from an anchor turn in 1..T-1 on (at least its last turn, at most T - 1 turns)
            assert flat["generated_tokens"] == prompts * row["G"] * turns * action
            generated_turns = tree["generated_tokens"] / action  # --quick measures one batch: no mean of batches
            assert generated_turns == int(generated_turns)
            assert prompts * (m * turns + m * n) <= generated_turns <= prompts * (m * turns + m * n * (turns - 1))
            # so the tree samples and forwards fewer tokens per leaf than the flat group (every trajectory the same
            # length here; with a real model's lengths this holds in expectation, not at every batch)
            assert tree["generated_tokens_per_leaf"] < flat["generated_tokens_per_leaf"]
            assert tree["forward_tokens_per_leaf"] < flat["forward_tokens_per_leaf"]
            assert row["tree_over_flat"]["forward_tokens_per_leaf"] < 1


def test_bench_scaling_smollm2_settings_sweep_leaves_and_turns_with_lora(tmp_path):
    """`--model smollm2` (LoRA, its learning rate, the leaves and turns axes only) at toy size, with the tiny model
    standing in for SmolLM2 (whose points are minutes each on 2 cores)."""
    from trl_tree.testing import tiny_model_path

    result = run_benchmark("bench_scaling.py", "--quick", "--model", "smollm2", "--model_name_or_path",
                           tiny_model_path(), tmp_path=tmp_path)
    assert set(result["sweeps"]) == {"leaves", "turns"}
    assert result["config"]["learning_rate"] == 2e-4 and result["config"]["model"] == "smollm2"
    for sweep in result["sweeps"].values():
        for row in sweep["points"]:
            assert row["tree"]["forward_tokens"] == row["tree"]["unique_tokens"]


def _runs(outcomes_per_seed: dict[int, list[float]]) -> list[dict]:
    return [{"seed": s, "curve": [{}, {"per_question": {"exact_match": o}}]} for s, o in outcomes_per_seed.items()]


@pytest.fixture
def bench_learning(benchmark_script):
    return benchmark_script("bench_learning")


def test_the_paired_difference_is_the_per_question_mean_over_shared_seeds_with_a_bootstrap_interval(bench_learning):
    same = _runs({0: [1, 0, 1, 0], 1: [0, 0, 1, 1]})
    d = bench_learning.paired_difference(same, same)
    assert d["mean"] == 0 and d["ci95"] == [0, 0] and d["a_better"] == d["b_better"] == 0
    # A wins one question more on seed 1 only; seed 2 of A has no partner and is left out
    a = _runs({0: [1, 0, 1, 0], 1: [1, 0, 1, 1], 2: [1, 1, 1, 1]})
    d = bench_learning.paired_difference(a, same)
    assert d["seeds"] == [0, 1] and d["questions"] == 4 and d["mean"] == 1 / 8 and (d["a_better"], d["b_better"]) == (1, 0)
    assert 0 <= d["ci95"][0] <= d["mean"] <= d["ci95"][1] <= 0.5
    # pairing: a constant shift on questions of very different difficulty has a tight interval
    hard_and_easy = _runs({0: [0.0] * 50 + [1.0] * 50})
    better = _runs({0: [1.0] * 50 + [1.0] * 50})
    d = bench_learning.paired_difference(better, hard_and_easy)
    assert d["mean"] == 0.5 and 0.35 < d["ci95"][0] < 0.5 < d["ci95"][1] < 0.65
    # runs recorded before per-question outcomes existed: nothing to pair
    assert bench_learning.paired_difference([{"seed": 0, "curve": [{}, {}]}], same) is None


def test_a_run_recorded_without_cpu_per_point_is_drawn_at_its_ends_only(bench_learning):
    """Older run files carry the run's CPU time, not each evaluation's: their middle points have no CPU position
    (NaN, not drawn), instead of all being put at the run's end."""
    import math

    old = {"train_cpu_seconds": 600.0, "curve": [{}, {}, {}]}
    assert [bench_learning._x_cpu_minutes(old, i) for i in (0, 2)] == [0.0, 10.0]
    assert math.isnan(bench_learning._x_cpu_minutes(old, 1))
    new = {"curve": [{"train_cpu_seconds": 0.0}, {"train_cpu_seconds": 120.0}]}
    assert [bench_learning._x_cpu_minutes(new, i) for i in (0, 1)] == [0.0, 2.0]


def test_warm_starts_rounded_differently_join_one_table_only_when_named_and_their_start_agrees(bench_learning):
    """The same warm-start folder built by other kernels has other weights: refused by default (naming the flag that
    joins them), accepted under `--equivalent_warm_starts` while every run starts from the same held-out point, and
    refused again when one start differs (another model, not another rounding), or when this sitting's does."""
    start = {"exact_match": 0.34375, "f1": 0.34375, "format_rate": 0.9453125, "mean_turns": 2.98,
             "mean_tool_calls": 1.98, "reward": 0.34375}

    def run(sha, first_point):
        return {"config": {"model_path": "/cache/warm-search-10steps-738fa2554d63", "warm_start_sha256": sha},
                "curve": [first_point, {}], "heldout_before": first_point["exact_match"]}

    runs = [(Path("grpo-seed0.json"), run("a" * 16, start)), (Path("grpo-seed1.json"), run("b" * 16, start))]
    with pytest.raises(SystemExit, match=f"--equivalent_warm_starts {'b' * 16},{'a' * 16}"):
        bench_learning.check_one_warm_start(runs)
    bench_learning.check_one_warm_start(runs, equivalent=f"{'a' * 16},{'b' * 16}")
    other_model = [*runs, (Path("grpo-seed2.json"), run("b" * 16, {**start, "exact_match": 0.35}))]
    with pytest.raises(SystemExit, match="other models, not one model rounded differently"):
        bench_learning.check_one_warm_start(other_model, equivalent=f"{'a' * 16},{'b' * 16}")
    this_sitting = {"warm_start": "warm-search-10steps-738fa2554d63", "warm_start_sha256": "b" * 16}
    bench_learning.check_one_warm_start(runs, this_sitting, f"{'a' * 16},{'b' * 16}", current_start=start)
    with pytest.raises(SystemExit, match="this sitting's warm start"):
        bench_learning.check_one_warm_start(runs, this_sitting, f"{'a' * 16},{'b' * 16}",
                                            current_start={**start, "format_rate": 0.9})
    # a hash outside the named ones is still another warm start
    with pytest.raises(SystemExit, match="another warm start"):
        bench_learning.check_one_warm_start([*runs, (Path("x.json"), run("c" * 16, start))],
                                            equivalent=f"{'a' * 16},{'b' * 16}")


def test_bench_learning_smollm2_path_writes_each_run_at_once_and_skips_it_later(tmp_path):
    """The `--model smollm2` code path (LoRA warm start and RL, per-turn cap, 128-question defaults, per-run files)
    at toy size, with the tiny model standing in for SmolLM2 (a SmolLM2 run is minutes, not seconds, on 2 cores)."""
    from trl_tree.testing import tiny_model_path

    args = ("--quick", "--model", "smollm2", "--model_name_or_path", tiny_model_path(), "--methods", "grpo,treeopsd",
            "--seeds", "0", "--rollout_token_budget", "1")
    result = run_benchmark("bench_learning.py", *args, tmp_path=tmp_path)
    assert result["config"]["lora_rank"] == 16 and result["config"]["max_turn_tokens"] == 64
    runs = tmp_path / "bench_learning.runs"
    assert sorted(p.name for p in runs.iterdir()) == ["grpo-seed0.json", "treeopsd-seed0.json"]
    for method in ("grpo", "treeopsd"):
        entry = result["results"][method]["0"]
        assert 0.0 <= entry["heldout_before"] <= 1.0 and 0.0 <= entry["heldout_after"] <= 1.0
        assert entry["rollout_tokens"] > 0
        assert json.loads((runs / f"{method}-seed0.json").read_text())["heldout_after"] == entry["heldout_after"]
    assert (tmp_path / "bench_learning.png").is_file() and (tmp_path / "bench_learning.md").is_file()

    (runs / "grpo-seed0.json").write_text(json.dumps({**json.loads((runs / "grpo-seed0.json").read_text()),
                                                      "heldout_after": 0.5}))
    again = run_benchmark("bench_learning.py", *args, tmp_path=tmp_path)  # nothing left to train: reads both results
    assert again["results"]["grpo"]["0"]["heldout_after"] == 0.5
    assert again["results"]["treeopsd"]["0"] == result["results"]["treeopsd"]["0"]

    # a table never mixes settings: the same output with another setting is refused, naming the field
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    other = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *args, "--learning_rate", "0.001",
                            "--output", str(tmp_path / "bench_learning.json")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert other.returncode != 0 and "learning_rate: 0.0002 there, 0.001 now" in other.stderr

    # --report_only trains nothing: the table of the runs present, the missing ones named
    (runs / "treeopsd-seed0.json").unlink()
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *args, "--report_only",
                             "--output", str(tmp_path / "bench_learning.json")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "[treeopsd seed 0] missing" in report.stdout and not (runs / "treeopsd-seed0.json").exists()
    assert set(json.loads((tmp_path / "bench_learning.json").read_text())["runs"]) == {"grpo"}

    # a table never mixes warm starts: a run trained from other weights (the same cache folder rebuilt on another
    # machine) is refused before any training, with what to do; a run file older than the recorded hash is
    # compared by the warm start's folder only
    saved = json.loads((runs / "grpo-seed0.json").read_text())
    assert len(saved["config"]["warm_start_sha256"]) == 16
    # and says which machine's rounding made it: the key of bit-level comparisons between machines
    from trl_tree.testing import kernel_fingerprint

    assert saved["environment"]["kernel_fingerprint"] == kernel_fingerprint()
    (runs / "grpo-seed0.json").write_text(json.dumps({**saved, "config": {**saved["config"],
                                                                          "warm_start_sha256": "0" * 16}}))
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *args,
                              "--output", str(tmp_path / "bench_learning.json")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "grpo-seed0.json" in refused.stderr and "another --output" in refused.stderr
    assert "kernels that round differently" in refused.stderr  # same folder name, other weights: say why
    assert not (runs / "treeopsd-seed0.json").exists()  # refused before training the missing run
    # --check_warm_start says so before a sitting trains: that run's weights are not this machine's, its start is
    check = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *args,
                            "--output", str(tmp_path / "bench_learning.json"),
                            "--check_warm_start", str(tmp_path / "check.json")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    checked = json.loads((tmp_path / "check.json").read_text())
    assert checked["warm_start_sha256"] == saved["config"]["warm_start_sha256"]
    assert [(r["run"], r["same_weights"], r["same_heldout_point"]) for r in checked["runs"]] == [
        ("grpo-seed0.json", False, True)]
    assert not (runs / "treeopsd-seed0.json").exists()  # trained nothing
    legacy = {k: v for k, v in saved["config"].items() if k != "warm_start_sha256"}
    (runs / "grpo-seed0.json").write_text(json.dumps({**saved, "config": legacy}))
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *args, "--report_only",
                             "--output", str(tmp_path / "bench_learning.json")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]


# the tiny model's --quick settings, with three generation batches (--quick trains one) so that staleness can show
STALENESS_RUN = ("--methods", "treeopsd", "--seeds", "0", "--warm_start_steps", "0", "--num_train", "8", "--num_test",
                 "2", "--max_turns", "2", "--max_completion_length", "48", "--prompts", "2", "--blocks", "1",
                 "--generation_batches", "3", "--eval_every", "3")


def test_bench_learning_at_max_staleness_1_trains_stale_batches_into_a_table_of_its_own(tmp_path):
    """analysis_plan.md F: `--max_staleness 1` grows batch j with the policy of batch max(0, j − 1), so batches 2
    and 3 train one version stale, and the run file says so (the trainer's async metrics per batch, its waits), with
    the rollout tokens of the batches it trained and its wall time. The table is `<output>_s1`, beside the
    synchronous one; the synchronous command on it is refused naming max_staleness, while --report_only at S = 1
    reads it back."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), *STALENESS_RUN,
              "--output", str(tmp_path / "learning.json")]
    trained = subprocess.run([*script, "--max_staleness", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert not (tmp_path / "learning.runs").exists()
    run = json.loads((tmp_path / "learning_s1.runs" / "treeopsd-seed0.json").read_text())
    assert run["config"]["max_staleness"] == 1
    stored = run["async"]
    assert stored["per_batch"]["policy_version"] == [0.0, 0.0, 1.0]
    assert stored["per_batch"]["staleness_max"] == [0.0, 1.0, 1.0] and stored["staleness_max"] == 1.0
    assert stored["staleness_mean"] == pytest.approx(2 / 3)
    assert len(stored["per_batch"]["trainer_wait"]) == len(stored["per_batch"]["producer_wait"]) == 3
    assert stored["trainer_wait_seconds"] >= 0 and stored["producer_wait_seconds"] >= 0
    # the worker's samples are counted as a synchronous run's, per batch trained; what it grew ahead for no step apart
    assert len(run["batches"]) == 3 and all(b["generated_tokens"] > 0 for b in run["batches"])
    assert run["rollout_tokens"] == sum(b["generated_tokens"] for b in run["batches"])
    assert stored["untrained_batches"] == 0  # the run ends at max_steps: the worker is never admitted past it
    assert run["train_seconds"] > sum(point["eval_seconds"] for point in run["curve"]) > 0
    assert "max_staleness 1" in (tmp_path / "learning_s1.md").read_text()

    mixed = subprocess.run([*script[:-1], str(tmp_path / "learning_s1.json")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert mixed.returncode != 0 and "max_staleness: 1 there, 0 now" in mixed.stderr
    assert "A table holds runs of one max_staleness" in mixed.stderr
    report = subprocess.run([*script, "--max_staleness", "1", "--report_only"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    assert json.loads((tmp_path / "learning_s1.json").read_text())["config"]["max_staleness"] == 1


def test_the_warm_start_check_never_writes_over_a_table_or_any_other_result(bench_learning, tmp_path, capsys):
    """`--check_warm_start FILE` writes FILE whole: a table's file (--output's or another's) is refused before the
    warm start is built, naming the file; a new file or an earlier check's is accepted."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"config": {}, "runs": {"treeopsd": []}, "summary": {}}))
    for check in (table, tmp_path / "other_table.json"):
        check.write_text(table.read_text())
        with pytest.raises(SystemExit):
            bench_learning.parse_args(["--quick", "--output", str(table), "--check_warm_start", str(check)])
        assert f"--check_warm_start {check}" in capsys.readouterr().err and check.read_text() == table.read_text()
    check = ["--quick", "--output", str(table), "--check_warm_start", str(tmp_path / "check.json")]
    assert bench_learning.parse_args(check).check_warm_start  # a new file
    (tmp_path / "check.json").write_text(json.dumps({"heldout_point": {}, "warm_start_sha256": "a" * 16, "runs": []}))
    assert bench_learning.parse_args(check).check_warm_start  # an earlier check's


def test_max_staleness_names_its_table_refuses_trls_grpo_and_reads_older_runs_as_synchronous(bench_learning,
                                                                                             tmp_path, capsys):
    quick = ["--quick", "--methods", "treeopsd", "--output", str(tmp_path / "t.json")]
    assert bench_learning.parse_args(quick).output == str(tmp_path / "t.json")
    assert bench_learning.parse_args([*quick, "--max_staleness", "2"]).output == str(tmp_path / "t_s2.json")
    named = ["--quick", "--methods", "treeopsd", "--output", str(tmp_path / "t_s2.json"), "--max_staleness", "2"]
    assert bench_learning.parse_args(named).output == str(tmp_path / "t_s2.json")  # already the staleness table's
    with pytest.raises(SystemExit):
        bench_learning.parse_args(["--quick", "--methods", "grpo,treeopsd", "--max_staleness", "1"])
    assert "method grpo is TRL's GRPOTrainer, which trains synchronously here" in capsys.readouterr().err
    assert bench_learning.parse_args(["--quick", "--methods", "grpo", "--max_staleness", "0"]).max_staleness == 0
    with pytest.raises(SystemExit):
        bench_learning.parse_args(["--quick", "--max_staleness", "-1"])
    assert "--max_staleness takes an integer >= 0" in capsys.readouterr().err

    # every run file before --max_staleness has none in its config: it joins a synchronous table only
    synchronous = bench_learning.parse_args(quick)
    config = bench_learning.portable(json.loads(json.dumps(vars(synchronous), default=str)))
    del config["max_staleness"]
    older = tmp_path / "treeopsd-seed0.json"
    older.write_text(json.dumps({"method": "treeopsd", "seed": 0, "config": config}))
    assert bench_learning.checked_run(older, synchronous)["seed"] == 0
    with pytest.raises(SystemExit, match=r"max_staleness: 0 there, 1 now"):
        bench_learning.checked_run(older, bench_learning.parse_args([*quick, "--max_staleness", "1"]))


def load_benchmarks_common(monkeypatch):
    """`benchmarks/common.py` as a module (the benchmarks are scripts, not a package), registered for the test only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_common", ROOT / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_grpo_micro_batches_keep_the_optimizer_steps_and_the_generation_batch(tmp_path, benchmark_script):
    common = benchmark_script("common")
    from trl_tree.testing import tiny_model_path

    model, tokenizer = common.load_model(tiny_model_path())
    task = common.make_task("calculator", None, 4)
    budget = common.Budget(prompts=8, blocks=4, group_size=8, generation_batches=1, max_completion_length=32,
                           grpo_micro_batch=4)
    args = common.build_trainer("grpo", model, tokenizer, task, budget, str(tmp_path)).args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (4, 4, 16)
    # the same generation batch (8 prompts x G) and the same E = 4 optimizer steps per generation batch
    assert args.per_device_train_batch_size * args.steps_per_generation == 64
    assert args.steps_per_generation // args.gradient_accumulation_steps == 4 and args.max_steps == 4
    with pytest.raises(ValueError, match="grpo_micro_batch"):
        common.build_trainer("grpo", model, tokenizer, task, common.Budget(prompts=8, blocks=4, grpo_micro_batch=3),
                             str(tmp_path))


def test_the_batch_meter_counts_a_rollout_workers_batches_as_the_synchronous_trainers(tmp_path, benchmark_script):
    """Through the rollout worker in lockstep (max_staleness 0: the synchronous run's trees, docs/design.md §9) the
    meter, which then reads the worker's own engine and scorer in the worker's thread, counts per generation batch
    the tokens, calls and leaves it counts in the synchronous trainer; nothing is left grown and untrained."""
    from tests.resume_runs import sampled_trainer
    from trl_tree.trainer.async_rollouts import use_rollout_worker

    common = benchmark_script("common")
    counted = ("generated_tokens", "generate_calls", "decode_steps", "leaf_action_tokens", "leaves", "unique_tokens",
               "flat_tokens", "forward_tokens", "trained_tokens")
    per_run = []
    for name, worker in (("sync", False), ("worker", True)):
        torch.manual_seed(0)
        trainer = sampled_trainer(str(tmp_path / name), prompts=12, steps_per_generation=2, max_steps=6)
        if worker:
            use_rollout_worker(trainer, 0)
        meter = common.BatchMeter(trainer)
        trainer.train()
        meter.memory.close()
        per_run.append([{k: getattr(b, k) for k in counted} for b in meter.batches])
        assert meter.grown == {}
    assert len(per_run[0]) == 3 and all(b["generated_tokens"] > 0 and b["leaf_action_tokens"] > 0 for b in per_run[0])
    assert per_run[1] == per_run[0]


def test_a_lora_warm_start_is_the_same_model_whatever_the_process_drew_before(tmp_path, monkeypatch):
    """Every method-seed run of a learning table starts from one cached warm start, and a table is completed over
    several sittings on fresh machines: rebuilt from the same inputs, the warm start must be the same weights, also
    when the process drew random numbers first (on a fresh machine `smollm2_path()` builds a model before it)."""
    from safetensors.torch import load_file

    from trl_tree.testing import tiny_model_path

    common = load_benchmarks_common(monkeypatch)
    task = common.make_task("calculator", num_train=8, num_test=2)
    base = tiny_model_path()

    def weights(cache: str, draw_first: bool) -> dict:
        monkeypatch.setenv("TRL_TREE_CACHE", str(tmp_path / cache))
        if draw_first:
            torch.rand(1000)
        folder = common.warm_started_model(task, base, steps=2, lr=1e-3, batch_size=2, lora_rank=4)
        return load_file(next(Path(folder).glob("*.safetensors")))

    first, second = weights("a", draw_first=False), weights("b", draw_first=True)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], load_file(next(Path(base).glob("*.safetensors")))[k]) for k in first)


def test_bench_packing_gpu_cpu_smoke_writes_runs(tmp_path):
    result = run_benchmark("bench_packing_gpu.py", "--cpu-smoke", tmp_path=tmp_path)
    assert {r["variant"] for r in result["runs"]} == {"tree_sdpa", "tree_chains", "paths_sdpa"}
    for run in result["runs"]:
        assert {"seconds", "forward_tokens", "unique_tokens", "path_tokens", "max_abs_logp_diff_vs_paths"} <= set(run)
    # every layout computes the same log-probs as the path rows: in float32 on CPU only the order of the sums differs,
    # a few ULPs of a log-prob of magnitude < 16 (one ULP is 2^-20 ≈ 9.5e-7 there; measured: at most 1.5e-6); a wrong
    # mask (a token seeing a sibling branch, or missing its prefix) moves log-probs by 1e-2 and more
    assert all(run["max_abs_logp_diff_vs_paths"] < 1e-5 for run in result["runs"]), result["runs"]
    assert result["speedup_paths_over_tree"]
    assert {choice["picks"] for choice in result["auto_sdpa"].values()} <= {"tree", "paths"}


def test_gpu_suite_cpu_runs_every_section_without_trl(tmp_path):
    """`gpu_suite.py --cpu`: the GPU run's code at tiny sizes. Every section writes its results; TreeOPSD's step gives
    the path layout's gradients in every tree layout; a tree leaf costs fewer generated tokens than a flat one (its
    continuations reuse their anchors' turns); and neither TRL nor datasets is imported (the GPU image has neither)."""
    result = run_benchmark("gpu_suite.py", "--cpu", tmp_path=tmp_path)
    assert result["imported"] == []
    assert set(result["seconds"]) == {"packing", "step", "generation", "precision", "total"}
    packing = result["packing"]
    assert {(r["size"], r["variant"]) for r in packing["runs"]} == {
        (size, variant) for size in (64, 256) for variant in ("tree_sdpa", "tree_chains", "paths_sdpa")}
    assert all(r["max_abs_logp_diff_vs_paths"] < 1e-5 for r in packing["runs"])

    step = result["step"]
    assert step["all_grads_match"] and step["gradient_tolerance"] == 1e-4
    assert [r["variant"] for r in step["runs"]] == ["paths_sdpa", "tree_sdpa", "tree_chains"]
    for run in step["runs"]:
        assert abs(run["loss_diff_vs_paths"]) < 1e-6 and run["grad_norm"] > 0
    assert step["runs"][1]["forward_tokens"] == step["trees"]["unique_tokens"] < step["trees"]["path_tokens"]

    generation = {r["variant"]: r for r in result["generation"]["runs"]}
    assert set(generation) == {"tree", "flat", "tree_no_store", "flat_no_store"}
    assert generation["tree"]["leaves"] == 2 * 12 and generation["flat"]["leaves"] == 2 * 8  # K = M(N + 1), G = 8
    assert generation["flat"]["generated_tokens"] == 2 * 8 * 3 * 8  # every turn has exactly --gen_turn_tokens
    assert generation["tree"]["generated_tokens_per_leaf"] < generation["flat"]["generated_tokens_per_leaf"]
    assert generation["tree"]["prefix_store"] and not generation["tree_no_store"]["prefix_store"]
    assert "tree/flat seconds_per_generated_token" in result["generation"]["ratios"]

    # LoRA and full fine-tuning × bf16 / fp16 / fp32 (issue 59): generation computes in the packed forward's dtype
    precision = {(r["adapter"], r["precision"]): r for r in result["precision"]["runs"]}
    assert set(precision) == {(a, p) for a in ("lora", "full") for p in ("bf16", "fp16", "fp32")}
    assert result["precision"]["all_ok"], result["precision"]["runs"]
    for (_, name), run in precision.items():  # CPU: accelerate has no fp16 autocast, so fp16 computes in float32
        assert run["generation_dtypes"] == run["forward_dtypes"] == ["bfloat16" if name == "bf16" else "float32"]
    assert precision["lora", "bf16"]["trainable_parameters"] < precision["full", "bf16"]["trainable_parameters"]


def test_gpu_suite_bf16_step_measures_its_own_rounding(tmp_path):
    """In bf16 the step's tolerance is 3x the path layout's own error against its float32 gradients."""
    result = run_benchmark("gpu_suite.py", "--cpu", "--dtype", "bfloat16", "--sections", "step", tmp_path=tmp_path)
    step = result["step"]
    assert step["dtype"] == "torch.bfloat16" and 0 < step["bf16_noise_vs_float32"] < 0.1
    assert step["gradient_tolerance"] == pytest.approx(3 * step["bf16_noise_vs_float32"])
    assert step["all_grads_match"], step["runs"]


# ----------------------------------------------------------------------------------------------------------------
# Packing paths used by the benchmarks
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_to_multiple_of", [None, 7, 64])
@pytest.mark.parametrize("block_size", [2, 3, 16, 128])
def test_block_mask_from_intervals_has_the_blocks_create_block_mask_finds(block_size, pad_to_multiple_of):
    """Same partial and full blocks, in the same order, as evaluating the mask_mod on every pair (what
    `create_block_mask` does, O(T²)), for lengths that are and are not multiples of the block size."""
    from torch.nn.attention.flex_attention import create_block_mask

    packed = pack_trees([branching_tree(seed=s) for s in range(3)], PAD, pad_to_multiple_of=pad_to_multiple_of)
    subtree_end, valid = packed.subtree_end[:, 0], packed.valid[:, 0]
    ends = _padding_sees_itself(subtree_end, valid)

    def ancestor_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[b, kv_idx])

    length = subtree_end.shape[-1]
    want = create_block_mask(ancestor_mask, 3, None, length, length, device="cpu", BLOCK_SIZE=block_size)
    got = block_mask(subtree_end, valid, block_size=block_size)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.seq_lengths == want.seq_lengths and torch.equal(got.to_dense(), want.to_dense())


def test_path_rows_run_on_a_kernel_without_custom_masks():
    """The "paths" layout is the fallback for kernels that only do causal attention (e.g. flash-attention): its
    rows reach the kernel without a mask and give the same log-probs as sdpa with the ancestor mask."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masks = []

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("test_causal_only", causal_only)
    AttentionMaskInterface.register("test_causal_only", lambda *args, **kwargs: None)
    model = tiny_model("sdpa")
    packed = pack_trees([branching_tree(seed=s) for s in range(2)], PAD, layout="paths")
    with torch.no_grad():
        want, _ = packed_token_logps(model, packed)
        model.set_attn_implementation("test_causal_only")
        got, _ = packed_token_logps(model, packed)
    assert masks and all(mask is None for mask in masks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_bench_tools_quick_times_each_variant_against_its_limit(tmp_path):
    """`bench_tools.py --quick`: every variant at each latency, with its limit and the critical path of its trees."""
    result = run_benchmark("bench_tools.py", "--quick", "--latencies", "0,0.05", "--repeats", "1", tmp_path=tmp_path)
    rows = {(r["variant"], r["latency"]): r for r in result["rows"]}
    assert set(rows) == {(v, lat) for v in ("concurrent", "serial", "grpo") for lat in (0.0, 0.05)}
    # the same scripted trees either way: the same calls, the same chains of calls
    assert rows["concurrent", 0.05]["tool_calls"] == rows["serial", 0.05]["tool_calls"] > 0
    assert rows["concurrent", 0.05]["critical_path_calls"] == rows["serial", 0.05]["critical_path_calls"] >= 2
    for row in result["rows"]:  # the limit: zero-latency time + the longest chain's seconds (about calls × latency)
        span = row["limit_seconds"] - rows[row["variant"], 0.0]["seconds"]
        assert span >= row["critical_path_calls"] * row["latency"] * 0.99
    assert set(result["targets"]) >= {"zero_latency_concurrent_over_serial_cpu"}


def test_bench_tools_overlap_quick_hides_tool_time_only_with_chunks(tmp_path):
    """`bench_tools.py --overlap --quick`: turns of uneven lengths on a paced engine that resumes turns. With chunked
    generation the engine goes on while tools run and the loop waits less for them; with a turn per engine call, or
    one call at a time, the loop stands still through every call (nothing hidden). Only properties of the run's
    structure, and one ratio within the run, are asserted, never a time."""
    result = run_benchmark("bench_tools.py", "--overlap", "--quick", tmp_path=tmp_path)
    rows = {(r["workload"], r["variant"]): r for r in result["rows"]}
    workloads, variants = ("staggered", "mixed"), ("concurrent", "chunked", "serial")
    assert set(rows) == {(w, v) for w in workloads for v in variants}
    for workload in workloads:
        concurrent, chunked, serial = (rows[workload, v] for v in variants)
        # the same trees whatever the variant, with or without latency
        calls = {r[key] for r in (concurrent, chunked, serial) for key in ("tool_calls", "generation_only_tool_calls")}
        assert len(calls) == 1 and calls.pop() > 0
        assert chunked["engine_calls"] > concurrent["engine_calls"] == serial["engine_calls"]
        for row in (concurrent, chunked, serial):
            assert 0 <= row["hidden_fraction"] <= 1 and 0 <= row["tools_under_generation"] <= 1
            assert row["tool_busy_seconds"] <= row["tool_seconds"] + 1e-6
        # a turn per engine call: the engine never runs while a tool does; one at a time, the loop runs every call
        assert concurrent["tools_under_generation"] == serial["tools_under_generation"] == 0
        assert serial["hidden_fraction"] == 0
        # chunked: ready branches generate while the others' tools run, so the loop stands still less
        assert chunked["tools_under_generation"] > 0
        assert chunked["wait_seconds"] < concurrent["wait_seconds"]
        assert chunked["hidden_fraction"] > concurrent["hidden_fraction"]


def test_bench_eval_cache_quick_times_both_settings_on_the_same_answers(tmp_path):
    """`bench_eval_cache.py --quick`: the greedy evaluation with and without prefix KV reuse, each timed, on the same
    questions; reuse changes how histories are encoded, not which answer greedy decoding picks."""
    result = run_benchmark("bench_eval_cache.py", "--quick", "--repeats", "2", tmp_path=tmp_path)
    rows = {r["kv_reuse"]: r for r in result["rows"]}
    assert set(rows) == {"none", "prefix"} and all(r["repeats"] == 2 for r in rows.values())
    assert result["questions"] == 4 and rows["prefix"]["same_answers"] == rows["none"]["same_answers"] == 4
    assert rows["none"]["generated_tokens"] == rows["prefix"]["generated_tokens"] > 0
    assert rows["none"]["cpu_ratio"] == 1.0 and rows["prefix"]["speedup"] == pytest.approx(1 / rows["prefix"]["cpu_ratio"])


def test_a_cached_warm_start_point_is_read_without_loading_the_model(bench_learning, monkeypatch, tmp_path):
    """Greedy answers of unchanged weights are cached; reading them back must not pay the model's load."""
    monkeypatch.setenv("TRL_TREE_CACHE", str(tmp_path))
    task = SimpleNamespace(fingerprint=lambda: "task", test_rows=[{"prompt": "q", "answer": "a"}])
    settings = SimpleNamespace(max_turns=2, chunk_tokens=64)
    monkeypatch.setattr(bench_learning, "agent_settings", lambda args: settings)

    def load_model(path):
        raise AssertionError("a cached point loaded the model")

    monkeypatch.setattr(bench_learning, "load_model", load_model)
    cache = bench_learning.heldout_cache("/cache/warm", task, settings)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"exact_match": 0.25}))
    assert bench_learning.warm_start_point("/cache/warm", task, None) == {"exact_match": 0.25}
    # chunking changes how answers are computed, not which: the same cache entry
    assert bench_learning.heldout_cache("/cache/warm", task, SimpleNamespace(max_turns=2, chunk_tokens=8)) == cache
    assert bench_learning.heldout_cache("/cache/other", task, settings) != cache
