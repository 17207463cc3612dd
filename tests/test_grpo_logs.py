"""Logs, rewards and data as GRPOTrainer has them: the tree trainers log GRPO's metrics under GRPO's names, pass
`log_metric` / `log_extra` through, read datasets and reward outputs as GRPO does, and name what is wrong otherwise.

GRPOTrainer itself is the reference: one real step of it on the tiny model gives the metric names a GRPO dashboard
expects; its `_calculate_rewards` gives the rewards it reads from each kind of reward-function output.
"""

import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tests.scripted import (
    AFTER_TOOL,
    CALL_1_PLUS_1,
    REPLIES,
    TwoRoleScript,
    arithmetic_dataset,
    contains_answer,
    scripted_trainer,
    tiny,
)
from tests.trees import deep_tree, flatten, hotpot_like_tree, perturbed
from trl_tree import (
    TreeConfig,
    TreeFlexConfig,
    TreeFlexTrainer,
    TreeOPSDConfig,
    TreeOPSDTrainer,
    credit,
    losses,
    trl_internals,
)
from trl_tree.testing import calculator
from trl_tree.trainer.base import TreeTrainer
from trl_tree.trainer.observability import completions_table


class LogCapture(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    @property
    def keys(self) -> set[str]:
        return {k for log in self.logs for k in log}


def logging_reward(completions, log_metric, log_extra, **kwargs):
    """A reward that uses TRL's logging callbacks: a metric per batch and an extra column per completion."""
    log_metric("answer_length", float(sum(len(c[-1].get("content") or "") for c in completions)))
    log_extra("last_message", [c[-1].get("content") or "" for c in completions])
    return [0.5] * len(completions)


@pytest.fixture(scope="module")
def grpo_keys(tmp_path_factory):
    """What one GRPOTrainer step logs with tools, two reward functions and `log_metric` (β = 0: no `kl`)."""
    model, tok = tiny()
    capture = LogCapture()
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=16, max_steps=1, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", learning_rate=1e-2, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[contains_answer, logging_reward], args=args, train_dataset=arithmetic_dataset(2),
        processing_class=tok, tools=[calculator], callbacks=[capture],
    )  # fmt: skip
    trainer.train()
    return capture.keys


def _tree_trainer(tmp_path, cls=TreeOPSDTrainer, config_cls=TreeOPSDConfig, reward_funcs=None, dataset=None,
                  replies=REPLIES, callbacks=(), **overrides):
    reward_funcs = reward_funcs or [contains_answer, logging_reward]
    return scripted_trainer(cls, config_cls, tmp_path, replies, reward_funcs=reward_funcs, dataset=dataset,
                            callbacks=callbacks, **overrides)


def _flex_trainer(tmp_path, callbacks=()):
    return scripted_trainer(TreeFlexTrainer, TreeFlexConfig, tmp_path, script=TwoRoleScript,
                            reward_funcs=[contains_answer, logging_reward], callbacks=callbacks, num_searches=2,
                            max_blocks=3, max_turns=3, max_completion_length=160)


CLIP_RATIO = {f"clip_ratio/{k}" for k in ("low_mean", "low_min", "high_mean", "high_max", "region_mean")}
# GRPO metrics without a meaning for a tree run. GRPO logs clip_ratio/* only for its clipped losses (not for sapo or
# vespo); TreeOPSD's Bernoulli KL to its teacher and TreePO's fixed-credit surrogate have no clip. (Nor do the tree
# trainers log what GRPO itself does not log here: `kl` needs β > 0, `sampling/*` vLLM's importance sampling,
# `policy_loss` / `entropy_coef` an entropy bonus, `aux_loss` a MoE router.)
NOT_FOR_TREES = {"treeopsd": CLIP_RATIO, "treepo": CLIP_RATIO}


@pytest.mark.parametrize("loss", ["treeopsd", "treepo", "atpo", "grpo", "gspo_token"])
def test_a_tree_trainer_logs_every_grpo_metric_under_grpos_name(tmp_path, grpo_keys, loss):
    capture = LogCapture()
    reward_std = "population" if loss == "atpo" else "sample"
    trainer = _tree_trainer(tmp_path, TreeTrainer, TreeConfig, callbacks=[capture], loss=loss, reward_std=reward_std)
    trainer.train()
    assert grpo_keys - NOT_FOR_TREES.get(loss, set()) <= capture.keys, grpo_keys - capture.keys
    if loss not in NOT_FOR_TREES:
        assert all(0.0 <= capture.logs[0][k] <= 1.0 for k in CLIP_RATIO)


def test_treeflex_logs_every_grpo_metric_under_grpos_name(tmp_path, grpo_keys):
    capture = LogCapture()
    _flex_trainer(tmp_path, callbacks=[capture]).train()
    assert grpo_keys <= capture.keys, grpo_keys - capture.keys


def test_generation_metrics_follow_grpos_definitions_on_the_leaves(tmp_path):
    """The scripted tree (test_trainer_scripted.REPLIES): leaves call→"2" (R=1), "do not know" (0), call→"3" (0) and
    call→"2" again (1); a completion's length counts its generated tokens, not the tool observation."""
    capture = LogCapture()
    trainer = _tree_trainer(tmp_path, reward_funcs=[contains_answer], callbacks=[capture])
    lengths = []
    original = trainer._log_rollout_metrics

    def spy(mode, sizes, leaf_lengths, *rest):
        lengths.extend(leaf_lengths)
        return original(mode, sizes, leaf_lengths, *rest)

    trainer._log_rollout_metrics = spy
    trainer.train()
    log = capture.logs[0]
    tok = trainer.processing_class
    eos = 1  # every scripted turn ends with <|im_end|>
    call, answer_2, answer_3, give_up = (len(tok.encode(t, add_special_tokens=False)) + eos for t in
                                         (CALL_1_PLUS_1, "The answer is 2.", "The answer is 3.", "I do not know."))
    assert sorted(lengths) == sorted([call + answer_2, give_up, call + answer_3, call + answer_2])
    assert log["completions/mean_length"] == pytest.approx(sum(lengths) / 4)
    assert (log["completions/min_length"], log["completions/max_length"]) == (min(lengths), max(lengths))
    assert log["completions/clipped_ratio"] == 0.0 and log["completions/mean_terminated_length"] == log[
        "completions/mean_length"]
    assert log["reward"] == 0.5 and log["reward_std"] == pytest.approx(torch.tensor([1.0, 0, 0, 1]).std().item())
    assert log["rewards/contains_answer/std"] == pytest.approx(log["reward_std"])
    assert log["frac_reward_zero_std"] == 0.0  # the tree's leaves disagree
    assert log["tools/failure_frequency"] == 0.0  # (call_frequency: the tools part of the issue fixes inherited calls)
    assert log["num_tokens"] == trainer.state.num_input_tokens_seen > 0
    assert 0.0 < log["entropy"] <= math.log(len(tok))


def test_num_tokens_and_samples_per_second_count_completions_as_grpo_does(tmp_path):
    """GRPO adds, per completion, its prompt's tokens and its model-generated tokens (tool results masked out) to
    `num_input_tokens_seen`, logged as `num_tokens`; its dataloader repeats each prompt G times, so a "sample" of
    `train_samples_per_second` is a completion. On the scripted tree the completions are the K = 4 leaves; the
    tree's own count of tokens (each shared token once) is `tree/unique_tokens`."""
    capture = LogCapture()
    trainer = _tree_trainer(tmp_path, reward_funcs=[contains_answer], callbacks=[capture])
    seen = {}
    original = trainer._log_rollout_metrics

    def spy(mode, sizes, leaf_lengths, *rest):
        seen["lengths"] = list(leaf_lengths)
        return original(mode, sizes, leaf_lengths, *rest)

    trainer._log_rollout_metrics = spy
    output = trainer.train()
    log = capture.logs[0]
    prompt = trl_internals.tokenize_prompts(trainer, [trainer.train_dataset[0]["prompt"]])[0][0]
    grpo_tokens = sum(len(prompt) + n for n in seen["lengths"])  # GRPO: prompt + completion (tool_mask) per completion
    assert len(seen["lengths"]) == 4 and log["num_tokens"] == grpo_tokens == trainer.state.num_input_tokens_seen
    assert 0 < log["tree/unique_tokens"] < log["tree/flat_tokens"]  # shared turns once; every path's tokens
    runtime, per_second = output.metrics["train_runtime"], output.metrics["train_samples_per_second"]
    assert per_second * runtime == pytest.approx(4, rel=0.02)  # 1 step × 1 tree × K = 4 completions


def test_log_metric_and_log_extra_from_a_reward_function_reach_the_logs_as_in_grpo(tmp_path):
    capture = LogCapture()
    trainer = _tree_trainer(tmp_path, callbacks=[capture], log_completions=True)
    trainer.train()
    # log_metric: averaged into the step's logs (one value per generation batch here)
    assert capture.logs[0]["answer_length"] == pytest.approx(
        sum(len(c[-1]["content"]) for c in trainer._logs["completion"])
    )
    # log_extra: one value per leaf, a column of the completions table next to its completion
    column = list(trainer._logs["extra"]["last_message"])
    assert column == [c[-1]["content"] for c in trainer._logs["completion"]] and len(column) == 4


def test_the_completions_table_is_shown_once_per_step_not_again_with_the_end_of_training_summary(tmp_path,
                                                                                                 monkeypatch):
    import trl.trainer.grpo_trainer as grpo_module

    shown = []
    # the step the table is titled with; GRPOTrainer's own call, told to print 0 rows (trl-tree prints its own table
    # of the same rows, trainer/observability/completions_table.py), is not counted
    monkeypatch.setattr(grpo_module, "print_prompt_completions_sample",
                        lambda *args, **kwargs: args[5] != 0 and shown.append(args[4]))
    # the table as a terminal shows it (off a terminal, as under pytest, each row is one compact line instead)
    monkeypatch.setattr(completions_table, "stdout_is_terminal", lambda: True)
    replies = {key: texts * 2 for key, texts in REPLIES.items()}  # two generation batches' worth
    trainer = _tree_trainer(tmp_path, replies=replies, log_completions=True, max_steps=2, logging_steps=1)
    trainer.train()
    assert shown == [1, 2]  # the final summary's log (at step 2 again) does not print step 2's rows twice
    assert trainer.log_completions  # and the flag is back for whatever logs next


# ---------------------------------------------------------------------------------------------------------------
# clip_ratio/* as GRPO defines them, on the tree's K root-to-leaf sequences
# ---------------------------------------------------------------------------------------------------------------


def grpo_clip_ratio(coef, advantages, mask, eps_low, eps_high):
    """GRPOTrainer._compute_loss's clip_ratio lines on a flat [B, T] batch of sequences (one process)."""
    is_low = (coef < 1 - eps_low) & (advantages < 0)
    is_high = (coef > 1 + eps_high) & (advantages > 0)

    def global_mean(x):
        return ((x * mask).sum() / mask.sum()).item()

    def seq_mean(x):
        return (x * mask).sum(-1) / mask.sum(-1)

    return {
        "low_mean": global_mean(is_low.double()), "high_mean": global_mean(is_high.double()),
        "region_mean": global_mean((is_low | is_high).double()),
        "low_min": seq_mean(is_low.double()).min().item(), "high_max": seq_mean(is_high.double()).max().item(),
    }  # fmt: skip


def _as_flat_batch(tree, per_token_values):
    """The K root-to-leaf sequences of `tree` as a padded [K, T] batch of the unique tokens' values."""
    _, _, spans = flatten(tree)
    rows = [[j for i in path for j in spans[i]] for path in tree.paths]
    width = max(map(len, rows))
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for k, row in enumerate(rows):
        values[k, : len(row)] = per_token_values[row]
        mask[k, : len(row)] = 1
    return values, mask


@pytest.mark.parametrize("tree_fn", [hotpot_like_tree, deep_tree])
@pytest.mark.parametrize("level", ["token", "turn", "sequence"])
def test_clip_ratio_of_a_tree_is_grpos_on_its_flat_trajectories(tree_fn, level):
    tree = tree_fn()
    turn_ids, old, _ = flatten(tree)
    logps = perturbed(old, seed=3, scale=0.3)
    A = torch.linspace(-1.0, 1.0, tree.num_turns, dtype=torch.float64)[torch.randperm(tree.num_turns,
                                                                                       generator=torch.Generator().manual_seed(0))]
    pair_paths, pair_turns, _ = credit.path_turn_pairs(tree)
    eps_low, eps_high = (0.2, 0.28) if level != "sequence" else (0.05, 0.07)  # a path's mean ratio moves less
    count = {"token": losses.token_clip_counts, "turn": losses.turn_clip_counts,
             "sequence": losses.gspo_token_clip_counts}[level]
    counts = count(logps, old, turn_ids, A, pair_paths, pair_turns, tree.num_leaves, epsilon_low=eps_low,
                   epsilon_high=eps_high)
    # the same ratios and advantages as GRPO's flat batch of the K sequences sees them
    advantages, mask = _as_flat_batch(tree, A[turn_ids])
    log_ratio, _ = _as_flat_batch(tree, logps - old)
    if level == "token":
        coef = log_ratio.exp()
    elif level == "turn":
        s = losses.turn_mean_log_ratio(logps, old, turn_ids, tree.num_turns)
        coef, _ = _as_flat_batch(tree, s[turn_ids].exp())
    else:
        coef = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).exp().expand_as(mask)
    expected = grpo_clip_ratio(coef, advantages, mask, eps_low, eps_high)
    assert 0 < expected["region_mean"] < 1  # the perturbation clips some tokens and not others
    assert losses.clip_ratio_summary(counts) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Data and reward functions
# ---------------------------------------------------------------------------------------------------------------


def test_a_dataset_without_a_prompt_column_is_an_error_as_in_grpo(tmp_path):
    dataset = Dataset.from_dict({"question": ["What is 1+1?"] * 2, "answer": ["2"] * 2})
    model, tok = tiny()
    grpo = GRPOTrainer(
        model=model, reward_funcs=contains_answer, train_dataset=dataset, processing_class=tok,
        args=GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2, num_generations=2,
                        max_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no"),
    )  # fmt: skip
    with pytest.raises(KeyError, match="prompt"):
        grpo.train()
    tree = _tree_trainer(tmp_path / "tree", dataset=dataset)
    with pytest.raises(KeyError, match="no 'prompt' column.*rename the column"):
        tree.train()


def test_a_plain_text_prompt_with_tools_hands_rewards_the_completion_without_the_prompt(tmp_path):
    """GRPO hands a reward function only what the model generated after a plain-text prompt; so do the trees, and
    the tool call is still parsed and run."""
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(zip(prompts, completions))
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": ["What is 1+1?"]})
    replies = {"": [CALL_1_PLUS_1, "I do not know.", CALL_1_PLUS_1],
               AFTER_TOOL: ["The answer is 2."] * 3}
    trainer = _tree_trainer(tmp_path, reward_funcs=[reward], dataset=dataset, replies=replies)
    trainer.generate_batch([dataset[0]])
    assert len(seen) == 4 and all(isinstance(c, str) for _, c in seen)
    assert sorted(c for _, c in seen) == ["I do not know."] + ["The answer is 2."] * 3
    assert not any(c.startswith(p) for p, c in seen)


def _grpo_for_rewards(tmp_path, reward):
    model, tok = tiny()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no")
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=arithmetic_dataset(2),
                       processing_class=tok)


def _score_one_tree(trainer):
    """The scripted tree's per-function rewards and the leaf rewards its credit uses."""
    trees = []
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: trees.append(tree) or original(tree)
    score, scores = trainer._score_leaves, []
    trainer._score_leaves = lambda *args: scores.append(score(*args)) or scores[-1]
    trainer.generate_batch([trainer.train_dataset[0]])
    return scores[0].per_func, torch.tensor(trees[0].rewards)


def tensor_reward(completions, answer, **kwargs):
    return torch.tensor(contains_answer(completions, answer))


def test_a_reward_function_returning_a_tensor_works_as_in_grpo(tmp_path):
    inputs = [{"prompt": [{"role": "user", "content": "q"}], "answer": "2"}] * 2
    completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]]
    grpo = _grpo_for_rewards(tmp_path / "grpo", tensor_reward)
    expected = grpo._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions, [[1], [1]])
    assert expected[:, 0].tolist() == [1.0, 0.0]

    per_func, rewards = _score_one_tree(_tree_trainer(tmp_path / "tree", reward_funcs=[tensor_reward]))
    assert per_func[:, 0].tolist() == rewards.tolist() == [1.0, 0.0, 0.0, 1.0]  # as with the list-returning reward


def test_none_means_not_applicable_and_an_unscored_leaf_warns_and_gets_no_advantage(tmp_path, monkeypatch):
    """A function's None is NaN (does not apply): the other functions decide. A leaf that no function scores warns as
    in GRPO, is left out of the logged reward, and takes its tree's scored mean, so its advantage is exactly 0."""

    def only_answers(completions, **kwargs):  # does not apply to "I do not know."
        return [None if "know" in c[-1]["content"] else 1.0 for c in completions]

    def only_known(completions, **kwargs):
        return [None if "know" in c[-1]["content"] else float("2" in c[-1]["content"]) for c in completions]

    warnings = []
    monkeypatch.setattr("trl.trainer.grpo_trainer.logger.warning", lambda msg, *a, **k: warnings.append(msg))
    trainer = _tree_trainer(tmp_path, reward_funcs=[only_answers, only_known])
    per_func, rewards = _score_one_tree(trainer)
    leaves = [1.0 + 1.0, None, 1.0 + 0.0, 1.0 + 1.0]  # call→2, give up, call→3, call→2 (branch)
    unscored = leaves.index(None)
    assert torch.isnan(per_func[unscored]).all() and not torch.isnan(per_func[[0, 2, 3]]).any()
    assert any("All reward functions returned None" in w for w in warnings)
    scored_mean = (2.0 + 1.0 + 2.0) / 3
    assert rewards[unscored].item() == pytest.approx(scored_mean)
    assert credit.standardize(rewards)[unscored].item() == pytest.approx(0.0, abs=1e-6)  # float32 rewards
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode]["reward"][-1] == pytest.approx(scored_mean)


def _nan_when_giving_up(completions, **kwargs):
    return [math.nan if "know" in c[-1]["content"] else float("2" in c[-1]["content"]) for c in completions]


async def _async_nan_when_giving_up(completions, **kwargs):
    return _nan_when_giving_up(completions)


@pytest.mark.parametrize("reward", [_nan_when_giving_up, _async_nan_when_giving_up], ids=["sync", "async"])
def test_nan_from_a_sync_or_async_reward_function_means_not_applicable_as_in_grpo(tmp_path, reward):
    """One rule for both kinds of function, GRPO's: a NaN reward is a None (GRPOTrainer's reward tensor cannot tell
    them apart), warned about once. The leaf that no function scores takes its tree's scored mean: advantage 0."""
    trainer = _tree_trainer(tmp_path, reward_funcs=[reward])
    with pytest.warns(UserWarning, match="returned nan for sample 1"):
        per_func, rewards = _score_one_tree(trainer)
    unscored = 1  # leaves: call→2 (1), give up (NaN), call→3 (0), call→2 (1)
    assert torch.isnan(per_func[unscored]).all() and per_func[[0, 2, 3], 0].tolist() == [1.0, 0.0, 1.0]
    assert rewards.tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
    assert credit.standardize(rewards)[unscored].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    ("output", "error", "message"),
    [
        (lambda n: ["1.0"] * n, TypeError, r"returned '1.0' \(str\) for sample 0.*a number"),
        (lambda n: [1.0] * (n + 1), ValueError, r"returned 5 rewards for 4 completions.*one reward per completion"),
        (lambda n: None, TypeError, r"returned None \(NoneType\).*one reward per completion"),
        (lambda n: torch.ones(n, 2), ValueError, r"returned a tensor of shape \(4, 2\).*1-D tensor of 4 rewards"),
    ],
)  # fmt: skip
def test_a_reward_function_returning_the_wrong_thing_is_named_with_what_to_return(tmp_path, output, error, message):
    def bad_reward(completions, **kwargs):
        return output(len(completions))

    trainer = _tree_trainer(tmp_path, reward_funcs=[bad_reward])
    with pytest.raises(error, match="Reward function 'bad_reward' " + message):
        trainer.generate_batch([trainer.train_dataset[0]])

