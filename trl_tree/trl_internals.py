"""Every private name of TRL's `GRPOTrainer` (and of transformers' `Trainer`) that trl-tree relies on, in one place.

GRPOTrainer has no public API for replacing its generation step or its loss, so the tree trainers override some of its
private methods, call others, and read some of the attributes its `__init__` sets. Each of those names is declared
below and used only through this module:

- `OVERRIDDEN`: methods the tree trainers override. If TRL renamed one, the override would silently stop being
  called, so they are checked with the parameter names TRL calls them with.
- `CALLED`: private methods the tree trainers call, with the parameters they pass.
- `ATTRIBUTES`: attributes set by `GRPOTrainer.__init__` that the tree trainers read or write (the accessors below).
- `REWARD_GATHER`: the module-level `gather` that `_calculate_rewards` ends with, which a thread scoring its rank's
  leaves alone (the rollout worker's, `rank_alone_rewards`) turns into the identity.
- `REWARD_NAMES`: where `trl grpo` maps its short reward names (`--reward_funcs accuracy_reward`), which
  `trl-tree --reward_funcs` takes too (`grpo_reward_names`, `grpo_reward`; checked by `reward_name_problems`).

`check_installed()` compares all of them with the installed TRL and transformers and raises one error naming every
mismatch and the TRL version trl-tree was written against. `TreeTrainer.__init__` calls it and `tests/
test_trl_internals.py` runs it in CI, so a TRL release that renames something fails one clear test instead of a
user's training run.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import re
import textwrap
import threading
from typing import Any

TESTED_TRL = "1.16"

OVERRIDDEN: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (class that defines it, parameter names after self)
    "_generate_and_score_completions": ("GRPOTrainer", ("inputs",)),
    "_prepare_inputs": ("GRPOTrainer", ("generation_batch",)),
    "_compute_loss": ("GRPOTrainer", ("model", "inputs")),
    "_get_train_sampler": ("GRPOTrainer", ("dataset",)),
    "_save_rng_state": ("Trainer", ("output_dir",)),
    "_load_rng_state": ("Trainer", ("checkpoint",)),
}

CALLED: dict[str, tuple[str, tuple[str, ...]]] = {
    "_calculate_rewards": ("GRPOTrainer", ("inputs", "prompts", "completions", "completion_ids_list")),
    "_tokenize_prompts": ("GRPOTrainer", ("prompts",)),
    "_get_tool_suffix_ids": ("GRPOTrainer", ("tool_messages",)),
    "_get_dataloader": ("Trainer", ("dataset", "description", "batch_size", "sampler_fn", "is_training")),
}

ATTRIBUTES: dict[str, tuple[str, str]] = {
    # name: (class whose __init__ sets it, what trl-tree uses it for)
    "_metrics": ("GRPOTrainer", "logged scalars per mode, averaged and flushed by GRPOTrainer.log"),
    "_logs": ("GRPOTrainer", "the completions table of log_completions"),
    "_pending_metrics": ("GRPOTrainer", "what reward functions passed to log_metric, not yet flushed"),
    "_pending_extra_logs": ("GRPOTrainer", "what reward functions passed to log_extra, not yet flushed"),
    "_step": ("GRPOTrainer", "micro-step counter that selects the buffered micro-batch"),
    "_buffered_inputs": ("GRPOTrainer", "the micro-batches of the current generation batch"),
    "_tokenizer": ("GRPOTrainer", "the text tokenizer (the processing class, or its tokenizer for VLMs)"),
    "_is_vlm": ("GRPOTrainer", "read by _get_tool_suffix_ids"),
    "_standalone_tools": ("GRPOTrainer", "tools passed with tools= (not bound to an environment)"),
    "_env_tools": ("GRPOTrainer", "tools of each environment of environment_factory"),
    "_multi_environment": ("GRPOTrainer", "whether environment_factory is a dict of named environments"),
    "_batch_environments": ("GRPOTrainer", "the environment name of each row of the batch"),
    "_environment_pool": ("GRPOTrainer", "GRPOTrainer's pool of environment instances"),
    "_last_loaded_step": ("GRPOTrainer", "step of the last weight sync to vLLM"),
    "_dist": ("GRPOTrainer", "the distributed helper whose summon_full_params gathers FSDP weights"),
    "async_loop": ("GRPOTrainer", "the background event loop of async tools and reward functions"),
    "_train_batch_size": ("Trainer", "the dataloader's batch size (prompts for the tree trainers)"),
}

# (module, function, local variable): TRL keeps the dict of its short reward names local to `trl grpo`'s `main`, with
# no public accessor. trl-tree reads that dict from the function's source instead of copying it, so the names (and
# the parameters, such as `get_soft_overlong_punishment`'s) stay those of the installed `trl grpo`.
REWARD_NAMES = ("trl.scripts.grpo", "main", "reward_funcs_registry")

# (module, global, method that ends by calling it): `_calculate_rewards` gathers every rank's rewards with
# accelerate's `gather`, imported into TRL's module; `rank_alone_rewards` replaces that global by a switch.
REWARD_GATHER = ("trl.trainer.grpo_trainer", "gather", "_calculate_rewards")


# ----------------------------------------------------------------------------------------------------- checking


def _classes():
    from transformers import Trainer
    from trl import GRPOTrainer

    return {"GRPOTrainer": GRPOTrainer, "Trainer": Trainer}


def _parameters(function) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(function).parameters if p != "self")


@functools.lru_cache(maxsize=1)
def mismatches() -> tuple[str, ...]:
    """What of `OVERRIDDEN`, `CALLED` and `ATTRIBUTES` the installed TRL / transformers no longer has as declared."""
    classes = _classes()
    problems = []
    for name, (owner, params) in OVERRIDDEN.items():
        problems += _method_problems(classes[owner], name, params, "overridden")
    for name, (owner, params) in CALLED.items():
        problems += _method_problems(classes[owner], name, params, "called")
    problems += _reward_gather_problems()
    sources = {owner: inspect.getsource(cls) for owner, cls in classes.items()}
    for name, (owner, use) in ATTRIBUTES.items():
        if not re.search(rf"self\.{re.escape(name)}\b[^=\n]*[^=<>!]=[^=]", sources[owner]):  # maybe a tuple's part
            problems.append(f"{owner} no longer sets `self.{name}` ({use})")
    return tuple(problems)


def _method_problems(cls, name: str, params: tuple[str, ...], role: str) -> list[str]:
    method = getattr(cls, name, None)
    if method is None:
        return [f"{cls.__name__}.{name} ({role} by trl-tree) no longer exists"]
    found = _parameters(method)
    if found[: len(params)] != params:
        return [f"{cls.__name__}.{name} ({role} by trl-tree) takes {found}, trl-tree expects {params}"]
    return []


def _reward_gather_problems() -> list[str]:
    module_name, name, method = REWARD_GATHER
    module = importlib.import_module(module_name)
    if not callable(getattr(module, name, None)):
        return [f"{module_name} no longer has a module-level `{name}` (the reward gather `rank_alone_rewards` switches)"]
    gathering = getattr(_classes()["GRPOTrainer"], method, None)
    if gathering is None:
        return []  # reported as a missing `CALLED` method
    source = inspect.getsource(gathering)
    if not re.search(rf"(?<![\w.]){name}\(rewards_per_func\)", source):
        return [f"GRPOTrainer.{method} no longer gathers its rewards with the module's `{name}(rewards_per_func)`"]
    return []


def check_installed() -> None:
    """Raise one error listing every private name of TRL that trl-tree uses and the installed version lacks."""
    problems = mismatches()
    if problems:
        import trl

        raise ImportError(
            f"trl-tree was written against TRL {TESTED_TRL}, and the installed TRL {trl.__version__} differs in the "
            "private names the tree trainers build on:\n  - " + "\n  - ".join(problems) + "\nInstall a supported TRL "
            f"(`pip install 'trl=={TESTED_TRL}.*'`) or a trl-tree release that supports TRL {trl.__version__}."
        )


# ---------------------------------------------------------------------------------------------------- accessors


def tokenizer(trainer):
    return trainer._tokenizer


def metrics(trainer, mode: str):
    """`trainer._metrics[mode]`: a dict of lists that GRPOTrainer.log averages and clears."""
    return trainer._metrics[mode]


def completion_logs(trainer) -> dict:
    return trainer._logs


def set_completion_logs(trainer, logs: dict) -> None:
    trainer._logs = logs


def micro_step(trainer) -> int:
    return trainer._step


def set_micro_step(trainer, step: int) -> None:
    trainer._step = step


def buffered_inputs(trainer):
    return trainer._buffered_inputs


def set_buffered_inputs(trainer, batches) -> None:
    trainer._buffered_inputs = batches


def standalone_tools(trainer) -> list:
    return trainer._standalone_tools


def environment_tools_by_name(trainer) -> dict:
    return trainer._env_tools


def multi_environment(trainer) -> bool:
    return trainer._multi_environment


def set_batch_environments(trainer, names: list) -> None:
    trainer._batch_environments = names


def environment_pool(trainer):
    return trainer._environment_pool


def last_loaded_step(trainer) -> int | None:
    return getattr(trainer, "_last_loaded_step", None)


def set_last_loaded_step(trainer, step: int | None) -> None:
    """None: vLLM holds no weights of the trainer's at any step (the rollout worker pushed a published version)."""
    trainer._last_loaded_step = step


def distributed(trainer):
    return trainer._dist


def event_loop(trainer):
    """GRPOTrainer's background event loop; it is started only when a tool or reward function is async."""
    return getattr(trainer, "async_loop", None)


def pending_reward_logs(trainer) -> tuple[dict, dict]:
    """What reward functions passed to TRL's `log_metric` and `log_extra` since the last flush (metrics, extras)."""
    return trainer._pending_metrics, trainer._pending_extra_logs


def set_train_batch_size(trainer, size: int) -> None:
    trainer._train_batch_size = size


def train_batch_size(trainer) -> int:
    return trainer._train_batch_size


def get_dataloader(trainer, **kwargs):
    """transformers' `Trainer._get_dataloader` (dataset, description, batch_size, sampler_fn, is_training)."""
    return trainer._get_dataloader(**kwargs)


def calculate_rewards(trainer, inputs, prompts, completions, completion_ids, environments) -> Any:
    """TRL's reward computation (reward functions, reward models, log_metric / log_extra), gathered over ranks.

    `environments` are the rows' environments. TRL's `_calculate_rewards` passes reward functions the trainer's
    `environments` (which GRPOTrainer's generation step sets per batch, only with `environment_factory`), so they are
    the trainer's for this call only: no other code of the tree trainers reads them there."""
    previous = trainer.environments
    trainer.environments = environments if trainer.environment_factories is not None else None
    try:
        return trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
    finally:
        trainer.environments = previous


_rank_alone = threading.local()


@contextlib.contextmanager
def rank_alone_rewards():
    """Within this context, in this thread only, TRL's `_calculate_rewards` returns this rank's rewards ungathered.

    The rollout worker scores the leaves of its own rank in a thread of its own, out of step with the other ranks'
    workers: a gather there would meet the trainer threads' collectives. Each rank's reward functions see only its own
    rows under GRPOTrainer too; the gather only moves their results, which the trainer's thread gathers for its logs
    when it takes the batch. Other threads (the trainer's, evaluation) keep TRL's gather, so the global is swapped
    once, for a switch that reads a thread-local flag."""
    module_name, name, _ = REWARD_GATHER
    module = importlib.import_module(module_name)
    with _switch_lock:
        if not getattr(getattr(module, name), "_trl_tree_rank_switch", False):
            module.__dict__[name] = _gather_switch(getattr(module, name))
    previous = getattr(_rank_alone, "on", False)
    _rank_alone.on = True
    try:
        yield
    finally:
        _rank_alone.on = previous


_switch_lock = threading.Lock()


def _gather_switch(gather):
    @functools.wraps(gather)  # sets `switched.__wrapped__`, the gather called outside the context
    def switched(tensor, *args, **kwargs):
        return tensor if getattr(_rank_alone, "on", False) else switched.__wrapped__(tensor, *args, **kwargs)

    switched._trl_tree_rank_switch = True
    return switched


def tokenize_prompts(trainer, prompts: list):
    return trainer._tokenize_prompts(prompts)


def tool_suffix_ids(trainer, tool_messages: list[dict], *, special_tokens: str) -> list[int]:
    """Token ids of the tool messages and the next assistant header, rendered as TRL's tool loop renders them.

    `special_tokens` (`TreeConfig.observation_special_tokens`, no default so that no caller forgets it): "neutralize"
    first breaks chat-template control strings in the messages' text, so untrusted tool output is tokenized as text
    (`trl_tree.rollout.acting.special_tokens`); "raw" is TRL's rendering as it is."""
    from .rollout.acting.special_tokens import observation_messages

    return trainer._get_tool_suffix_ids(observation_messages(tokenizer(trainer), tool_messages, special_tokens))


def render_tool_suffix(processing_class, chat_template, chat_template_kwargs: dict, tool_messages: list[dict], *,
                       special_tokens: str):
    """`_get_tool_suffix_ids` without a trainer (the held-out agent evaluation): the same rendering, byte for byte,
    from the attributes that TRL's method reads, and the same `special_tokens` handling as `tool_suffix_ids`."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from .rollout.acting.special_tokens import observation_messages

    owner = SimpleNamespace(
        processing_class=processing_class, _tokenizer=processing_class, _is_vlm=False, chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    messages = observation_messages(processing_class, tool_messages, special_tokens)
    return list(GRPOTrainer._get_tool_suffix_ids(owner, messages))


# ------------------------------------------------------------------------------------ `trl grpo`'s reward names


@functools.lru_cache(maxsize=1)
def _reward_registry() -> tuple[dict[str, ast.expr], dict[str, tuple[str, str]]]:
    """(short name -> the expression of its value, local name -> (module, name) it is imported from) of `REWARD_NAMES`.
    A `LookupError` says what is missing when the installed TRL no longer builds the dict in this form."""
    module_name, function_name, variable = REWARD_NAMES
    where = f"`{variable}` in {module_name}.{function_name}"
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (ImportError, AttributeError, OSError, SyntaxError) as error:
        raise LookupError(f"cannot read {where}: {error}") from error
    imported = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
            isinstance(target, ast.Name) and target.id == variable for target in node.targets
        ):
            keys = [key.value if isinstance(key, ast.Constant) else None for key in node.value.keys]
            if not all(isinstance(key, str) for key in keys):
                raise LookupError(f"{where} has keys that are not strings")
            return dict(zip(keys, node.value.values)), imported
    raise LookupError(f"the installed TRL has no {where}")


def grpo_reward_names() -> tuple[str, ...]:
    """The short names `trl grpo --reward_funcs` takes (accuracy_reward, think_format_reward, ...), in TRL's order."""
    return tuple(_reward_registry()[0])


def grpo_reward(name: str):
    """The reward function `trl grpo --reward_funcs NAME` trains with: a function of `trl.rewards`, or what a factory
    of it returns for the literal arguments TRL passes (`get_soft_overlong_punishment(max_completion_len=1280,
    ...)`)."""
    values, imported = _reward_registry()
    value = values[name]
    call = value if isinstance(value, ast.Call) else None
    target = call.func if call is not None else value
    if not isinstance(target, ast.Name) or target.id not in imported:
        raise LookupError(f"{REWARD_NAMES[0]}: the value of {name!r} is not an imported function or a call of one")
    module, attribute = imported[target.id]
    function = getattr(importlib.import_module(module), attribute)
    if call is None:
        return function
    try:
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError as error:
        raise LookupError(f"{REWARD_NAMES[0]}: {name!r} is built with arguments that are not literals") from error
    return function(*args, **kwargs)


def reward_name_problems() -> tuple[str, ...]:
    """What keeps `trl grpo`'s short reward names from being read from the installed TRL (empty when they all are)."""
    try:
        names = grpo_reward_names()
    except LookupError as error:
        return (str(error),)
    problems = []
    for name in names:
        try:
            if not callable(grpo_reward(name)):
                problems.append(f"{name!r} is not callable")
        except (LookupError, ImportError, AttributeError, TypeError) as error:
            problems.append(f"{name!r}: {error}")
    return tuple(problems) if names else ("no names",)
