"""The named methods: presets of a sampler, credit and loss with their own config and trainer classes."""

from __future__ import annotations

from .registry import Method, Paper, register_method

# TreeOPSD and its control TreePO come from one paper: both cards cite it
TREEOPSD_PAPER = Paper(
    title="Tree-Aware Posterior Distillation for Long-Horizon Agentic Reinforcement Learning",  # the paper's own
    id="2610.23181",
    citation=(
        "@article{zou2026treeopsd,\n"
        "    title   = {{Tree-Aware Posterior Distillation for Long-Horizon Agentic Reinforcement Learning}},\n"
        "    author  = {Heming Zou and others},\n"
        "    year    = 2026,\n"
        "    eprint  = {arXiv:2610.23181},\n"
        "}"
    ),
)
# why `trl-tree treeflex` runs only the generic script (`Method.example_unfit`)
_TREEFLEX_NOT_THE_EXAMPLE = (
    "TreeFlex trains a two-role agent (a Reflection block without tools, then Execution segments restarting from "
    "checkpoint cards), while the HotpotQA example's warm start teaches, and its before/after evaluation measures, "
    "the single-role tool loop of the other methods, so its EM/F1 would not measure what TreeFlex trained. Name a "
    "reward (--reward_funcs or --reward_model_name_or_path), with --tools or --environment_factory for tool use, to "
    "run the generic script on your data, or use TreeFlexTrainer from Python"
)

register_method(
    Method(
        "treeopsd",
        "TreeOPSD",
        "trl_tree.trainer.configuration.fields:TreeOPSDConfig",
        "trl_tree.trainer.presets.treeopsd:TreeOPSDTrainer",
        "init_expand",
        "likelihood",
        "treeopsd",
        "tree rollouts, likelihood-weighted turn credit, turn-level Bernoulli forward-KL to a bounded teacher",
        paper=TREEOPSD_PAPER,
    )
)
register_method(
    Method(
        "treepo",
        "TreePO",
        "trl_tree.trainer.configuration.fields:TreePOConfig",
        "trl_tree.trainer.presets.treepo:TreePOTrainer",
        "init_expand",
        "likelihood",
        "treepo",
        "TreeOPSD's trees and credit with the fixed-credit surrogate",
        paper=TREEOPSD_PAPER,
    )
)
register_method(
    Method(
        "at2po",
        "AT2PO",
        "trl_tree.trainer.configuration.fields:AT2POConfig",
        "trl_tree.trainer.presets.at2po:AT2POTrainer",
        "entropy_guided",
        "child_softmax",
        "atpo",
        "entropy-guided expansion, turn credit, the ATPO loss",
    )
)
register_method(
    Method(
        "treeadv",
        "TreeAdv",
        "trl_tree.trainer.configuration.fields:TreeAdvConfig",
        "trl_tree.trainer.presets.treeadv:TreeAdvTrainer",
        "token_entropy",
        "leaf_mean",
        "grpo",
        "branching at high-entropy tokens, segment advantages, GRPO or GSPO-token",
    )
)
register_method(
    Method(
        "treeflex",
        "TreeFlex",
        "trl_tree.trainer.configuration.fields:TreeFlexConfig",
        "trl_tree.trainer.presets.treeflex:TreeFlexTrainer",
        "two_role",
        "search",
        "dual_clip",
        "complete searches of causal blocks as group members, turn penalties, dual clip",
        example_unfit=_TREEFLEX_NOT_THE_EXAMPLE,
    )
)

# the generic trainer every method is a preset of (`TreeConfig(sampler=..., credit=..., loss=...)`)
