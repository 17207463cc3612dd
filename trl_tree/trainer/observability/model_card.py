"""Model cards for models trained with the tree trainers.

TRL writes a card (``README.md`` in ``output_dir``) whenever a trainer saves a checkpoint or pushes to the Hub, from
its template and the trainer's ``_name``, ``_paper`` and ``_tag_names``. That card says which method trained the model
but not with which tree, and a tree-trained model is not reproducible without its tree: the number of initial
rollouts M, the branches N per rollout, the teacher radius ρ, the optimizer blocks E per generation batch and the turn
limit (for TreeFlex, which grows no tree: the group of K searches, the blocks per search, the process penalties, the
aggregation and the dual clip). So the tree trainers keep TRL's card (metadata, quick start, framework versions, the
method's and TRL's citations) and add a section with those hyperparameters, the dataset, the tools and reward
functions the model was trained with, and trl-tree itself.

The section sits inside TRL's "Training procedure" (which otherwise holds one sentence) and opens with the sampler,
credit and loss the run combined, in their registered entries' words, and its key settings.

What TRL's card gets wrong for these models is fixed: the base model of a model loaded from a local folder is named
from the folder (or from the folder's own card, when it records a Hub base model) instead of "[None]"; the quick-start
snippet loads the model from where this card lives (the Hub repository, else the output directory) instead of
`model="None"`; a model trained with tools gets a quick start that renders its prompt with those tools' schemas, as
training did (TRL's pipeline snippet shows the model none); and a PEFT (LoRA) run's card says its folder is an
adapter, on which base model to load it, and loads it so (issue 59).

Wiring (one line in ``TreeTrainer``'s class body)::

    create_model_card = model_card.create_tree_model_card
"""

from __future__ import annotations

import inspect
import json
import os
import re

TRL_TREE_NAME = "trl-tree"

# The card lists exactly the fields the configured sampler, credit and loss read, with the meanings the method table
# gives them (`trl_tree.methods`), so a card never shows, say, a teacher radius for a loss without a teacher.
_COMPONENT_LABELS = {
    "sampler": {
        "tree": "how the tree is grown",
        "group": "the rollout harness (complete searches made of causal blocks)",
    },
    "credit": {"tree": "how terminal rewards become turn credit", "group": "how terminal rewards become turn credit"},
    "loss": {"tree": "turn-level loss", "group": "turn-level loss"},
}
_BLOCKS_ROW = ("num_optimizer_blocks", "E: sequential optimizer blocks per generation batch")
_RUN_FIELDS = (
    ("num_generations", "G: rollout budget per prompt, in complete trajectories (a tree's expected cost)", None),
    ("prompts_per_generation", "prompts (trees) per generation batch, all processes", None),
    ("generation_batch_size", "trajectories of budget per generation batch, all processes (prompts × G)", None),
    ("learning_rate", "learning rate", None),
    ("lr_scheduler_type", "learning-rate schedule", None),
    ("max_steps", "optimizer steps", None),
    ("max_observation_chars", "characters kept of a tool observation", None),
    ("malformed_tool_calls", "after an unparseable tool call: error observation, or end the trajectory", None),
    ("temperature", "sampling temperature", None),
    ("top_p", "sampling top-p", None),
)
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# TRL's quick-start question, kept when the quick start is rewritten for tools or an adapter
_QUICK_START_QUESTION = (
    "If you had a time machine, but could only go to the past or the future once and never return, which would you "
    "choose and why?"
)
TREE_SECTION_HEADING = "### Tree-structured training"  # under TRL's "## Training procedure"


def _trl_tree_version() -> str:
    from trl_tree import __version__

    return __version__


def _tree_fields(args) -> list[tuple[str, str, None]]:
    """(field, meaning, None) rows of the configured components: their names, then the fields each reads."""
    from ...methods import components_of, fields_read

    sampler = components_of(args)[0]
    rows = [(kind, _COMPONENT_LABELS[kind][sampler.unit], None) for kind in ("sampler", "credit", "loss")]
    rows += [(name, meaning, None) for name, meaning in fields_read(args).items()]
    return rows + [(*_BLOCKS_ROW, None)]


def _rows(args, fields) -> list[str]:
    rows, seen = [], set()
    for name, label, _ in fields:
        value = getattr(args, name, None)
        if name in seen or value is None:
            continue
        seen.add(name)
        if isinstance(value, float):
            value = f"{value:g}"
        value = getattr(value, "value", value)  # enums (lr_scheduler_type) as their plain value
        rows.append(f"| `{name}` | {value} | {label} |")
    return rows


def _one_line(tool) -> str:
    """The first line of a tool's docstring (what the model read about it in the tool schema)."""
    doc = inspect.getdoc(tool) or ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "(no description)")


def tools_and_rewards(trainer) -> list[str]:
    """Card lines naming the tools (with their one-line descriptions) and the weighted reward functions."""
    lines = []
    tools = getattr(trainer, "tools", None) or []
    factories = getattr(trainer, "environment_factories", None) or {}
    if tools:
        lines += ["Tools the model was trained to call (pass the same tools to the chat template at inference):", ""]
        lines += [f"- `{getattr(t, '__name__', type(t).__name__)}`: {_one_line(t)}" for t in tools]
        lines += [""]
    if factories:
        names = ", ".join(f"`{getattr(f, '__name__', type(f).__name__)}`" for f in factories.values())
        lines += [f"Environments (`environment_factory`): {names}.", ""]
    names = getattr(trainer, "reward_func_names", None) or []
    if names:
        weights = getattr(trainer, "reward_weights", None)
        weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
        rewards = ", ".join(f"`{n}` (weight {w:g})" for n, w in zip(names, weights))
        lines += [f"Reward functions: {rewards}; a leaf's reward is their weighted sum.", ""]
    return lines


def procedure_lines(args) -> list[str]:
    """What the "Training procedure" section says first: the sampler, credit and loss the run combined, each in its
    registered entry's own words (`trl_tree.methods`), and the settings that most change what was trained."""
    from ...methods import components_of
    from ..configuration.tree_budget import num_generations_of

    sampler, credit, loss = components_of(args)
    lines = [
        f"- **sampler** `{sampler.name}`: {sampler.summary}",
        f"- **credit** `{credit.name}`: {credit.summary}",
        f"- **loss** `{loss.name}`: {loss.summary}",
    ]
    key = [
        f"learning rate {args.learning_rate:g}",
        f"G = {num_generations_of(args)} trajectories of budget per prompt",
    ]
    if getattr(args, "num_optimizer_blocks", None):
        key.append(f"E = {args.num_optimizer_blocks} optimizer blocks per generation batch")
    if getattr(args, "max_turns", None):
        key.append(f"at most {args.max_turns} turns")
    steps = args.max_steps
    key.append(f"{steps} optimizer step{'s' * (steps != 1)}" if steps > 0 else f"{args.num_train_epochs:g} epochs")
    return lines + [f"- **key settings**: {', '.join(key)} (every one in the table below)."]


def tree_section(trainer, dataset_name: str | None = None) -> str:
    """The card section that records how the model was trained: method, trl-tree, the sampler, credit and loss,
    tree and run hyperparameters. It sits inside TRL's "Training procedure" section, which otherwise holds one
    sentence."""
    args = trainer.args
    name = getattr(trainer, "_name", type(trainer).__name__)
    paper = getattr(trainer, "_paper", {}) or {}
    lines = [TREE_SECTION_HEADING, ""]
    intro = f"This model was trained with **{name}** in {TRL_TREE_NAME} {_trl_tree_version()}"
    intro += ", tree-structured agentic RL on top of TRL's `GRPOTrainer`"
    if paper.get("id"):
        intro += f" (paper: [arXiv:{paper['id']}](https://arxiv.org/abs/{paper['id']}))"
    lines += [intro + ".", ""]
    if getattr(args, "sampler", None) is not None:
        lines += [*procedure_lines(args), ""]
    if dataset_name:
        hub_link = f"[{dataset_name}](https://huggingface.co/datasets/{dataset_name})"
        link = hub_link if _is_hub_id(dataset_name) else f"`{dataset_name}`"
        lines += [f"Training data: {link}.", ""]
    sentence = _growth_sentence(trainer)
    if sentence:
        lines += [sentence, ""]
    lines += tools_and_rewards(trainer)
    lines += ["| hyperparameter | value | meaning |", "|---|---|---|"]
    lines += _rows(args, _tree_fields(args)) + _rows(args, _RUN_FIELDS)
    return "\n".join(lines) + "\n"


def _growth_sentence(trainer) -> str | None:
    """How a prompt's tree (or group) was grown, in the configured sampler's own words (`methods.Sampler.card`)."""
    from ...methods import SAMPLERS

    sampler = SAMPLERS.get(getattr(trainer.args, "sampler", None))
    return sampler.card(trainer.args, trainer) if sampler is not None else None


def _is_hub_id(name: str) -> bool:
    """A Hub dataset id (``owner/name``) that is not a local path: only those get a Hub link and card metadata."""
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def base_model_of(model) -> tuple[str | None, str]:
    """(Hub id for the card metadata, or None; how the card names the base model).

    As TRL does, the model's `config._name_or_path` is the base model when it is a Hub id. A model loaded from a local
    folder is named after the folder, unless the folder's own card (a model fine-tuned earlier and saved there)
    records a Hub base model, which is then the base model.
    """
    from trl.trainer.utils import get_config_model_id

    config = getattr(model, "config", None)
    name = get_config_model_id(config) if config is not None else ""
    if name and not os.path.isdir(name):
        return name, f"[{name}](https://huggingface.co/{name})"
    model_type = getattr(config, "model_type", None) or "transformers"
    if not name:
        return None, f"a `{model_type}` model built in code (no Hub id or folder recorded in its config)"
    recorded = _recorded_base_model(name)
    if recorded:
        return recorded, f"[{recorded}](https://huggingface.co/{recorded})"
    return None, f"a local `{model_type}` model (folder `{os.path.basename(os.path.normpath(name))}`)"


def _recorded_base_model(folder: str) -> str | None:
    """The Hub base model that the folder's README.md metadata records, if any (read offline)."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme):
        return None
    try:
        from huggingface_hub import ModelCard

        base = ModelCard.load(readme).data.base_model
    except Exception:  # a README without valid metadata names nothing
        return None
    base = base[0] if isinstance(base, list) and base else base
    return base if isinstance(base, str) and base and not os.path.exists(base) else None


def usage_model_id(trainer) -> str:
    """What the quick-start snippet loads: the Hub repository the model is pushed to, else its output directory."""
    return (
        getattr(trainer, "hub_model_id", None)
        or getattr(trainer.args, "hub_model_id", None)
        or trainer.args.output_dir
    )


def tree_model_card_text(
    trainer, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
) -> str:
    """The model card of a tree trainer, as markdown with YAML metadata: TRL's card plus :func:`tree_section`.

    Mirrors ``trl.trainer.base_trainer._BaseTrainer.create_model_card`` (base model, tags, experiment-tracker links,
    the method's citation from ``trainer._paper``) so the card stays what TRL users expect, with the base model and
    the quick-start model of :func:`base_model_of` and :func:`usage_model_id`; then inserts the tree section before
    "Framework versions" and lists trl-tree's version there.
    """
    from trl.trainer.utils import generate_model_card, get_comet_experiment_url, get_trackio_space_url

    base_model, base_model_text = base_model_of(trainer.model)
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
        hub_model_id=usage_model_id(trainer),
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
    adapter_base = adapter_base_model(trainer.model)
    quick_start = quick_start_code(trainer, adapter_base)
    if quick_start is not None:
        text = re.sub(
            r"(## Quick start\n\n```python\n).*?(```)",
            lambda m: m[1] + quick_start + m[2],
            text,
            count=1,
            flags=re.DOTALL,
        )
    if adapter_base is not None:
        text = text.replace("library_name: transformers", "library_name: peft", 1)
        text = text.replace("\n\n## Quick start", f"\n\n{adapter_note(adapter_base)}\n\n## Quick start", 1)
    # TRL's template links the base model unconditionally: "[None](https://huggingface.co/None)"
    if base_model is None:
        text = text.replace("[None](https://huggingface.co/None)", base_model_text, 1)
    section = tree_section(trainer, dataset_name)
    marker = "### Framework versions\n\n"
    if marker in text:
        text = text.replace(marker, f"{section}\n{marker}- {TRL_TREE_NAME}: {_trl_tree_version()}\n", 1)
    else:  # a custom template without that heading: append
        text = text.rstrip() + "\n\n" + section
    return text


def adapter_base_model(model) -> str | None:
    """The base model a PEFT adapter is loaded on (its `base_model_name_or_path`: a Hub id or a folder), or None
    when `model` is no PEFT model (its saved folder is then a whole model)."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not peft_config:
        return None
    active = getattr(model, "active_adapter", None)
    config = peft_config.get(active) if isinstance(active, str) else None
    config = config or next(iter(peft_config.values()))
    return getattr(config, "base_model_name_or_path", None) or "(not recorded in adapter_config.json)"


def adapter_note(base: str) -> str:
    """The card's words for a LoRA (PEFT) run: its folder is an adapter, not a model, and what it loads on."""
    return (
        f"**This folder holds a PEFT (LoRA) adapter, not a whole model**: load it on its base model `{base}` (the "
        "`base_model_name_or_path` of its `adapter_config.json`), as the quick start does with peft's "
        "`AutoPeftModelForCausalLM`, or merge it into the base model with `merge_and_unload()`."
    )


def _tool_schemas(trainer) -> list[dict]:
    """The JSON schemas of the trainer's tools, as the chat template rendered them into every training prompt."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in getattr(trainer, "tools", None) or []:
        try:
            schemas.append(tool if isinstance(tool, dict) else get_json_schema(tool))
        except Exception:  # noqa: BLE001 - a tool without a schema TRL could read is named only, not rendered
            continue
    return schemas


def quick_start_code(trainer, adapter_base: str | None) -> str | None:
    """The quick start for a model trained with tools or as a PEFT adapter, in place of TRL's (a pipeline with no
    tools, loading the folder as a whole model), or None to keep TRL's. It renders the prompt with the tools' schemas,
    as training did, and loads an adapter with its base model."""
    schemas = _tool_schemas(trainer)
    if not schemas and adapter_base is None:
        return None
    model_id = usage_model_id(trainer)
    lines = ["from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if adapter_base is not None:
        lines = ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer"]
    lines += [""]
    if schemas:
        names = ", ".join(s.get("function", s).get("name", "?") for s in schemas)
        lines += [
            f"# the tools the model was trained with ({names}): their schemas, as training rendered them into every "
            "prompt;",
            '# run its tool calls with your implementations and append each result as a {"role": "tool"} message',
            f"tools = {json.dumps(schemas, indent=4)}",
        ]
    else:
        lines += ["tools = None  # trained without tools"]
    loader = "AutoPeftModelForCausalLM" if adapter_base is not None else "AutoModelForCausalLM"
    comment = f"  # the adapter, on its base model {adapter_base}" if adapter_base is not None else ""
    lines += [
        f"question = {_QUICK_START_QUESTION!r}",
        f"tokenizer = AutoTokenizer.from_pretrained({model_id!r})",
        f"model = {loader}.from_pretrained({model_id!r}){comment}",
        'messages = [{"role": "user", "content": question}]',
        "inputs = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True, "
        'return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=128)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
    ]
    return "\n".join(lines) + "\n"


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
