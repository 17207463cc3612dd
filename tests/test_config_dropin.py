"""A GRPO config carries over to the tree trainers with only the class swap (issue 9, "Configs").

GRPO's numbers keep GRPO's meaning: `num_generations` is the per-prompt rollout budget in complete trajectories,
the batch sizes count trajectories of budget, so the same prompts are trained per step; options that would change
nothing are rejected together; `max_tool_calling_iterations`, `multi_objective_aggregation` and
`mask_truncated_completions` are honoured.
"""

import itertools
import time
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

from tests.scripted import (
    AFTER_TOOL,
    CALL_1_PLUS_1,
    arithmetic_dataset,
    config,
    contains_answer,
    scripted_engine,
    tiny,
)
from trl_tree import (
    AT2POConfig,
    TreeAdvConfig,
    TreeFlexConfig,
    TreeOPSDConfig,
    TreeOPSDTrainer,
    TreePOConfig,
    methods,
    trl_internals,
)
from trl_tree.testing import calculator
from trl_tree.trainer import scoring
from trl_tree.trainer.configuration import tree_budget

CPU = dict(report_to="none", use_cpu=True, bf16=False, save_strategy="no")

# TRL's `trl grpo` defaults as a recipe sets them, with an agent's tool cap and GRPO's default G.
GRPO_RECIPE = dict(
    learning_rate=1e-6, num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=2,
    max_completion_length=256, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
    num_iterations=1, importance_sampling_level="token", temperature=1.0, max_tool_calling_iterations=3,
    multi_objective_aggregation="sum_then_normalize", mask_truncated_completions=True, logging_steps=1, **CPU,
)


def _distinct_prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(n)]})


@pytest.mark.parametrize("config_cls", [TreeOPSDConfig, TreePOConfig, AT2POConfig, TreeAdvConfig])
def test_a_grpo_recipe_builds_every_tree_config_unchanged(config_cls, tmp_path):
    args = config_cls(output_dir=str(tmp_path), **GRPO_RECIPE)
    assert args.num_generations == 8
    assert float(tree_budget.trajectory_budget(args)) == 8  # M derived from G: (4, 2); AT2PO 2 + 2·6/2; TreeAdv 4(1 + 1)
    assert args.trees_per_micro_batch == 2 and args.max_turns == 4  # 16 / 8 trees; k = 3 tool rounds and an answer
    grpo = GRPOConfig(output_dir=str(tmp_path), **GRPO_RECIPE)
    assert args.generation_batch_size == grpo.generation_batch_size and args.steps_per_generation == 2
    assert args.prompts_per_generation == grpo.generation_batch_size // grpo.num_generations


@pytest.mark.parametrize("config_cls", [TreeOPSDConfig, TreePOConfig, AT2POConfig, TreeAdvConfig])
def test_log_completions_prints_a_bounded_sample_unless_asked_for_every_row(config_cls, tmp_path):
    """A tree batch has a completions-table row per leaf: GRPO's default (None, every row) printed 70k lines and
    made training 3x slower. The tree configs print TRL's `num_completions_to_print` rows, 8 unless set."""
    assert config_cls(output_dir=str(tmp_path), log_completions=True, **CPU).num_completions_to_print == 8
    every = config_cls(output_dir=str(tmp_path), log_completions=True, num_completions_to_print=None, **CPU)
    assert every.num_completions_to_print is None


def test_treeflex_takes_the_recipe_as_its_group_and_rejects_the_per_trajectory_tool_cap(tmp_path):
    recipe = {k: v for k, v in GRPO_RECIPE.items() if k != "max_tool_calling_iterations"}
    args = TreeFlexConfig(output_dir=str(tmp_path), **recipe)
    assert args.num_searches == 8 and args.trees_per_micro_batch == 2
    with pytest.raises(ValueError, match="max_tool_calling_iterations=3: a search is several causal blocks"):
        TreeFlexConfig(output_dir=str(tmp_path), **GRPO_RECIPE)


def test_a_grpo_config_trains_the_same_prompts_per_step_as_grpo_trainer(tmp_path):
    """Built from the same kwargs, GRPOTrainer's first generation batch holds each prompt G times; the tree trainer's
    holds each of the same prompts once, in the same order, and its micro-batches split them alike."""
    kwargs = dict(output_dir=str(tmp_path), num_generations=8, per_device_train_batch_size=16,
                  steps_per_generation=4, gradient_accumulation_steps=2, max_completion_length=32, seed=3, **CPU)
    dataset = _distinct_prompts(24)
    model, tok = tiny()
    grpo = GRPOTrainer(model=model, reward_funcs=contains_answer, args=GRPOConfig(**kwargs), train_dataset=dataset,
                       processing_class=tok)
    tree = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=TreeOPSDConfig(**kwargs),
                           train_dataset=dataset, processing_class=tok)

    def prompts(batch):
        return [x["prompt"][0]["content"] for x in batch]

    grpo_batch, tree_batch = (prompts(next(iter(t.get_train_dataloader()))) for t in (grpo, tree))
    G = grpo.args.num_generations
    assert grpo_batch == [p for p in tree_batch for _ in range(G)]
    assert len(tree_batch) == tree.args.prompts_per_generation == 8
    # per micro-batch (TRL splits the generation batch into steps_per_generation slices) and per optimizer step
    assert grpo.args.per_device_train_batch_size // G == tree.args.trees_per_micro_batch == len(tree_batch) // 4
    assert tree.args.num_optimizer_blocks == 2
    # transformers' samples per step (train_samples_per_second): completions, GRPO's 4 prompts × G, a tree's K leaves
    assert grpo.get_total_train_batch_size(grpo.args) == 4 * G
    assert tree.get_total_train_batch_size(tree.args) == 4 * tree.args.leaves_per_tree


def test_startup_prints_the_effective_numbers(tmp_path, capsys):
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, trees_per_micro_batch=2, steps_per_generation=2)
    TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(4),
                    processing_class=tok)
    out = capsys.readouterr().out
    for part in ("G = 3", "4 prompts per generation batch", "2 trees per micro-batch", "K = 4 leaves per tree",
                 "2 prompts and 6 expected trajectories per optimizer step", "E = 2 optimizer blocks"):
        assert part in out


def test_every_unused_grpo_option_is_named_in_one_error_with_what_to_use(tmp_path):
    unused = dict(loss_type="grpo", scale_rewards="batch", epsilon=0.3, epsilon_high=0.28, delta=1.5,
                  importance_sampling_level="sequence", beta=0.04, num_iterations=2, top_entropy_quantile=0.2,
                  entropy_coef=0.01, off_policy_mask_threshold=0.5, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError) as error:
        TreeOPSDConfig(output_dir=str(tmp_path), **unused, **CPU)
    message = str(error.value)
    for name, value in unused.items():
        assert f"- {name}={value!r}: " in message
    assert "reward_std" in message and "loss='gspo_token'" in message and "steps_per_generation" in message
    # scale_rewards=True is GRPOConfig's "group" (its default), so it is not "set"
    assert TreeOPSDConfig(output_dir=str(tmp_path), scale_rewards=True, **CPU).scale_rewards == "group"


def test_vllm_importance_sampling_correction_is_rejected_only_where_grpo_would_apply_it(tmp_path):
    args = TreeOPSDConfig(output_dir=str(tmp_path), vllm_importance_sampling_correction=True, **CPU)
    assert "vllm_importance_sampling_correction" not in args.unused_grpo_options()  # no vLLM: GRPO ignores it too
    args.use_vllm = True
    assert "set it to False" in args.unused_grpo_options()["vllm_importance_sampling_correction"]


@pytest.mark.parametrize("loss", ["atpo", "grpo", "gspo_token"])
def test_the_clipped_losses_keep_epsilon_and_epsilon_high(loss, tmp_path):
    args = TreeOPSDConfig(output_dir=str(tmp_path), loss=loss, credit="path", reward_std="population",
                          epsilon=0.1, epsilon_high=0.3, **CPU)
    assert (args.epsilon, args.epsilon_high) == (0.1, 0.3)


def test_a_num_generations_that_no_m_gives_lists_the_settings_that_do(tmp_path):
    with pytest.raises(ValueError, match="num_generations=7") as error:  # N given: kept, so no M reaches G
        TreeOPSDConfig(output_dir=str(tmp_path), num_generations=7, num_branches=2, **CPU)
    listed = str(error.value).split("G = 7: ")[1].split(". Set")[0].split("; ")
    assert listed and "num_initial_rollouts=7, num_branches=0" in listed
    for option in listed:  # every listed (M, N) indeed gives G = 7
        m, n = (int(kv.split("=")[1]) for kv in option.split(", "))
        assert TreeOPSDConfig(output_dir=str(tmp_path), num_initial_rollouts=m, num_branches=n,
                              per_device_train_batch_size=7, **CPU).num_generations == 7


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_generations=8, num_initial_rollouts=3), "num_initial_rollouts=3 costs 6"),
        (dict(num_generations=1), "No setting of num_initial_rollouts gives G = 1"),
        (dict(num_generations=0), "num_generations must be a whole number of trajectories ≥ 1"),
        (dict(per_device_train_batch_size=12), r"per_device_train_batch_size \(12\).*num_generations \(8\)\. Set "
         r"per_device_train_batch_size to 8 or 16"),
        (dict(per_device_train_batch_size=4), "Set per_device_train_batch_size to 8, or"),
        (dict(max_tool_calling_iterations=2, max_turns=5), "allows 3 assistant turns.*max_turns=5"),
        (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation must be one of"),
        (dict(num_generations_eval=4), r"num_generations_eval \(4\) differs from num_generations \(8\)"),
    ],
)
def test_a_bad_budget_or_batch_size_is_one_clear_error(fields, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        TreeOPSDConfig(output_dir=str(tmp_path), **fields, **CPU)


def test_num_generations_sets_m_for_each_sampler(tmp_path):
    cases = [
        (TreeOPSDConfig, dict(num_branches=0), 8),  # flat-like init_expand: M = G
        (TreeOPSDConfig, dict(sampler="flat", credit="path", loss="grpo", reward_std="population"), 8),
        (AT2POConfig, dict(), 2),  # 2 + 2·6/2 = 8
        (TreeAdvConfig, dict(max_branches_per_tree=2), 4),  # 4(1 + 2/2) = 8
    ]
    for config_cls, fields, M in cases:
        args = config_cls(output_dir=str(tmp_path), num_generations=8, **fields, **CPU)
        assert args.num_initial_rollouts == M and args.num_generations == 8
    # neither set: each preset keeps its documented M, G follows, and an unset micro-batch is one tree
    args = AT2POConfig(output_dir=str(tmp_path), **CPU)
    assert (args.num_initial_rollouts, args.num_generations, args.per_device_train_batch_size) == (2, 8, 8)
    assert TreeOPSDConfig(output_dir=str(tmp_path), **CPU).per_device_train_batch_size == 8  # GRPO's default


def test_evaluation_grows_one_tree_per_prompt_with_grpos_eval_batch_size(tmp_path):
    """per_device_eval_batch_size counts trajectories too: GRPO's loader repeats each prompt G times, and the tree
    trainer grows one tree per prompt of the batch."""
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, num_branches=0, eval_strategy="steps", eval_steps=1,
                  per_device_eval_batch_size=4)  # G = M = 2: 2 prompts per evaluation batch
    dataset = _distinct_prompts(4).add_column("answer", ["2"] * 4)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=dataset,
                              eval_dataset=dataset, processing_class=tok)
    trainer.generation_engine = scripted_engine(tok, {"": ["The answer is 2."] * 100})
    seen = []
    original = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(inputs) or original(inputs)
    metrics = trainer.evaluate()
    batches = [sorted(x["prompt"][0]["content"] for x in inputs) for inputs in seen]
    assert [len(b) for b in batches] == [2, 2] and sorted(sum(batches, [])) == [f"question {i}" for i in range(4)]
    assert metrics["eval_reward"] == 1.0
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size \(3\) counts trajectories"):
        config(TreeOPSDConfig, tmp_path, num_branches=0, eval_strategy="steps", eval_steps=1,
               per_device_eval_batch_size=3)


def test_too_little_data_for_one_generation_batch_is_an_error_at_init(tmp_path):
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, trees_per_micro_batch=2, steps_per_generation=4)  # 8 prompts per batch
    with pytest.raises(ValueError, match="train_dataset has 6 prompts, but one generation batch needs 8.*Lower"):
        TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(6),
                        processing_class=tok)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_max_tool_calling_iterations_caps_tool_rounds_per_trajectory_as_trls_loop(k, tmp_path):
    """TRL runs at most k rounds of tool execution, each followed by one more generation; a tool call after the
    last round stays unexecuted and ends the completion."""
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, max_turns=None, max_tool_calling_iterations=k, num_branches=0)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    always_call = {"<|im_start|>assistant\n": [CALL_1_PLUS_1] * 20,
                   AFTER_TOOL: [CALL_1_PLUS_1] * 20}
    trainer.generation_engine = scripted_engine(tok, always_call)
    _, roots = trainer._prepare_roots([trainer.train_dataset[0]])
    leaves = [b for branches in trainer.sampler.sample(roots) for b in branches]
    assert leaves and all(b.tool_calls == k and len(b.turns) == k + 1 for b in leaves)


def _grpo_normalize_then_sum(rewards_per_func, weights, num_generations):
    """GRPOTrainer._generate_and_score_completions, multi_objective_aggregation="normalize_then_sum", up to the
    summed reward (TRL 1.16)."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    return (reward_k * weights.unsqueeze(0)).nansum(dim=1)


def test_multi_objective_aggregation_is_grpos_arithmetic_over_a_trees_leaves():
    rewards = torch.tensor([[1.0, 0.2], [0.0, float("nan")], [1.0, 0.9], [0.0, 0.4]])
    weights = torch.tensor([1.0, 0.5])
    expected = _grpo_normalize_then_sum(rewards, weights, num_generations=4)
    torch.testing.assert_close(scoring.aggregate_leaf_rewards(rewards, weights, "normalize_then_sum"), expected)
    torch.testing.assert_close(scoring.aggregate_leaf_rewards(rewards, weights, "sum_then_normalize"),
                               torch.tensor([1.1, 0.0, 1.45, 0.2]))


def test_the_trainer_scores_leaves_with_the_configured_aggregation(tmp_path):
    from tests.scripted import REPLIES

    def short(completions, **kwargs):
        return [1.0 / len(c[-1]["content"]) for c in completions]

    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 2.0])
    trainer = TreeOPSDTrainer(model=model, reward_funcs=[contains_answer, short], args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, REPLIES)
    captured = {}
    original = trainer.turn_credit
    trainer.turn_credit = lambda tree: captured.setdefault("tree", tree) and original(tree)
    score = trainer._score_leaves
    trainer._score_leaves = lambda *args: captured.setdefault("scores", score(*args))
    trainer.generate_batch([trainer.train_dataset[0]])
    per_func = captured["scores"].per_func
    expected = _grpo_normalize_then_sum(per_func, torch.tensor([1.0, 2.0]), num_generations=per_func.shape[0])
    assert captured["tree"].rewards == pytest.approx(expected.tolist())


def test_a_micro_batch_of_only_truncated_turns_trains_to_a_zero_loss(tmp_path):
    """mask_truncated_completions: when every turn was cut by the budget nothing is trained, and the step runs (GRPO
    gives an all-masked batch a zero loss that still has a grad_fn)."""
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, mask_truncated_completions=True, max_completion_length=12)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    rambling = "The answer is 2. " + "blah " * 40
    trainer.generation_engine = scripted_engine(tok, {"<|im_start|>assistant\n": [rambling] * 8})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert result.training_loss == 0.0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize(("G", "expected"), [(8, (4, 2)), (3, (2, 1)), (5, (2, 3)), (7, (2, 5)), (2, (1, 2))])
def test_num_generations_alone_chooses_an_m_and_n_that_reach_it(G, expected, tmp_path, caplog):
    """G alone (M and N unset): the preset's N when some M reaches G with it, else the nearest N ≥ 1 that does
    (among equally near ones, one whose budget is exactly G), said at start-up; GRPOConfig accepts every one."""
    GRPOConfig(output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=G, **CPU)
    with caplog.at_level("INFO", logger="trl_tree.trainer.configuration.fields"):
        args = TreeOPSDConfig(output_dir=str(tmp_path), num_generations=G, **CPU)
    assert (args.num_initial_rollouts, args.num_branches) == expected and args.num_generations == G
    assert tree_budget.num_generations_of(args) == G and args.leaves_per_tree >= 2
    said = f"num_generations={G} → M={expected[0]}, N={expected[1]}" in caplog.text
    assert said is (expected[1] != 2)  # only a changed N is news


def test_a_user_given_n_or_an_unreachable_g_keeps_the_error_listing_what_works(tmp_path):
    with pytest.raises(ValueError, match=r"num_generations=3 .*Settings that give G = 3: .*num_initial_rollouts=2, num_branches=1;"):
        TreeOPSDConfig(output_dir=str(tmp_path), num_generations=3, num_branches=2, **CPU)
    with pytest.raises(ValueError, match=r"num_generations=4 .*num_initial_rollouts=4, num_branches=0"):
        TreeOPSDConfig(output_dir=str(tmp_path), num_generations=4, num_branches=1, **CPU)
    with pytest.raises(ValueError, match="No setting of num_initial_rollouts gives G = 1"):
        TreeOPSDConfig(output_dir=str(tmp_path), num_generations=1, **CPU)
    # neither G nor N set: the preset's N, as documented
    assert TreeOPSDConfig(output_dir=str(tmp_path), **CPU).num_branches == 2
    assert TreeOPSDConfig.num_generations_for() == 8


@pytest.mark.parametrize("G", [2, 4, 8, 3, 6, 16])
def test_an_unset_batch_size_trains_grpos_prompts_per_step(G, tmp_path):
    """TRL's agent examples set num_generations=4 and leave the batch size alone: GRPO then trains 8 / G = 2 prompts
    per step, and so must a tree config (each prompt one tree). Where GRPO's default 8 fails GRPO's own check (G does
    not divide 8), the tree config trains one tree per micro-batch."""
    fields = dict(num_generations=G)
    args = TreeOPSDConfig(output_dir=str(tmp_path), **fields, **CPU)
    if 8 % G == 0:
        grpo = GRPOConfig(output_dir=str(tmp_path), num_generations=G, **CPU)
        assert args.per_device_train_batch_size == grpo.per_device_train_batch_size == 8
        assert args.prompts_per_generation == grpo.generation_batch_size // G == 8 // G
    else:
        with pytest.raises(ValueError):
            GRPOConfig(output_dir=str(tmp_path), num_generations=G, **CPU)
        assert args.per_device_train_batch_size == G and args.trees_per_micro_batch == 1


@pytest.mark.parametrize("config_cls", [TreeOPSDConfig, TreePOConfig, AT2POConfig, TreeAdvConfig])
def test_every_tree_method_budgets_grpos_default_g_when_nothing_is_set(config_cls, tmp_path):
    assert config_cls(output_dir=str(tmp_path), **CPU).num_generations == GRPOConfig(
        output_dir=str(tmp_path), **CPU).num_generations == 8


def test_an_unreachable_at2po_g_lists_expansion_settings_that_reach_it_and_each_works(tmp_path):
    """G = 4 cannot be reached with AT2PO's L = 2 rounds of K = 6 branches (already 6 trajectories): the error lists
    (M, L, K) that cost exactly G = 4, as init-expand's lists (M, N), and each listed setting builds with G = 4."""
    with pytest.raises(ValueError, match="Settings that give G = 4: ") as error:
        AT2POConfig(output_dir=str(tmp_path), num_generations=4, **CPU)
    listed = str(error.value).split("Settings that give G = 4: ")[1].split(". Set those")[0].split("; ")
    settings = [dict((k, int(v)) for k, v in (kv.split("=") for kv in option.split(", ")))
                for option in listed if option != "and more"]
    assert settings and all(set(s) == {"num_initial_rollouts", "expansion_rounds", "branches_per_round"}
                            for s in settings)
    for setting in settings:
        assert AT2POConfig(output_dir=str(tmp_path), num_generations=4, **setting, **CPU).num_generations == 4


@pytest.mark.parametrize(("fields", "expected"), [
    # TRL's test_training_num_generations_larger_than_batch_size: a group of 6 spans two micro-batches of 3
    (dict(num_generations=6, per_device_train_batch_size=3, gradient_accumulation_steps=2), (6, 1, 1)),
    (dict(num_generations=6, per_device_train_batch_size=3, steps_per_generation=4, gradient_accumulation_steps=2),
     (6, 1, 2)),
])
def test_a_group_wider_than_the_micro_batch_trains_grpos_prompts_per_step_one_whole_tree_each(
        fields, expected, tmp_path, caplog):
    """GRPO lets a group of G completions span micro-batches when the optimizer step and the generation batch hold
    whole groups. A tree is trained in one forward, so the config trains one whole tree per micro-batch with
    proportionally less accumulation: the same prompts per optimizer step and per generation batch, said at start-up."""
    grpo = GRPOConfig(output_dir=str(tmp_path), **fields, **CPU)
    with caplog.at_level("WARNING", logger="trl_tree.trainer.configuration.fields"):
        args = TreeOPSDConfig(output_dir=str(tmp_path), **fields, **CPU)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == expected
    assert "a tree cannot be split" in caplog.text
    assert args.generation_batch_size == grpo.generation_batch_size
    G = fields["num_generations"]
    assert (args.trees_per_micro_batch * args.gradient_accumulation_steps
            == grpo.per_device_train_batch_size * grpo.gradient_accumulation_steps // G)
    assert (args.steps_per_generation // args.gradient_accumulation_steps
            == grpo.steps_per_generation // grpo.gradient_accumulation_steps)  # optimizer steps per generation batch


def test_a_micro_batch_holding_part_of_a_group_that_grpo_refuses_too_is_an_error(tmp_path):
    """A generation batch of 3 × 1 completions is half a group: GRPO refuses it, and so does the tree config."""
    with pytest.raises(ValueError):
        GRPOConfig(output_dir=str(tmp_path), num_generations=6, per_device_train_batch_size=3, **CPU)
    with pytest.raises(ValueError, match="must be a multiple of num_generations"):
        TreeOPSDConfig(output_dir=str(tmp_path), num_generations=6, per_device_train_batch_size=3, **CPU)


def _by_length(completions, **kwargs):
    return [float(len(c[-1]["content"] or "")) for c in completions]


def test_every_trajectory_truncated_after_a_tool_call_trains_nothing_as_in_grpo(tmp_path):
    """GRPO masks every token of a truncated completion, so a batch of only truncated completions has loss 0 and no
    gradient even when the rewards differ. A tree's complete tool-call turn that lies only on truncated trajectories
    is such a token too: it gets no credit from them and trains nothing."""
    model, tok = tiny()
    args = config(TreeOPSDConfig, tmp_path, mask_truncated_completions=True, max_completion_length=60)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=_by_length, args=args,
                              train_dataset=arithmetic_dataset(1), processing_class=tok, tools=[calculator])
    rambling = [(word + " ") * 80 for word in ["a", "blah", "elephant", "xy", "octopus", "b", "dog", "zebra"]]
    trainer.generation_engine = scripted_engine(tok, {"<|im_start|>assistant\n": [CALL_1_PLUS_1] * 8,
                                                      AFTER_TOOL: rambling})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert trainer.state.log_history[0]["reward_std"] > 0  # the rewards differ: a zero loss is the mask's doing
    assert result.training_loss == 0.0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_turn_shared_with_a_finished_trajectory_still_trains():
    """Only the turns that lie on truncated trajectories alone are masked: GRPO would train the shared tokens through
    the finished completion."""
    from trl_tree.core.packing import pack_trees
    from trl_tree.core.tree import RolloutTree, Turn
    from trl_tree.core.tree_unit import mask_truncated_turns

    def turn(ids, truncated=False):
        return Turn(ids, [0.0] * len(ids), [9], truncated=truncated)

    shared, only_truncated = turn([1, 2]), turn([3, 4])
    trajectories = [[shared, turn([5], truncated=True)], [shared, turn([6])],
                    [only_truncated, turn([7], truncated=True)], [only_truncated, turn([8, 8], truncated=True)]]
    tree = RolloutTree.from_trajectories([0], trajectories, [0.0, 1.0, 2.0, 3.0])
    packed = pack_trees([tree], pad_token_id=0)
    mask_truncated_turns(packed, [tree])
    trained = {tree.turns[i].action_ids[0] for i in packed.turn_ids.unique().tolist() if i >= 0}
    assert trained == {1, 6}


@pytest.mark.parametrize("kwargs", [dict(num_beams=2), dict(num_return_sequences=2), dict(num_beams=4, do_sample=True)])
def test_generation_kwargs_that_return_other_than_one_sample_per_prefix_are_rejected_up_front(tmp_path, kwargs):
    """Beam search (or several sequences per prefix) returns something other than one sampled continuation per
    prefix, which the tree sampler's bookkeeping (and the prefix store) needs."""
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"generation_kwargs {name}={kwargs[name]}.*one sampled sequence per prefix"):
        TreeOPSDConfig(output_dir=str(tmp_path), generation_kwargs=kwargs, **CPU)
    # greedy decoding and the usual sampling knobs stay legitimate
    assert TreeOPSDConfig(output_dir=str(tmp_path), generation_kwargs=dict(do_sample=False, num_beams=1, top_k=5), **CPU)



def _long_prompt_trainer(tmp_path, max_positions: int, words: int, **overrides):
    """A scripted trainer whose model claims `max_positions` positions, on one prompt of about `words` tokens."""
    model, tok = tiny()
    model.config.max_position_embeddings = max_positions
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "one " * words}]], "answer": ["2"]})
    args = config(TreeOPSDConfig, tmp_path, **overrides)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=dataset,
                              processing_class=tok, tools=[calculator])
    trainer.generation_engine = scripted_engine(tok, {"": ["The answer is 2."] * 8})
    return trainer


def test_a_prompt_longer_than_the_models_positions_is_an_error_naming_both_lengths(tmp_path):
    """TRL 1.16's GRPOConfig has no max_prompt_length (nothing truncates a prompt), and generate would run past the
    model's positions without a word: the batch that holds such a prompt stops with both lengths and what to do (the
    trainer refuses such a row of its dataset when it is built, tests/test_prompt_lengths.py; the batch check is what
    catches a streaming dataset's or an environment's prompt)."""
    assert "max_prompt_length" not in {f.name for f in __import__("dataclasses").fields(GRPOConfig)}
    trainer = _long_prompt_trainer(tmp_path, max_positions=4096, words=300, max_completion_length=16)
    trainer.model.config.max_position_embeddings = 256  # after the build-time check of the dataset
    prompt_len = len(trl_internals.tokenize_prompts(trainer, [trainer.train_dataset[0]["prompt"]])[0][0])
    assert prompt_len > 256
    with pytest.raises(ValueError, match=rf"{prompt_len} tokens.*max_position_embeddings = 256.*(shorten|filter)"):
        trainer.generate_batch([trainer.train_dataset[0]])


def test_a_completion_budget_that_cannot_fit_the_positions_warns_once(tmp_path, caplog):
    """max_completion_length ≥ the model's positions: no prompt leaves room for it, said at start-up; a prompt that
    fits but leaves less than max_completion_length is said once, at the first batch that has one."""
    # (its one prompt, tool schema included, does not fit 64 positions either: refused when the trainer is built)
    with caplog.at_level("WARNING", logger="trl_tree.trainer.prompts"), pytest.raises(ValueError, match="row 0"):
        _long_prompt_trainer(tmp_path, max_positions=64, words=1, max_completion_length=96)
    assert "max_completion_length (96)" in caplog.text and "max_position_embeddings (64)" in caplog.text
    caplog.clear()
    trainer = _long_prompt_trainer(tmp_path, max_positions=4096, words=20, max_completion_length=96)
    assert "max_completion_length" not in caplog.text  # 96 < 4096: fine at start-up
    prompt_len = len(trl_internals.tokenize_prompts(trainer, [trainer.train_dataset[0]["prompt"]])[0][0])
    trainer.model.config.max_position_embeddings = prompt_len + 50  # fits, but not with 96 more tokens
    with caplog.at_level("WARNING", logger="trl_tree.trainer.prompts"):
        trainer.generate_batch([trainer.train_dataset[0]])
        trainer.generate_batch([trainer.train_dataset[0]])
    assert caplog.text.count("leaves fewer than max_completion_length") == 1


@pytest.mark.parametrize(
    "cls, fields, named",
    [
        # the probe that died of MemoryError after 88 s: K = M(N + 1) = 100 010 000 leaves
        (TreeOPSDConfig, dict(num_initial_rollouts=10_000, num_branches=10_000),
         ["num_initial_rollouts=10000, num_branches=10000", "K = 100,010,000 leaves", "M(1 + N/2) = 5.001e+07",
          "100,010,000 × max_completion_length 512 = 51,205,120,000 tokens", "more than the 4096 leaves",
          "4.7 TiB", "Lower num_initial_rollouts or num_branches"]),
        # few leaves, but a token budget per leaf that no tree could hold
        (TreeOPSDConfig, dict(num_initial_rollouts=16, num_branches=3, max_completion_length=2**19),
         ["K = 64 leaves", "64 × max_completion_length 524288 = 33,554,432 tokens", "2^24 = 16,777,216 tokens",
          "3.1 GiB", "or max_completion_length"]),
        (AT2POConfig, dict(num_initial_rollouts=2, expansion_rounds=100, branches_per_round=100),
         ["expansion_rounds=100, branches_per_round=100", "K = 10,002 leaves", "= 5,002 trajectories",
          "Lower num_initial_rollouts or expansion_rounds or branches_per_round"]),
        # TreeFlex: each of the K searches has max_blocks blocks of max_completion_length each
        (TreeFlexConfig, dict(num_searches=64, max_blocks=8, max_completion_length=2**16),
         ["num_searches=64", "64 × max_completion_length 65536 × max_blocks 8 = 33,554,432 tokens",
          "or max_completion_length or max_blocks"]),
        # G alone: refused before the budget arithmetic searches for an (M, N) that costs it
        (TreeOPSDConfig, dict(num_generations=10**8 + 1),
         ["num_generations=100,000,001", "at least K = 100,000,001 leaves", "Lower num_generations"]),
    ],
    ids=["M=N=10000", "long-leaves", "at2po", "treeflex", "huge-G"],
)
def test_a_tree_too_big_for_memory_is_refused_up_front_with_its_estimate(tmp_path, cls, fields, named):
    """Every sampler's tree is sized by one check (`tree_budget.check_tree_size`) when the config is built, before any
    model or generation: the error names the fields and their values, K, the trajectories of budget, the token
    bound with its arithmetic, the host memory it implies at the least, and what to lower."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match="too large to hold") as error:
        cls(output_dir=str(tmp_path), **fields, **CPU)
    assert time.perf_counter() - started < 30  # not the 88 s to a MemoryError, nor a search over G's splits
    message = str(error.value)
    for part in named:
        assert part in message, (part, message)
    assert "keys and values" in message and "KB" in message  # what the model adds per token, with an example


def test_trees_up_to_the_bounds_and_the_recipes_trees_are_accepted(tmp_path):
    """The bounds are inclusive, and far above real trees: the paper's Qwen3-4B recipe (K = 12 leaves of 6,144
    tokens), a G at half the leaf bound, and every method's defaults pass."""
    assert TreeOPSDConfig(output_dir=str(tmp_path), num_initial_rollouts=64, num_branches=63, **CPU)  # K = 4096
    assert TreeOPSDConfig(output_dir=str(tmp_path), num_initial_rollouts=2, num_branches=1,
                          max_completion_length=2**22, **CPU)  # 4 × 2^22 = 2^24 tokens
    assert TreeOPSDConfig(output_dir=str(tmp_path), num_initial_rollouts=4, num_branches=2,
                          max_completion_length=6144, num_generations=8, **CPU)
    assert TreeOPSDConfig(output_dir=str(tmp_path), num_generations=tree_budget.MAX_LEAVES_PER_TREE // 2, **CPU)
    for cls in (AT2POConfig, TreeAdvConfig, TreeFlexConfig, TreePOConfig):
        assert cls(output_dir=str(tmp_path), **CPU)


def test_every_samplers_leaves_are_at_least_its_cost_in_trajectories():
    """Why a G past the leaf bound can be refused before M or N is derived from it: K ≥ the trajectories of budget
    for every sampler and setting (a continuation costs half a trajectory and adds a leaf)."""
    values = range(0, 6)
    for name, sampler in methods.SAMPLERS.items():
        for m, n, rounds, per_round, b in itertools.product(range(1, 5), values, values, values, values):
            args = SimpleNamespace(sampler=name, num_initial_rollouts=m, num_branches=n, expansion_rounds=rounds,
                                   branches_per_round=per_round, max_branches_per_tree=b, num_searches=m + 1)
            assert sampler.leaves(args) >= sampler.budget(args), (name, vars(args))
