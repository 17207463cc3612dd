"""The model card of a tree-trained model records the method, the tree, the data and the paper; push_to_hub uploads it.

Offline: the Hub API is replaced by a recorder (no network).
"""

import re
import types

from tests.scripted import arithmetic_dataset, config, contains_answer, tiny
from trl_tree import TreeFlexConfig, TreeFlexTrainer, TreeOPSDConfig, TreeOPSDTrainer, TreePOConfig, TreePOTrainer
from trl_tree.testing import calculator
from trl_tree.trainer.base import TreeTrainer
from trl_tree.trainer.observability.model_card import create_tree_model_card, tree_model_card_text


class CardTreeOPSDTrainer(TreeOPSDTrainer):
    """TreeOPSDTrainer with the card hook wired, as `TreeTrainer` is meant to have it."""

    create_model_card = create_tree_model_card


def _trainer(cls, config_cls, tmp_path, **overrides):
    model, tok = tiny()
    args = config(
        config_cls,
        tmp_path,
        num_initial_rollouts=4,
        num_branches=2,
        target_radius=0.2,
        max_turns=5,
        steps_per_generation=4,
        **overrides,
    )
    return cls(
        model=model,
        reward_funcs=contains_answer,
        args=args,
        train_dataset=arithmetic_dataset(4),
        processing_class=tok,
        tools=[calculator],
    )


# The rows only TreeFlex has: its group of complete searches, harness, process penalties, aggregation and dual clip.
TREEFLEX_FIELDS = (
    "num_searches", "max_blocks", "max_card_chars", "penalty_mode", "tool_failure_penalty", "aggregation",
    "role_lambda", "dual_clip_c",
)  # fmt: skip


def _table(text):
    """`| `name` | value | meaning |` rows of the card as {name: value}."""
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", text, flags=re.MULTILINE))


def test_treeopsd_card_gives_method_tree_hyperparameters_dataset_and_paper(tmp_path):
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    text = tree_model_card_text(trainer, model_name="tiny-treeopsd", dataset_name="hotpotqa/hotpot_qa")
    assert text.startswith("---\n")  # Hub metadata first
    metadata = text.split("---\n")[1]
    assert "hotpotqa/hotpot_qa" in metadata and "trl-tree" in metadata and "treeopsd" in metadata
    assert "trained with **TreeOPSD** in trl-tree" in text
    assert "arXiv:2610.23181" in text and "https://huggingface.co/papers/2610.23181" in text
    assert "@article{zou2026treeopsd" in text  # TRL's citation block with the method's BibTeX
    assert "[hotpotqa/hotpot_qa](https://huggingface.co/datasets/hotpotqa/hotpot_qa)" in text
    rows = _table(text)
    assert rows["num_initial_rollouts"] == "4" and rows["num_branches"] == "2"
    assert rows["target_radius"] == "0.2" and rows["num_optimizer_blocks"] == "4" and rows["max_turns"] == "5"
    assert (rows["sampler"], rows["credit"], rows["loss"]) == ("init_expand", "likelihood", "treeopsd")
    assert "K = M(N + 1) = 12 leaves" in text
    assert rows["lr_scheduler_type"] == "linear"
    assert re.search(r"- trl-tree: \d", text)  # framework versions list trl-tree next to TRL
    assert text.index("## Training procedure") < text.index("### Tree-structured training")
    assert text.index("### Tree-structured training") < text.index("### Framework versions")


def test_treepo_card_names_treepo_and_has_no_teacher_radius(tmp_path):
    trainer = _trainer(TreePOTrainer, TreePOConfig, tmp_path)
    text = tree_model_card_text(trainer, dataset_name="synthetic")
    assert "trained with **TreePO**" in text and "target_radius" not in _table(text)
    assert _table(text)["loss"] == "treepo"
    assert "Training data: `synthetic`." in text  # not a Hub id: no dataset link, no card metadata
    assert "datasets:" not in text.split("---\n")[1]


def test_an_entropy_guided_tree_lists_its_own_sampler_fields_only(tmp_path):
    from trl_tree import AT2POConfig
    from trl_tree.trainer.observability.model_card import tree_section

    args = AT2POConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    rows = _table(tree_section(types.SimpleNamespace(args=args, _name="AT2PO")))
    assert rows["sampler"] == "entropy_guided" and "expansion_rounds" in rows and "branches_per_round" in rows
    assert "num_branches" not in rows and "target_radius" not in rows
    assert (rows["expansion_mode"], rows["sibling_penalty"], rows["reward_std"]) == ("entropy", "0.05", "population")
    assert rows["epsilon"] == "0.2"  # ATPO clips its per-turn ratio
    assert not {"entropy_threshold", "min_segment_length", *TREEFLEX_FIELDS} & set(rows)


def test_a_token_branching_forest_lists_its_branching_fields(tmp_path):
    from trl_tree import TreeAdvConfig
    from trl_tree.trainer.observability.model_card import tree_section

    args = TreeAdvConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", min_segment_length=5)
    text = tree_section(types.SimpleNamespace(args=args, _name="TreeAdv"))
    rows = _table(text)
    assert (rows["sampler"], rows["credit"], rows["loss"]) == ("token_entropy", "leaf_mean", "grpo")
    assert rows["entropy_threshold"] == "1" and rows["max_branches_per_tree"] == "2"
    assert rows["min_segment_length"] == "5" and rows["branching_rounds"] == "1"
    assert "at most 2 branch points per tree (1 to 3 leaves per tree, at most 12 per prompt)" in text
    assert not {"num_branches", "expansion_rounds", "sibling_penalty", "target_radius", *TREEFLEX_FIELDS} & set(rows)


def test_treeflex_card_lists_its_searches_penalties_aggregation_and_clip(tmp_path):
    model, tok = tiny()
    args = config(
        TreeFlexConfig, tmp_path, num_searches=3, max_blocks=5, penalty_mode="post_norm", aggregation="block",
        role_lambda=0.25, dual_clip_c=2.5, tool_failure_penalty=-0.5, epsilon_high=0.28, max_card_chars=800,
    )  # fmt: skip
    trainer = TreeFlexTrainer(
        model=model, reward_funcs=contains_answer, args=args, train_dataset=arithmetic_dataset(2),
        processing_class=tok, tools=[calculator],
    )  # fmt: skip
    text = tree_model_card_text(trainer, dataset_name="synthetic")
    rows = _table(text)
    assert "trained with **TreeFlex**" in text
    assert "a group of K = 3 complete searches, each of at most 5 causal blocks (one Reflection block" in text
    assert (rows["sampler"], rows["credit"], rows["loss"]) == ("two_role", "search", "dual_clip")
    assert (rows["num_searches"], rows["max_blocks"], rows["max_card_chars"]) == ("3", "5", "800")
    assert (rows["penalty_mode"], rows["tool_failure_penalty"]) == ("post_norm", "-0.5")
    assert (rows["aggregation"], rows["role_lambda"], rows["dual_clip_c"]) == ("block", "0.25", "2.5")
    assert (rows["epsilon"], rows["epsilon_high"]) == ("0.2", "0.28")
    assert "per Execution segment" in text and "token budget of one block" in text
    # the tree fields TreeFlex does not read stay out, even where the config holds a value (config() sets M and N)
    assert not {"num_initial_rollouts", "num_branches", "target_radius", "reward_std", "packing"} & set(rows)


def test_treeopsd_card_shows_no_treeflex_fields(tmp_path):
    text = tree_model_card_text(_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path))
    rows = _table(text)
    assert not set(TREEFLEX_FIELDS) & set(rows)
    assert "epsilon" not in rows  # the treeopsd loss has no clip
    assert "complete searches" not in text and "per Execution segment" not in text


def test_push_to_hub_uploads_the_folder_with_the_tree_card(tmp_path, monkeypatch):
    uploads = []

    class FakeHfApi:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, **kwargs):
            with open(f"{folder_path}/README.md") as f:
                uploads.append({"repo_id": repo_id, "readme": f.read(), **kwargs})
            return "https://huggingface.co/me/tiny-treeopsd"

    monkeypatch.setattr("transformers.trainer.hf_api", FakeHfApi)
    trainer = _trainer(CardTreeOPSDTrainer, TreeOPSDConfig, tmp_path, hub_model_id="me/tiny-treeopsd")
    trainer.push_to_hub(dataset_name="hotpotqa/hotpot_qa")
    (upload,) = uploads
    assert upload["repo_id"] == "me/tiny-treeopsd"
    assert "trained with **TreeOPSD** in trl-tree" in upload["readme"]
    assert _table(upload["readme"])["num_branches"] == "2"
    assert "hotpotqa/hotpot_qa" in upload["readme"]


def test_only_the_main_process_writes_the_card(tmp_path, monkeypatch):
    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)
    monkeypatch.setattr(trainer, "is_world_process_zero", lambda: False)
    create_tree_model_card(trainer)
    assert not (tmp_path / "README.md").exists()


def test_tree_trainers_use_the_tree_card():
    assert TreeTrainer.create_model_card is create_tree_model_card


# ---------------------------------------------------------------------------------------------------------------
# Base model, tools, rewards and a quick start that runs, for a model that does not come from the Hub
# ---------------------------------------------------------------------------------------------------------------


def _python_snippet(text):
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    return code


def test_a_local_model_card_names_its_folder_tools_and_rewards_and_its_quick_start_runs_offline(tmp_path):
    import os
    import subprocess
    import sys

    def format_reward(completions, **kwargs):
        return [0.0] * len(completions)

    model, tok = tiny()  # loaded from a local folder: config._name_or_path is a path, not a Hub id
    args = config(TreeOPSDConfig, tmp_path / "out", reward_weights=[1.0, 0.5])
    trainer = TreeOPSDTrainer(
        model=model, reward_funcs=[contains_answer, format_reward], args=args, train_dataset=arithmetic_dataset(2),
        processing_class=tok, tools=[calculator],
    )  # fmt: skip
    trainer.save_model()
    trainer.create_model_card()
    text = (tmp_path / "out" / "README.md").read_text()
    assert "[None]" not in text and 'model="None"' not in text
    assert "fine-tuned version of a local `qwen3` model (folder `tiny-qwen3-v1-seed0`)" in text
    assert "base_model" not in text.split("---\n")[1]  # no Hub id to put in the metadata
    assert "- `calculator`: Evaluates an arithmetic expression" in text
    assert "`contains_answer` (weight 1), `format_reward` (weight 0.5)" in text

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    code = _python_snippet(text).replace("max_new_tokens=128", "max_new_tokens=8")  # the tiny model babbles
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_base_model_is_the_hub_id_or_what_a_local_copy_records(tmp_path):
    import shutil

    from trl_tree.testing import tiny_model_path
    from trl_tree.trainer.observability.model_card import base_model_of

    model, _ = tiny()
    model.config._name_or_path = "Qwen/Qwen3-0.6B"  # as loaded from the Hub
    assert base_model_of(model) == ("Qwen/Qwen3-0.6B", "[Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B)")

    copy = shutil.copytree(tiny_model_path(), tmp_path / "my-finetune")  # a local fine-tune with its own card
    (copy / "README.md").write_text("---\nbase_model: Qwen/Qwen3-0.6B\n---\n\n# my fine-tune\n")
    model.config._name_or_path = str(copy)
    assert base_model_of(model)[0] == "Qwen/Qwen3-0.6B"
    (copy / "README.md").unlink()
    assert base_model_of(model) == (None, "a local `qwen3` model (folder `my-finetune`)")


# ---------------------------------------------------------------------------------------------------------------
# Issue 59: the paper's own title, a filled training procedure, the tools in the quick start, a LoRA adapter's card
# ---------------------------------------------------------------------------------------------------------------


def test_every_methods_paper_title_is_the_readmes_for_the_same_arxiv_id():
    """The card cited TreeOPSD's paper by a summary's title while the README (and the paper) say another: each
    method's paper is cited by the title the README's method table gives that arXiv id."""
    from pathlib import Path

    from trl_tree import methods

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    titles = dict((arxiv, title) for title, arxiv in re.findall(r"\*([^*|]+)\*, arXiv (\d{4}\.\d{5})", readme))
    papers = {m.paper.id: m.paper for m in methods.METHODS.values() if m.paper is not None}
    assert papers
    for arxiv, paper in papers.items():
        assert paper.title == titles[arxiv], arxiv
        assert f"title   = {{{{{paper.title}}}}}" in paper.citation


def _procedure(text):
    """The card's "Training procedure" section, up to its framework versions."""
    return text.split("## Training procedure", 1)[1].split("### Framework versions", 1)[0]


def test_the_training_procedure_names_sampler_credit_loss_and_key_settings(tmp_path):
    """Issue 59: "Training procedure" held one sentence; it now says what the run combined and how."""
    from trl_tree import methods

    trainer = _trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path, learning_rate=3e-6)
    procedure = _procedure(tree_model_card_text(trainer))
    for kind, name in (("sampler", "init_expand"), ("credit", "likelihood"), ("loss", "treeopsd")):
        entry = {"sampler": methods.SAMPLERS, "credit": methods.CREDITS, "loss": methods.LOSSES}[kind][name]
        assert f"- **{kind}** `{name}`: {entry.summary}" in procedure
    assert "learning rate 3e-06" in procedure and "E = 4 optimizer blocks per generation batch" in procedure
    assert "G = 8 trajectories of budget per prompt" in procedure and "at most 5 turns" in procedure
    assert "| `num_initial_rollouts` | 4 |" in procedure  # the whole table sits in the section too


def test_the_quick_start_of_a_tool_trained_model_renders_its_tools(tmp_path):
    """Issue 59: the quick start showed the model no tools, so it never saw the prompt it was trained on."""
    from transformers.utils import get_json_schema

    code = _python_snippet(tree_model_card_text(_trainer(TreeOPSDTrainer, TreeOPSDConfig, tmp_path)))
    assert "tools=tools" in code and "(calculator)" in code
    namespace = {}
    exec(code.split("question =", 1)[0].split("tools = ", 1)[1].join(["tools = ", ""]), namespace)  # noqa: S102
    assert namespace["tools"] == [get_json_schema(calculator)]


def test_a_lora_runs_card_says_it_is_an_adapter_on_which_base_and_its_quick_start_loads_it(tmp_path):
    """Issue 59: a LoRA run's folder is an adapter, yet its card read as a whole model's."""
    import os
    import subprocess
    import sys

    from peft import LoraConfig

    from trl_tree.testing import tiny_model_path

    model, tok = tiny()
    trainer = TreeOPSDTrainer(
        model=model, reward_funcs=contains_answer, args=config(TreeOPSDConfig, tmp_path / "out"),
        train_dataset=arithmetic_dataset(2), processing_class=tok, tools=[calculator],
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )  # fmt: skip
    trainer.save_model()
    trainer.create_model_card()
    text = (tmp_path / "out" / "README.md").read_text()
    assert "library_name: peft" in text.split("---\n")[1]
    base = tiny_model_path()
    assert f"This folder holds a PEFT (LoRA) adapter, not a whole model**: load it on its base model `{base}`" in text
    code = _python_snippet(text)
    assert "AutoPeftModelForCausalLM.from_pretrained(" in code
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code.replace("max_new_tokens=128", "max_new_tokens=8")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_full_model_without_tools_keeps_trls_quick_start(tmp_path):
    model, tok = tiny()
    trainer = TreeOPSDTrainer(
        model=model,
        reward_funcs=contains_answer,
        args=config(TreeOPSDConfig, tmp_path),
        train_dataset=arithmetic_dataset(2),
        processing_class=tok,
    )
    text = tree_model_card_text(trainer)
    assert 'pipeline("text-generation"' in _python_snippet(text) and "adapter" not in text
