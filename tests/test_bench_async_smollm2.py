"""`benchmarks/bench_async.py --setting smollm2` (`benchmarks/async_smollm2.py`) with `--quick`: the tiny model in
place of SmolLM2, so the pipeline is tested in seconds; its figures are the machine's and never asserted."""

import subprocess
import sys

from tests.test_benchmarks import ROOT, run_benchmark


def test_smollm2_setting_quick_compares_sync_with_the_worker_against_the_limit(tmp_path):
    result = run_benchmark("bench_async.py", "--setting", "smollm2", "--quick", "--staleness", "1,2", "--batches", "3",
                           "--rollout_generation", "thread,process", tmp_path=tmp_path)
    assert result["setting"] == "smollm2" and result["settings"]["blocks"] == 4
    rows = {row["variant"]: row for row in result["rows"]}
    # --quick: the synchronous run at one thread only; each staleness with the worker's generation in its thread and
    # in a child process
    assert list(rows) == ["sync_t1", "async_s1", "async_s1_process", "async_s2", "async_s2_process"]
    assert [rows[v]["rollout_generation"] for v in rows] == [None, "thread", "process", "thread", "process"]
    assert result["sync"] == "sync_t1" and result["limit_seconds"] > 0
    assert result["limit_seconds"] == max(rows["sync_t1"]["generation_seconds"], rows["sync_t1"]["training_seconds"])
    for row in rows.values():
        assert row["speedup"] > 0 and row["over_limit"] > 0 and row["generated_tokens"] > 0
        assert len(row["intervals"]) == result["settings"]["batches"]
    for s, where in ((1, ""), (2, ""), (1, "_process"), (2, "_process")):
        row = rows[f"async_s{s}{where}"]
        # batch j is sampled by the policy of batch max(0, j - s): staleness min(j, s), s at the third batch
        assert row["torch_threads"] == 1 and row["staleness_max"] == s
        for column in ("trainer_wait", "producer_wait", "weight_publication_seconds", "worker_generation_seconds"):
            assert row[column] >= 0, column


def test_smollm2_contention_quick_times_threads_and_a_child_process(tmp_path):
    """Generation alone in this process and alone in the spawned child is the same work: the same rows, weights,
    sampler state and seed grow the same trees (the same trained tokens)."""
    result = run_benchmark("bench_async.py", "--setting", "smollm2", "--quick", "--contention", tmp_path=tmp_path)
    table = {row["run"]: row for row in result["contention"]}
    assert list(table) == ["alone", "alone, in the child process", "two threads", "two processes"]
    assert table["alone"]["generation_tokens"] == table["alone, in the child process"]["generation_tokens"] > 0
    for run in ("two threads", "two processes"):
        assert table[run]["generation_ratio"] > 0 and table[run]["training_ratio"] > 0 and table[run]["overlap"] > 0
        assert len(result[run.split()[1]]["training_blocks"]) == 4  # E blocks measured beside generation


def test_smollm2_setting_refuses_prompts_that_do_not_split_into_whole_trees_per_block():
    process = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_async.py"), "--setting", "smollm2", "--prompts", "6"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 2
    assert "--prompts 6: give a positive multiple of E=4 (whole trees per optimizer block)." in process.stderr
