"""TRL's two dataset formats (issue 41, item 1): plain-string prompts (standard) and chat-message prompts
(conversational), with TRL's built-in rewards, through the trainer and through `trl-tree`'s pre-launch check.

As in GRPOTrainer, a plain-string prompt gives reward functions plain-string completions and a conversational one
lists of messages. A reward function that reads chat messages (TRL's accuracy, reasoning-accuracy, think-format and
cosine-scaled rewards) on plain-string prompts would fail on the first batch, after the launch: it is refused when the
trainer is built, and by `trl-tree` before launching for a local data file, with how to convert the prompts.
"""

import json
import runpy
import sys
import typing

import pytest
import trl.rewards
from datasets import Dataset
from hypothesis import given
from hypothesis import strategies as st

from tests.scripted import AFTER_TOOL, CALL_1_PLUS_1, config, scripted_engine, tiny
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer, cli
from trl_tree.rewards import completion_format_problem, guard_reward_func, reads_chat_messages
from trl_tree.testing import calculator, tiny_model_path
from trl_tree.trainer.prompts import prompt_problem

MESSAGE_REWARDS = [trl.rewards.accuracy_reward, trl.rewards.reasoning_accuracy_reward, trl.rewards.think_format_reward,
                   trl.rewards.get_cosine_scaled_reward(max_len=100)]  # fmt: skip
ID_REWARDS = [trl.rewards.get_soft_overlong_punishment(max_completion_len=96, soft_punish_cache=16),
              trl.rewards.get_repetition_penalty_reward()]  # fmt: skip
THINKING = "<think>\nadd them\n</think>\nThe answer is 2."


def test_trls_rewards_that_read_chat_messages_are_recognised_by_their_annotation():
    assert all(reads_chat_messages(f) for f in MESSAGE_REWARDS)
    assert not any(reads_chat_messages(f) for f in ID_REWARDS)  # they read completion_ids: any format


def _annotated(annotation):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    reward.__annotations__ = {"completions": annotation}
    return reward


@pytest.mark.parametrize("annotation", [
    list[list[dict[str, str]]], typing.List[typing.List[typing.Dict[str, str]]], "list[list[dict]]",  # noqa: UP006
    "List[List[Dict[str, Any]]]", typing.Sequence[typing.Sequence[typing.Mapping]],
])  # fmt: skip
def test_every_spelling_of_a_list_of_message_lists_reads_chat_messages(annotation):
    assert reads_chat_messages(_annotated(annotation))


@pytest.mark.parametrize("annotation", [list[str], "list[str]", typing.Any, list, "NotImported[int]"])
def test_other_annotations_and_none_are_not_judged(annotation):
    assert not reads_chat_messages(_annotated(annotation))
    assert not reads_chat_messages(lambda completions, **kwargs: None)


@given(readers=st.lists(st.booleans(), max_size=4), conversational=st.booleans())
def test_a_format_problem_exactly_when_a_message_reader_meets_plain_string_prompts(readers, conversational):
    funcs = [trl.rewards.think_format_reward if r else ID_REWARDS[0] for r in readers]
    names = [f"reward_{i}" for i in range(len(funcs))]
    problem = completion_format_problem(funcs, names, conversational)
    assert (problem is not None) == (any(readers) and not conversational)
    if problem is not None:  # names every reader, and no other function
        assert all((f"'reward_{i}'" in problem) == r for i, r in enumerate(readers))
        assert '[{"role": "user", "content": "..."}]' in problem and "dataset.map" in problem


def test_a_reward_reading_messages_from_a_string_completion_says_to_use_conversational_prompts():
    """An unannotated reward cannot be judged before it runs: its error then says why its completion is a string."""
    def first_content(completions, **kwargs):
        return [float("2" in c[0]["content"]) for c in completions]

    guarded = guard_reward_func(first_content, "first_content")
    with pytest.raises(RuntimeError, match=r"plain strings because the dataset's prompts are.*role.*user"):
        guarded(prompts=["What is 1+1?"], completions=["2"])
    assert guarded(prompts=[[]], completions=[[{"role": "assistant", "content": "2"}]]) == [1.0]


# ---------------------------------------------------------------------------------------------------------------
# Through the trainer, on the tiny model (scripted replies)
# ---------------------------------------------------------------------------------------------------------------

STANDARD = Dataset.from_dict({"prompt": ["What is 1+1?"] * 2, "solution": ["2"] * 2})
CONVERSATIONAL = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1+1?"}]] * 2,
                                    "solution": ["2"] * 2})  # fmt: skip


def _recording(seen):
    def format_seen(prompts, completions, **kwargs):
        seen.extend(zip(prompts, completions))
        return [0.0] * len(completions)

    return format_seen


def _trainer(tmp_path, dataset, reward_funcs, replies, model=None, tools=(calculator,)):
    loaded, tok = tiny() if model is None else (model, None)
    trainer = TreeOPSDTrainer(model=loaded, reward_funcs=reward_funcs, args=config(TreeOPSDConfig, tmp_path),
                              train_dataset=dataset, processing_class=tok, tools=list(tools) or None)
    trainer.generation_engine = scripted_engine(trainer.processing_class, replies)
    return trainer


@pytest.mark.parametrize("reward", MESSAGE_REWARDS, ids=lambda f: f.__name__)
def test_plain_string_prompts_with_a_message_reading_reward_are_refused_before_the_model_loads(tmp_path, reward):
    """The check runs before GRPOTrainer loads the model: a model path that does not exist is never reached."""
    with pytest.raises(ValueError, match=rf"train_dataset: The reward function '{reward.__name__}' reads each "
                       r"completion as chat messages.*plain strings.*\"role\": \"user\""):
        TreeOPSDTrainer(model=str(tmp_path / "no-model"), reward_funcs=[ID_REWARDS[0], reward],
                        args=config(TreeOPSDConfig, tmp_path), train_dataset=STANDARD)


def test_plain_string_eval_prompts_are_checked_too(tmp_path):
    model, _ = tiny()
    with pytest.raises(ValueError, match="eval_dataset: The reward function 'think_format_reward'"):
        TreeOPSDTrainer(model=model, reward_funcs=trl.rewards.think_format_reward,
                        args=config(TreeOPSDConfig, tmp_path), train_dataset=CONVERSATIONAL,
                        eval_dataset={"held_out": STANDARD})


def test_plain_string_prompts_train_with_string_completions_and_trls_id_rewards(tmp_path):
    """TRL's standard format: every leaf reaches the reward functions as its generated text (a string, the prompt
    not included), TRL's completion-id rewards score it, and a step trains."""
    seen = []
    replies = {"": [CALL_1_PLUS_1, "I do not know.", CALL_1_PLUS_1], AFTER_TOOL: ["The answer is 2."] * 3}
    trainer = _trainer(tmp_path, STANDARD, [_recording(seen), *ID_REWARDS], replies)
    trainer.train()
    assert len(seen) == 4 and all(isinstance(p, str) and isinstance(c, str) for p, c in seen)
    assert sorted(c for _, c in seen) == ["I do not know."] + ["The answer is 2."] * 3
    assert trainer.state.global_step == 1


def test_conversational_prompts_train_with_trls_think_format_reward_on_message_completions(tmp_path):
    """TRL's conversational format: completions are message lists, which TRL's think_format_reward reads; a leaf that
    thinks first scores 1, the others 0."""
    seen, scores = [], []
    replies = {"<|im_start|>assistant\n": [THINKING, "I do not know."] * 2}
    trainer = _trainer(tmp_path, CONVERSATIONAL, [_recording(seen), trl.rewards.think_format_reward], replies,
                       tools=())
    score = trainer._score_leaves
    trainer._score_leaves = lambda *args: scores.append(score(*args)) or scores[-1]
    trainer.train()
    assert seen and all(isinstance(c, list) and c[0]["role"] == "assistant" for _, c in seen)
    think = scores[0].per_func[:, 1].tolist()
    expected = [float(c[0]["content"].startswith("<think>")) for _, c in seen]
    assert think == expected and set(think) == {0.0, 1.0}


# ---------------------------------------------------------------------------------------------------------------
# Through `trl-tree`: the pre-launch check, and a launched run on plain-string prompts
# ---------------------------------------------------------------------------------------------------------------

USER_REWARD = '''
def answer_length(completions, **kwargs):
    assert all(isinstance(c, str) for c in completions), completions
    return [float(len(c)) / 100 for c in completions]
'''


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    questions = ["What is 2 + 3?", "What is 4 + 5?"]
    (tmp_path / "standard.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "user_reward", raising=False)
    yield tmp_path
    sys.modules.pop("user_reward", None)


TINY_RUN = ("--num_initial_rollouts 2 --num_branches 1 --per_device_train_batch_size 3 --steps_per_generation 1 "
            "--max_steps 1 --max_turns 2 --max_completion_length 16 --report_to none --save_strategy no").split()


def _launched(monkeypatch, argv):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    code = cli.main(argv)
    return code, launched


@pytest.mark.parametrize("reward", ["think_format_reward", "accuracy_reward", "trl.rewards.reasoning_accuracy_reward"])
def test_trl_tree_refuses_plain_string_prompts_for_a_message_reading_reward_before_the_launch(
        data_dir, monkeypatch, capsys, reward):
    argv = ["treeopsd", "--model_name_or_path", tiny_model_path(), "--dataset_name", "standard.jsonl",
            "--reward_funcs", reward, "--output_dir", str(data_dir / "out")]  # fmt: skip
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and launched == []
    err = capsys.readouterr().err
    assert "--dataset_name standard.jsonl" in err and "plain strings (TRL's standard format)" in err
    assert '{"prompt": [{"role": "user", "content": "..."}]}' in err and len(err.splitlines()) == 1


def test_trl_tree_launches_conversational_prompts_with_think_format_reward(data_dir, monkeypatch):
    argv = ["treeopsd", "--model_name_or_path", tiny_model_path(), "--dataset_name", "chat.jsonl",
            "--reward_funcs", "think_format_reward", *TINY_RUN, "--output_dir", str(data_dir / "out")]  # fmt: skip
    code, launched = _launched(monkeypatch, argv)
    assert code == 0 and len(launched) == 1


def test_trl_tree_trains_plain_string_prompts_with_a_string_reward_after_the_launch(data_dir, monkeypatch):
    """The issue's command with a reward that takes strings: launched, then trained as `accelerate launch` runs the
    script; the reward's own assertion checks that every completion reaches it as a string."""
    out = data_dir / "out"
    argv = ["treeopsd", "--model_name_or_path", tiny_model_path(), "--dataset_name", "standard.jsonl",
            "--reward_funcs", "user_reward.answer_length", *TINY_RUN, "--output_dir", str(out)]  # fmt: skip
    code, (launched,) = _launched(monkeypatch, argv)
    monkeypatch.setattr(sys, "argv", [launched.training_script, *launched.training_script_args])
    runpy.run_path(launched.training_script, run_name="__main__")
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------
# Bad rows refused when the trainer is built, naming the row and the fix (issue 56, item 6)
# ---------------------------------------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is 1+1?"}]
BAD_ROWS = {  # prompt column (the bad row last, row 2) -> what the error says about it, and its fix
    "none, conversational": ([ASK, ASK, None], r"has no prompt \(None\).*dataset\.filter"),
    "none, plain strings": (["What is 1+1?"] * 2 + [None], r"has no prompt \(None\).*dataset\.filter"),
    "empty string": (["What is 1+1?"] * 2 + [""], r"has an empty prompt \(''\).*dataset\.filter"),
    "blank string": (["What is 1+1?"] * 2 + ["  \n"], r"has an empty prompt .*dataset\.filter"),
    "empty messages": ([ASK, ASK, []], r"has an empty list of messages.*dataset\.filter"),
    "message without a role": ([ASK, ASK, [{"content": "What is 1+1?"}]],
                               r"has a prompt whose message 0 has no role \(role=None.*rename its keys"),
    "message without content": ([ASK, ASK, [{"role": "user"}]],
                                r"has a prompt whose message 0 \(role 'user'\) has no content.*only an assistant "
                                r"message with tool_calls"),
    "empty messages' content": ([ASK, ASK, [{"role": "system", "content": ""}, {"role": "user", "content": " "}]],
                                r"has a prompt whose messages are all empty.*Fill such rows in"),
}  # fmt: skip


@pytest.mark.parametrize("prompts, says", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_bad_row_is_refused_naming_the_row_and_the_fix_before_the_model_loads(tmp_path, prompts, says):
    """Both TRL formats; before the fix, [] was a bare IndexError from TRL's format check at build time, None the
    tokenizer's type error without a row, and "", blank and empty messages passed. The check runs before GRPOTrainer
    loads the model: a model path that does not exist is never reached."""
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["2"] * 3})
    with pytest.raises(ValueError, match=rf"^TreeOPSDTrainer: train_dataset row 2 {says}.*Checked when the trainer is "
                       "built"):  # fmt: skip
        TreeOPSDTrainer(model=str(tmp_path / "no-model"), reward_funcs=ID_REWARDS[0],
                        args=config(TreeOPSDConfig, tmp_path), train_dataset=dataset)


def test_a_column_of_non_messages_and_a_bad_eval_row_are_named(tmp_path):
    not_messages = Dataset.from_dict({"prompt": [["What is 1+1?"], ["What is 2+2?"]]})
    with pytest.raises(ValueError, match=r"train_dataset row 0 has a prompt whose message 0 is a str "
                       r"\('What is 1\+1\?'\), not a chat message"):  # fmt: skip
        TreeOPSDTrainer(model=str(tmp_path / "no-model"), reward_funcs=ID_REWARDS[0],
                        args=config(TreeOPSDConfig, tmp_path), train_dataset=not_messages)
    held_out = Dataset.from_dict({"prompt": [ASK, None]})
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] row 1 has no prompt"):
        TreeOPSDTrainer(model=str(tmp_path / "no-model"), reward_funcs=ID_REWARDS[0],
                        args=config(TreeOPSDConfig, tmp_path), train_dataset=CONVERSATIONAL,
                        eval_dataset={"held_out": held_out})


def test_a_bad_row_in_a_batch_is_named_too(tmp_path):
    """Rows not seen at start-up (a streaming dataset, `generate_batch`'s own rows) are checked per batch, where TRL
    would fail on [] with a bare IndexError; a batch that mixes the two formats is refused too."""
    trainer = _trainer(tmp_path, CONVERSATIONAL, [ID_REWARDS[0]], {"": ["2"] * 8})
    with pytest.raises(ValueError, match=r"TreeOPSDTrainer: row 1 of this batch has an empty list of messages"):
        trainer.generate_batch([{"prompt": ASK}, {"prompt": []}])
    with pytest.raises(ValueError, match=r"row 1 of this batch is a plain string, but the first prompt is chat "
                       r"messages: TRL renders a batch in the format of its first prompt"):  # fmt: skip
        trainer.generate_batch([{"prompt": ASK}, {"prompt": "What is 1+1?"}])


@pytest.mark.parametrize("prompt", [
    "What is 1+1?",
    ASK,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],  # something is asked
    [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],  # content blocks
])  # fmt: skip
def test_usable_prompts_pass(prompt):
    assert prompt_problem(prompt) is None and prompt_problem(prompt, first=prompt) is None


def test_an_environment_may_own_the_prompts_text_but_not_its_shape():
    """With `environment_factory` the reset's observation is appended to the last message (TRL's placeholder prompt is
    one empty user message), so empty content passes; None, [] and a message without a role still do not."""
    empty = [{"role": "user", "content": ""}]
    assert prompt_problem(empty, owns_prompts=True) is None
    assert "all empty" in prompt_problem(empty, owns_prompts=False)
    for bad in (None, [], [{"content": "x"}]):
        assert prompt_problem(bad, owns_prompts=True) is not None
