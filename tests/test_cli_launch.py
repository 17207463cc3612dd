"""`trl-tree <method>` through a real `accelerate launch`: the other CLI tests (tests/test_cli.py) patch the launcher,
so only this one runs the whole path a user's first command takes. The offline default (the HotpotQA search agent on
its synthetic data and the tiny model) with tiny settings, as tests/test_train_hotpot.py runs the example in process:
the command checks its arguments, sends `--num_processes` to the launcher and the rest to the launched script, which
warm-starts, evaluates, trains and saves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# tests/test_train_hotpot.py's TINY settings, and one launcher option
TINY = (
    "--num_processes 1 --num_train 4 --num_eval 3 --warm_start_steps 2 --warm_start_batch_size 2 --max_steps 1 "
    "--per_device_train_batch_size 3 --steps_per_generation 1 --num_initial_rollouts 2 --num_branches 1 "
    "--max_turns 2 --max_completion_length 48"
).split()


@pytest.mark.slow
def test_trl_tree_treeopsd_launches_trains_and_saves_offline(tmp_path):
    out = tmp_path / "model"
    # PYTHONPATH: the launched script is this checkout's, and so must be the trl_tree it imports
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "trl_tree.cli", "treeopsd", *TINY, "--output_dir", str(out),
         "--bm25_cache_dir", str(tmp_path / "bm25")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((out / "hotpot_results.json").read_text())
    assert results["method"] == "TreeOPSD" and results["tiny_model"]
    # the script options reached the launched script through the launcher
    assert results["settings"]["num_train"] == 4 and results["settings"]["max_completion_length"] == 48
    assert len(results["warm_start_loss"]) == 2 and len(results["reward_curve"]) == 1  # one logged optimizer step
    for name in ("before", "after"):
        assert results[name]["num_questions"] == 3
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert Path(results["tree_view"]).is_file()
    assert f"model saved to {out}" in done.stdout


@pytest.mark.slow
def test_a_failing_launched_script_ends_the_output_with_its_own_error_not_accelerates_traceback(tmp_path):
    """issue 59: the child's error sat at line 82 of 120, under accelerate's `CalledProcessError` traceback. Now the
    child's last lines are the end of the output, then one line that says so, and the exit code is the child's."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}]}) + "\n")
    (tmp_path / "my_rewards.py").write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    missing = tmp_path / "no_such_model"  # passes the checks before the launch; the launched script cannot load it
    done = subprocess.run(
        [sys.executable, "-m", "trl_tree.cli", "treeopsd", "--num_processes", "1", "--model_name_or_path",
         str(missing), "--dataset_name", "data.jsonl", "--reward_funcs", "my_rewards.zero", "--report_to", "none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "CalledProcessError" not in done.stderr and "accelerate/commands" not in done.stderr
    *child, ours = done.stderr.rstrip().splitlines()
    assert ours.startswith("trl-tree treeopsd: the training process exited with code 1; its error is the output")
    assert str(missing) in child[-1]  # the child's own last line: its exception, naming the model it could not load
