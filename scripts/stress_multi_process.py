"""Run a 2-process `trl-tree <method> --accelerate_config multi_cpu` job many times in a row and report every exit.

A rare failure at exit (a rank aborting after the model is saved) never shows in one run, and a job that exits 1
after a finished training run fails the pipeline that launched it. This runs the whole command a user runs: a tiny
local model, a local JSONL dataset, a reward and an environment by import path, two CPU processes, training, saving,
and the exit of both ranks. It prints one line per run and a summary, and with `--output` writes JSON with each run's
exit code, seconds and, for a failure, the tail of its output.

Usage:
    python scripts/stress_multi_process.py --runs 20 --output /tmp/stress.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

USER_MODULE = '''
def short_answer(completions, answer, **kwargs):
    return [float(a in (c[-1].get("content") or "")) for c, a in zip(completions, answer)]


class Counter:
    def reset(self, **kwargs):
        self.count = 0

    def increment(self, step: int) -> str:
        """Adds a step to the counter.

        Args:
            step: how much to add.
        """
        self.count += step
        return str(self.count)
'''

# (M, N) = (2, 1): G = 3, one tree per micro-batch; 2 optimizer steps per run, short turns
TREE = ("--num_initial_rollouts 2 --num_branches 1 --per_device_train_batch_size 3 --steps_per_generation 1 "
        "--max_steps 2 --max_turns 2 --max_completion_length 24 --report_to none --save_strategy no").split()


def prepare(workdir: Path) -> None:
    (workdir / "my_task.py").write_text(textwrap.dedent(USER_MODULE))
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a, b in [(2, 3), (4, 5), (1, 1), (6, 2)]]
    (workdir / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def command(method: str, model: str, output_dir: Path) -> list[str]:
    return [sys.executable, "-m", "trl_tree.cli", method, "--accelerate_config", "multi_cpu",
            "--model_name_or_path", model, "--dataset_name", "data.jsonl", "--reward_funcs", "my_task.short_answer",
            "--environment_factory", "my_task.Counter", *TREE, "--output_dir", str(output_dir)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--method", default="treeopsd")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from trl_tree.testing import tiny_model_path

    model = tiny_model_path()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prepare(workdir)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir), os.environ.get("PYTHONPATH", "")])}
        for i in range(args.runs):
            started = time.perf_counter()
            try:
                done = subprocess.run(command(args.method, model, workdir / f"out{i}"), cwd=workdir, env=env,
                                      capture_output=True, text=True, timeout=args.timeout)
                rc, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                rc, output = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            seconds = time.perf_counter() - started
            saved = (workdir / f"out{i}" / "model.safetensors").is_file()
            result = {"run": i, "rc": rc, "seconds": round(seconds, 1), "model_saved": saved}
            if rc != 0:
                result["output_tail"] = output[-4000:]
            results.append(result)
            print(f"run {i:>3}  rc {rc!s:>7}  {seconds:6.1f} s  model saved: {saved}", flush=True)
    failures = [r for r in results if r["rc"] != 0]
    print(f"{len(results) - len(failures)} of {len(results)} runs exited 0")
    for r in failures:
        print(f"--- run {r['run']} (rc {r['rc']}) output tail ---\n{r['output_tail'][-1500:]}")
    if args.output:
        Path(args.output).write_text(json.dumps({"method": args.method, "runs": results}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
