"""The HotpotQA example (`trl_tree.scripts.hotpot.run`) with its retrieval server killed mid-run: the driver of
`tests/test_dead_retrieval_server.py`, run as its own process so that its exit status is the script's.

`python -m tests.dead_server_run KILL ARGS...`: ARGS are the script's; KILL is the PID of the server to kill, or `own`
for the server the script started itself (`--retriever server`). Three things are added to the script, nothing changed:

- once the search tool is built, one batched search of 1,000 queries fills the retriever's failure window with
  answered searches (the breaker must stop the run whatever the window held);
- the policy is scripted (`SearchThriceThenAnswer`): every rollout searches, so training depends on the server;
- when the first checkpoint is saved, the server is killed (SIGKILL) and the checkpoint's weights file hashed to
  `KILLED_AT_SAVE.json` in the output folder, for the test to check it was not touched afterwards.
"""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from tests.scripted import tool_call
from trl_tree.rollout.acting.tools import batch_form
from trl_tree.scripts import hotpot
from trl_tree.testing import ScriptedEngine

MARKER = "KILLED_AT_SAVE.json"
TOOL_RESPONSE = "</tool_response>"


class SearchThriceThenAnswer:
    """Searches in each of its first three turns, then answers: a tree's first rollouts alone make three rounds of
    searches, so a dead server fails three requests in a row in the first generation after it died."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prefix: list[int]) -> list[int]:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        searches = text.count(TOOL_RESPONSE)
        reply = tool_call("search", query=f"band {searches}") if searches < 3 else "<answer>a band</answer>"
        return self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos]


class KillServerAtFirstSave(TrainerCallback):
    def __init__(self, kill: str):
        self.kill, self.done = kill, False

    def on_save(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        if self.kill == "own":
            process = hotpot._OWN_SERVERS[0].process
            process.kill()
            process.wait()
        else:
            os.kill(int(self.kill), signal.SIGKILL)
            time.sleep(0.5)  # the test reaps it; its port closes when it dies
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        digest = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
        (Path(args.output_dir) / MARKER).write_text(json.dumps({"step": state.global_step, "sha256": digest}))
        print(f"[test] killed the retrieval server after saving {checkpoint}", flush=True)


def main(kill: str, argv: list[str]) -> None:
    build_search_tool, trainer_class_for = hotpot.build_search_tool, hotpot.trainer_class_for

    def build_and_fill(*args, **kwargs):
        tool = build_search_tool(*args, **kwargs)
        answers = batch_form(tool).fn([{"query": f"band {i}"} for i in range(1000)])
        assert not any(answer.startswith("Error") for answer in answers)
        return tool

    def scripted(training_args):
        cls = trainer_class_for(training_args)

        class Scripted(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, callbacks=[KillServerAtFirstSave(kill)], **kwargs)
                script = SearchThriceThenAnswer(self.processing_class)
                self.generation_engine = ScriptedEngine(script, [script.eos])

        return Scripted

    hotpot.build_search_tool, hotpot.trainer_class_for = build_and_fill, scripted
    hotpot.run("treeopsd", argv)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
