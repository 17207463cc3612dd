"""Model cards for models trained with the tree trainers.

TRL writes a card (``README.md`` in ``output_dir``) whenever a trainer saves a checkpoint or pushes to the Hub, from
its template and the trainer's ``_name``, ``_paper`` and ``_tag_names``. That card says which method trained the model
but not with which tree, and a tree-trained model is not reproducible without its tree: the number of initial
rollouts M, the branches N per rollout, the teacher radius ρ, the optimizer blocks E per generation batch and the turn
limit. So the tree trainers keep TRL's card (metadata, quick start, framework versions, the method's and TRL's
citations) and add a section with those hyperparameters, the dataset, and trl-tree itself.

Wiring (one line in ``TreeTrainer``'s class body)::

    create_model_card = model_card.create_tree_model_card
"""

from __future__ import annotations

import os
import re

TRL_TREE_NAME = "trl-tree"

# (config attribute, label in the card, when it applies). A tree trainer is a sampler x credit x loss choice
# (`TreeConfig.sampler/credit/loss`); only the fields the chosen components read are listed, so a card never shows,
# say, a teacher radius for a loss without a teacher. A config without those fields gets every row it has.
_TREE_FIELDS = (
    ("sampler", "how the tree is grown", None),
    ("credit", "how terminal rewards become turn credit", None),
    ("loss", "turn-level loss", None),
    ("num_initial_rollouts", "M: complete trajectories sampled per prompt", None),
    ("num_branches", "N: continuations branched from each trajectory", ("sampler", {"init_expand"})),
    ("anchor_rule", "branch points", ("sampler", {"init_expand"})),
    ("expansion_rounds", "L: entropy-guided expansion rounds", ("sampler", {"entropy_guided"})),
    ("branches_per_round", "K: branches added per expansion round", ("sampler", {"entropy_guided"})),
    ("entropy_threshold", "τ_H: branch inside turns above this token entropy", ("sampler", {"token_entropy"})),
    ("target_radius", "ρ: teacher radius, q ∈ [1/2 − ρ, 1/2 + ρ]", ("loss", {"treeopsd"})),
    ("num_optimizer_blocks", "E: sequential optimizer blocks per generation batch", None),
    ("max_turns", "assistant turns per trajectory (final answer included)", None),
    ("packing", "training layout of a tree", None),
)
_RUN_FIELDS = (
    ("generation_batch_size", "prompts (trees) per generation batch, all processes", None),
    ("learning_rate", "learning rate", None),
    ("lr_scheduler_type", "learning-rate schedule", None),
    ("max_steps", "optimizer steps", None),
    ("max_completion_length", "token budget of one trajectory", None),
    ("max_observation_chars", "characters kept of a tool observation", None),
    ("temperature", "sampling temperature", None),
    ("top_p", "sampling top-p", None),
)
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _trl_tree_version() -> str:
    from trl_tree import __version__

    return __version__


def _applies(args, condition) -> bool:
    if condition is None:
        return True
    component, choices = condition
    if not hasattr(args, component):  # a config that predates the component fields: show what it has
        return not (component == "loss" and "treepo" in type(args).__name__.lower())
    return getattr(args, component) in choices


def _rows(args, fields) -> list[str]:
    rows = []
    for name, label, condition in fields:
        value = getattr(args, name, None)
        if value is None or not _applies(args, condition):
            continue
        if isinstance(value, float):
            value = f"{value:g}"
        value = getattr(value, "value", value)  # enums (lr_scheduler_type) as their plain value
        rows.append(f"| `{name}` | {value} | {label} |")
    return rows


def tree_section(trainer, dataset_name: str | None = None) -> str:
    """The card section that records how the model was trained: method, trl-tree, tree and run hyperparameters."""
    args = trainer.args
    name = getattr(trainer, "_name", type(trainer).__name__)
    paper = getattr(trainer, "_paper", {}) or {}
    lines = ["## Tree-structured training", ""]
    intro = f"This model was trained with **{name}** in {TRL_TREE_NAME} {_trl_tree_version()}"
    intro += ", tree-structured agentic RL on top of TRL's `GRPOTrainer`"
    if paper.get("id"):
        intro += f" (paper: [arXiv:{paper['id']}](https://arxiv.org/abs/{paper['id']}))"
    lines += [intro + ".", ""]
    if dataset_name:
        hub_link = f"[{dataset_name}](https://huggingface.co/datasets/{dataset_name})"
        link = hub_link if _is_hub_id(dataset_name) else f"`{dataset_name}`"
        lines += [f"Training data: {link}.", ""]
    M, N = getattr(args, "num_initial_rollouts", None), getattr(args, "num_branches", None)
    if M is not None and N is not None and getattr(args, "sampler", "init_expand") == "init_expand":
        lines += [
            f"Each prompt grows one rollout tree: M = {M} complete multi-turn trajectories, then N = {N} "
            f"continuations of each from uniformly drawn turn prefixes, K = M(N + 1) = {M * (N + 1)} leaves; "
            "shared turns are merged and trained once.",
            "",
        ]
    lines += ["| hyperparameter | value | meaning |", "|---|---|---|"]
    lines += _rows(args, _TREE_FIELDS) + _rows(args, _RUN_FIELDS)
    return "\n".join(lines) + "\n"


def _is_hub_id(name: str) -> bool:
    """A Hub dataset id (``owner/name``) that is not a local path: only those get a Hub link and card metadata."""
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def tree_model_card_text(
    trainer, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
) -> str:
    """The model card of a tree trainer, as markdown with YAML metadata: TRL's card plus :func:`tree_section`.

    Mirrors ``trl.trainer.base_trainer._BaseTrainer.create_model_card`` (base model, tags, experiment-tracker links,
    the method's citation from ``trainer._paper``) so the card stays what TRL users expect, then inserts the tree
    section before "Framework versions" and lists trl-tree's version there.
    """
    from trl.trainer.utils import (
        generate_model_card,
        get_comet_experiment_url,
        get_config_model_id,
        get_trackio_space_url,
    )

    model_id = get_config_model_id(trainer.model.config)
    base_model = model_id if model_id and not os.path.isdir(model_id) else None
    tags = set() if tags is None else {tags} if isinstance(tags, str) else set(tags)
    tags.update(getattr(trainer, "_tag_names", []))
    tags.add(TRL_TREE_NAME)
    trackio_url = get_trackio_space_url()
    if trackio_url is not None:
        tags = {t for t in tags if not t.startswith("trackio:")} | {f"trackio:{trackio_url}"}
    wandb_url = None
    try:
        import wandb

        wandb_url = wandb.run.url if wandb.run is not None else None
    except ImportError:
        pass
    if model_name is None:
        hub_id = getattr(trainer.args, "hub_model_id", None)
        model_name = hub_id.split("/")[-1] if hub_id else os.path.basename(os.path.normpath(trainer.args.output_dir))
    paper = getattr(trainer, "_paper", {}) or {}
    card = generate_model_card(
        base_model=base_model,
        model_name=model_name,
        hub_model_id=getattr(trainer, "hub_model_id", None),
        dataset_name=dataset_name if dataset_name and _is_hub_id(dataset_name) else None,
        tags=sorted(tags),
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=get_comet_experiment_url(),
        trainer_name=getattr(trainer, "_name", type(trainer).__name__),
        trainer_citation=paper.get("citation"),
        template_file=getattr(trainer, "_template_file", None),
        paper_title=paper.get("title"),
        paper_id=paper.get("id"),
    )
    text = str(card)
    section = tree_section(trainer, dataset_name)
    marker = "### Framework versions\n\n"
    if marker in text:
        text = text.replace(marker, f"{section}\n{marker}- {TRL_TREE_NAME}: {_trl_tree_version()}\n", 1)
    else:  # a custom template without that heading: append
        text = text.rstrip() + "\n\n" + section
    return text


def create_tree_model_card(
    trainer, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
) -> None:
    """Drop-in for ``Trainer.create_model_card``: write :func:`tree_model_card_text` to ``output_dir/README.md``.

    Same signature and behaviour as TRL's (only the main process writes), so ``save_model`` checkpoints and
    ``push_to_hub`` (which writes the card, then uploads ``output_dir``) carry the tree card.
    """
    if not trainer.is_world_process_zero():
        return
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(os.path.join(trainer.args.output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(tree_model_card_text(trainer, model_name=model_name, dataset_name=dataset_name, tags=tags))
