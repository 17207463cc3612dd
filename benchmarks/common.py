"""What the benchmarks share: the tasks, warm-started models, trainers at a matched budget, and the measurements.

- **Tasks.** `calculator_task` (one `calculator` call, then the number; `trl_tree.testing`) and `search_task` (the
  synthetic multi-hop world of `trl_tree.envs.synthetic` with a BM25 `search` tool, two searches then
  `<answer>…</answer>`). Each carries its dataset, held-out rows, tools, reward and the scripted conversations that
  warm-start a model.
- **Models.** `warm_started_model` teaches a model the task's tool-call format with a short SFT
  (`trl_tree.warm_start.warm_start`) and caches the result on disk, so every variant and every seed of a benchmark starts
  from the same weights and the SFT is paid once.
- **Trainers.** `build_trainer` makes GRPO with G completions per prompt, or a tree trainer with (M, N) trees, from one
  `Budget`: the same prompts per generation batch, the same E optimizer steps per generation batch, the same turn and
  token limits, the same tools and rewards.
- **Measurements.** `BatchMeter` measures a trainer per generation batch without touching library code: it wraps the
  trainer instance's generation phase, its loss (`compute_loss`) and its token sampler, and times the optimizer steps
  with `TrainerCallback` events. `PeakMemory` gives the peak memory of a batch (and of its generation and training
  phases apart). `HeldOutKL` measures drift: KL per token from a reference policy on scripted held-out
  trajectories (`held_out_examples`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

from trl_tree import methods, trl_internals

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tree methods -> the prefix of their trl_tree Config / Trainer classes. "flat_grpo" is GRPO's loss on trl-tree's own
# agent loop (sampler="flat": G independent trajectories, no branching), the control for the tree's sampling alone.
# the tree methods by name (the method table's, TreeFlex aside: its unit is a group of searches, not a tree) and
# "flat_grpo": GRPO's loss on trl-tree's own agent loop, the plain TreeTrainer with sampler="flat"
TREE_METHODS = {**{n: m.title for n, m in methods.METHODS.items() if n != "treeflex"}, "flat_grpo": "Tree"}
# issue 40's ablation, as benchmark methods: a named method with its `zero_credit_anchor` set the other way
# (TreeOPSD without its q = 1/2 pull on zero-credit turns; TreePO with it; `losses.zero_credit_anchor`)
LOSS_VARIANTS = {"treeopsd_no_anchor": ("treeopsd", {"zero_credit_anchor": False}),
                 "treepo_anchor": ("treepo", {"zero_credit_anchor": True})}


# ---------------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """A tool-use task: what a trainer trains on and what an evaluation asks.

    `train_rows` and `test_rows` are dataset rows with a conversational `prompt` and a gold `answer`.
    """

    name: str
    train_rows: list[dict[str, Any]]
    test_rows: list[dict[str, Any]]
    tools: list[Callable]
    reward_funcs: list[Callable]
    warm_start_conversations: list[list[dict]]

    def train_dataset(self):
        from datasets import Dataset

        return Dataset.from_list(self.train_rows)

    def fingerprint(self) -> str:
        """A short hash of the warm-start data and the tool schemas: the key of a cached warm start."""
        payload = json.dumps(
            [self.name, self.warm_start_conversations, [t.__name__ + (t.__doc__ or "") for t in self.tools]],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def calculator_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final assistant message is exactly the gold number, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        final = [m for m in completion if m.get("role") == "assistant"][-1:] if isinstance(completion, list) else []
        text = (final[0].get("content") or "").strip() if final else str(completion).strip()
        rewards.append(float(text == gold))
    return rewards


def calculator_task(num_train: int = 64, num_test: int = 32, seed: int = 0) -> Task:
    """Arithmetic questions answered with one `calculator` call: prompts are short, trajectories two turns."""
    from trl_tree.testing import calculator, calculator_conversations

    conversations = calculator_conversations(num_train + num_test, seed=seed)
    rows = [{"prompt": c[:1], "answer": c[-1]["content"]} for c in conversations]
    return Task(
        name="calculator",
        train_rows=rows[:num_train],
        test_rows=rows[num_train:],
        tools=[calculator],
        reward_funcs=[calculator_reward],
        warm_start_conversations=conversations[:num_train],
    )


def search_task(
    num_train: int = 200, num_test: int = 50, seed: int = 0, topk: int = 2, cache_dir: str | None = None
) -> Task:
    """The synthetic multi-hop world with BM25 search (HotpotQA's schema and prompt, Search-R1's instruction).

    Warm-start conversations are the scripted ideal trajectories (one search per hop, then the answer) with the
    observations the real BM25 tool returns, so the warm start shows the model the observations RL will show it.
    The reward is TreeOPSD's: token F1 of the `<answer>` span, thresholded at 0.3.
    """
    from trl_tree.envs import BM25Retriever, build_corpus, make_search_tool, scripted_search_conversation
    from trl_tree.envs.hotpot import build_prompt
    from trl_tree.envs.synthetic import synthetic_splits
    from trl_tree.rewards import f1_reward

    train, test = synthetic_splits(num_train, num_test, seed=seed)
    retriever = BM25Retriever(build_corpus(train + test), cache_dir=cache_dir or cache_root() / "bm25")
    search = make_search_tool(retriever, topk=topk)

    def rows(examples):
        return [{"prompt": build_prompt(e["question"]), "answer": e["answer"], "question": e["question"]}
                for e in examples]

    return Task(
        name="search",
        train_rows=rows(train),
        test_rows=rows(test),
        tools=[search],
        reward_funcs=[f1_reward],
        warm_start_conversations=[scripted_search_conversation(e, search=search) for e in train],
    )


TASK_SIZES = {"calculator": (64, 32), "search": (200, 48)}  # default (train, test) questions
# default turn and token limits per task, and SFT steps of the cached warm start that gets the tiny model going
TASK_LIMITS = {"calculator": {"max_turns": 3, "max_completion_length": 96, "warm_start_steps": 150},
               "search": {"max_turns": 4, "max_completion_length": 384, "warm_start_steps": 600}}


def fill_task_defaults(args) -> None:
    """Every `TASK_LIMITS` field of `args` left at None takes the default of `args.task`."""
    for name, default in TASK_LIMITS[args.task].items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)


def make_task(name: str, num_train: int | None = None, num_test: int | None = None, seed: int = 0,
              topk: int | None = None) -> Task:
    """A task by name, with the default sizes unless given (the synthetic world depends on the total number of
    questions, so equal sizes are what lets two benchmarks share a cached warm start). `topk`: passages per search
    (search task only; default 2)."""
    if name not in TASK_SIZES:
        raise ValueError(f"Unknown task {name!r}; choose one of {list(TASK_SIZES)}.")
    num_train = num_train or TASK_SIZES[name][0]
    num_test = num_test or TASK_SIZES[name][1]
    if name == "calculator":
        return calculator_task(num_train, num_test, seed)
    return search_task(num_train, num_test, seed, **({"topk": topk} if topk else {}))


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def runs_dir_of(output: str | Path) -> Path:
    """Where a benchmark's run files of `--output FILE` live: `FILE` without its suffix, + `.runs/` (each run is
    written there as it finishes, and the summary at FILE is rebuilt from them)."""
    return Path(output).with_name(Path(output).stem + ".runs")


def cache_root() -> Path:
    """Where warm-started models and indexes are cached: `$TRL_TREE_CACHE/benchmarks` (as `trl_tree.testing`)."""
    from trl_tree.model_cache import cache_root as trl_tree_cache

    return trl_tree_cache() / "benchmarks"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(path: str, attn_implementation: str = "sdpa", **config_overrides):
    """Model (float32 on CPU, bfloat16 on a GPU) and tokenizer from a local folder or Hub name; `config_overrides`
    replace fields of the model's config (e.g. `max_position_embeddings`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 **config_overrides)
    return model.to(device()), tokenizer


def lora_config(rank: int = 16):
    """LoRA on every linear layer (how the SmolLM2 benchmark warm-starts and trains: a 135M model on 2 CPU cores)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


# part of a cached warm start's key: bumped when the same inputs start to give other weights (2: LoRA initialised
# after seeding, not from whatever state the process's generator was in)
WARM_START_VERSION = 2


def warm_started_model(task: Task, model_name_or_path: str | None, steps: int, seed: int = 0, lr: float = 3e-3,
                       batch_size: int = 8, lora_rank: int | None = None) -> str:
    """Folder of `model_name_or_path` (default: the tiny Qwen3) after `steps` SFT steps on the task's scripted
    conversations; built once and cached under `cache_root()` (keyed by model, task data, steps, seed, lr, LoRA).

    With `lora_rank`, the SFT trains LoRA adapters (`lora_config`), merged into the weights before saving, so every
    method starts from the same plain model."""
    from trl_tree.model_cache import save_model_atomically
    from trl_tree.testing import tiny_model_path
    from trl_tree.warm_start import warm_start

    base = model_name_or_path or tiny_model_path()
    if steps <= 0:
        return base
    key = hashlib.sha256(json.dumps([WARM_START_VERSION, base, task.fingerprint(), steps, seed, lr, batch_size,
                                     lora_rank]).encode())
    path = cache_root() / f"warm-{task.name}-{steps}steps-{key.hexdigest()[:12]}"
    if path.is_dir():
        return str(path)
    model, tokenizer = load_model(base)
    # seeded before the LoRA adapters are initialised (from torch's global generator): otherwise their initial
    # values depend on what the process drew before, e.g. whether smollm2_path() had to build the model first
    torch.manual_seed(seed)
    if lora_rank:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora_rank))
    started = time.perf_counter()
    losses = warm_start(model, tokenizer, task.warm_start_conversations, tools=task.tools, steps=steps, lr=lr,
                        batch_size=batch_size, seed=seed)
    print(f"[warm start] {task.name}: {steps} steps in {time.perf_counter() - started:.0f} s, "
          f"loss {losses[0]:.2f} -> {sum(losses[-10:]) / len(losses[-10:]):.2f}", flush=True)
    if lora_rank:
        model = model.merge_and_unload()
    save_model_atomically(path, tokenizer, model)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# Trainers at a matched rollout budget
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Budget:
    """One generation batch: `prompts` prompts, split into `blocks` optimizer steps (E); GRPO samples
    `group_size` completions per prompt, a tree trainer grows one (M, N) tree per prompt. M(1 + N/2) = G matches
    the expected number of generated trajectories (docs/design.md §3)."""

    prompts: int = 4
    blocks: int = 2
    group_size: int = 8
    num_initial_rollouts: int = 4
    num_branches: int = 2
    generation_batches: int = 4
    learning_rate: float = 1e-5
    temperature: float = 1.0
    max_turns: int = 3
    max_completion_length: int = 96
    # tokens one sampled turn may have: `max_turn_tokens` of the tree trainers and the held-out agent. GRPOConfig has
    # no such field, but its transformers generation makes one `generate` call per turn with `generation_kwargs`
    # over its defaults, so `max_new_tokens` there is the same cap (a cut turn has no complete call and ends the
    # trajectory in both loops)
    max_turn_tokens: int | None = None
    seed: int = 0
    # TRL's tool loop ends a trajectory at a tool call it cannot parse; the tree trainers do the same here (their
    # default, "observe", answers it with an error observation), so that both sides sample the same kind of episode
    malformed_tool_calls: str = "end"
    # GRPO only: sequences per micro-batch, gradients accumulated over the optimizer step's prompts·G/E sequences
    # (None: one micro-batch per step). TRL's "dapo" loss normalises by the step's tokens whatever the split, so the
    # step is the same; what it bounds is the training forward's memory (16 unpacked sequences' logits at once)
    grpo_micro_batch: int | None = None

    def __post_init__(self):
        if self.prompts % self.blocks:
            raise ValueError(f"prompts ({self.prompts}) must be a multiple of blocks ({self.blocks}): whole trees "
                             "per optimizer step.")


def build_trainer(method: str, model, tokenizer, task: Task, budget: Budget, output_dir: str, packing: str = "tree",
                  peft_config=None, **overrides):
    """GRPO (`method="grpo"`) or a tree trainer (`"treeopsd"`, `"treepo"`) on `task` at `budget`; `peft_config`
    trains adapters instead of the whole model (as TRL's `peft_config=`)."""
    from trl import GRPOConfig, GRPOTrainer

    common = dict(
        output_dir=output_dir,
        steps_per_generation=budget.blocks,
        gradient_accumulation_steps=1,
        max_steps=budget.generation_batches * budget.blocks,
        learning_rate=budget.learning_rate,
        temperature=budget.temperature,
        max_completion_length=budget.max_completion_length,
        beta=0.0,
        seed=budget.seed,
        data_seed=budget.seed,
        logging_steps=budget.blocks,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    common.update(overrides)
    kwargs = dict(model=model, reward_funcs=task.reward_funcs, train_dataset=task.train_dataset(),
                  processing_class=tokenizer, tools=task.tools, peft_config=peft_config)
    if method == "grpo":
        per_step = budget.prompts * budget.group_size // budget.blocks
        micro = budget.grpo_micro_batch or per_step
        if per_step % micro:
            raise ValueError(f"grpo_micro_batch ({micro}) must divide the {per_step} sequences of an optimizer step.")
        accumulation = per_step // micro  # TRL counts steps_per_generation in micro-batches
        args = GRPOConfig(
            **{**common, "steps_per_generation": budget.blocks * accumulation,
               "gradient_accumulation_steps": accumulation},
            num_generations=budget.group_size,
            per_device_train_batch_size=micro,
            max_tool_calling_iterations=budget.max_turns - 1,  # the same number of assistant turns as max_turns
            **({"generation_kwargs": {"max_new_tokens": budget.max_turn_tokens}} if budget.max_turn_tokens else {}),
        )
        return GRPOTrainer(args=args, **kwargs)
    method, variant = LOSS_VARIANTS.get(method, (method, {}))
    if method not in TREE_METHODS:
        raise ValueError(f"Unknown method {method!r}; choose grpo or one of {list(TREE_METHODS) + list(LOSS_VARIANTS)}.")
    import trl_tree

    name = TREE_METHODS[method]
    config_class, trainer_class = getattr(trl_tree, f"{name}Config"), getattr(trl_tree, f"{name}Trainer")
    sampler_fields = matched_sampler_fields(method, budget)
    trees_per_block = budget.prompts // budget.blocks
    args = config_class(
        **common,
        **sampler_fields,
        # counts trajectories of budget, as GRPO's: the same trees per block (and tokens) as before
        per_device_train_batch_size=trees_per_block * config_class.num_generations_for(**sampler_fields),
        max_turns=budget.max_turns,
        max_turn_tokens=budget.max_turn_tokens,
        packing=packing,
        malformed_tool_calls=budget.malformed_tool_calls,
        **variant,
    )
    return trainer_class(args=args, **kwargs)


def add_budget_arguments(parser, learning_rate: float, max_turns: int | None, max_completion_length: int | None):
    """The command-line fields of a `Budget`, shared by the benchmark scripts (defaults that differ are passed in)."""
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generation batch (P)")
    parser.add_argument("--blocks", type=int, default=2, help="optimizer steps per generation batch (E)")
    parser.add_argument("--group_size", type=int, default=8, help="GRPO's G")
    parser.add_argument("--num_initial_rollouts", type=int, default=4, help="the trees' M")
    parser.add_argument("--num_branches", type=int, default=2, help="the trees' N")
    parser.add_argument("--max_turns", type=int, default=max_turns, help="assistant turns per trajectory")
    parser.add_argument("--max_completion_length", type=int, default=max_completion_length,
                        help="tokens per trajectory")
    parser.add_argument("--max_turn_tokens", type=int, default=None,
                        help="tokens per sampled turn (tree trainers and evaluation; GRPOTrainer has no such cap)")
    parser.add_argument("--learning_rate", type=float, default=learning_rate)
    parser.add_argument("--malformed_tool_calls", choices=("end", "observe"), default="end",
                        help="the tree trainers' policy for unparseable tool calls: 'end' the trajectory, as TRL's "
                             "GRPO loop does (default), or 'observe' (an error observation, and go on)")


def budget_from_args(args, generation_batches: int, seed: int) -> Budget:
    return Budget(
        prompts=args.prompts, blocks=args.blocks, group_size=args.group_size,
        num_initial_rollouts=args.num_initial_rollouts, num_branches=args.num_branches,
        generation_batches=generation_batches, learning_rate=args.learning_rate, max_turns=args.max_turns,
        max_completion_length=args.max_completion_length, seed=seed, malformed_tool_calls=args.malformed_tool_calls,
        max_turn_tokens=getattr(args, "max_turn_tokens", None),
        grpo_micro_batch=getattr(args, "grpo_micro_batch", None),
    )


def matched_sampler_fields(method: str, budget: Budget) -> dict[str, int]:
    """Sampler fields giving `method` GRPO's expected cost: M full trajectories plus M·N new leaves that each
    regenerate about half a trajectory (from a uniform turn for init-expand; from an entropy-selected turn (AT2PO) or
    token (TreeAdv) for the others, which is only approximately half)."""
    M, new_leaves = budget.num_initial_rollouts, budget.num_initial_rollouts * budget.num_branches
    if method == "flat_grpo":
        return {"sampler": "flat", "num_initial_rollouts": budget.group_size, "credit": "path", "loss": "grpo"}
    if method in ("treeopsd", "treepo"):
        return {"num_initial_rollouts": M, "num_branches": budget.num_branches}
    if method == "at2po":
        return {"num_initial_rollouts": M, "expansion_rounds": 2, "branches_per_round": new_leaves // 2}
    return {"num_initial_rollouts": M, "max_branches_per_tree": new_leaves}  # treeadv


# ---------------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Drift: how far a policy has moved, teacher-forced on held-out trajectories (the stability map and the learning runs)
# ---------------------------------------------------------------------------------------------------------------------


def held_out_examples(task, tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """Scripted trajectories (one search per hop, then the answer, with the real BM25 observations) of the first
    `count` held-out questions, as token ids and the mask of the assistant's tokens."""
    from trl.chat_template_utils import get_training_chat_template

    from trl_tree.envs import scripted_search_conversation
    from trl_tree.envs.synthetic import synthetic_splits
    from trl_tree.testing import assistant_token_mask

    _, test = synthetic_splits(len(task.train_rows), len(task.test_rows))  # the world make_task built
    template = get_training_chat_template(tokenizer)
    return [assistant_token_mask(tokenizer, scripted_search_conversation(e, search=task.tools[0]), task.tools, template)
            for e in test[:count]]


class HeldOutKL:
    """Teacher-forced KL(π_old ‖ π_θ) per assistant token on fixed held-out trajectories: π_old's log-softmax at
    those tokens is stored once, and each call compares the current model's with it (exact, over the vocabulary).

    π_old is whatever `model` is at construction: the batch's θ_old in the stability map, the warm start in a
    learning run (its drift). The forwards run in eval mode (the model's mode is put back) and draw nothing from
    torch's generator, so measuring changes no sample or step of the run measured."""

    def __init__(self, model, examples: list[tuple[list[int], list[int]]], temperature: float):
        self.examples = [(torch.tensor(ids).unsqueeze(0), torch.tensor(mask, dtype=torch.bool)) for ids, mask in examples]
        self.temperature = temperature
        self.reference = [self._log_softmax(model, ids, mask) for ids, mask in self.examples]

    @torch.no_grad()
    def _log_softmax(self, model, ids: Tensor, mask: Tensor) -> Tensor:
        was_training = model.training
        model.eval()
        try:
            logits = model(input_ids=ids.to(model.device)).logits[0, :-1].float() / self.temperature
        finally:
            model.train(was_training)
        return torch.log_softmax(logits[mask[1:].to(logits.device)], dim=-1).cpu()  # position t predicts token t+1

    def __call__(self, model) -> float:
        total, tokens = 0.0, 0
        for (ids, mask), old in zip(self.examples, self.reference):
            new = self._log_softmax(model, ids, mask)
            total += float((old.exp() * (old - new)).sum())
            tokens += old.shape[0]
        return total / max(tokens, 1)


class PeakMemory:
    """Peak memory (MiB) since the last `reset()`.

    On a GPU: `torch.cuda.max_memory_allocated`. On CPU: the process's resident set size, sampled every `interval`
    seconds by a daemon thread (the kernel's `ru_maxrss` is a lifetime maximum and cannot be reset per batch).

    `release_freed=True` (CPU, glibc): `reset()` first hands the allocator's freed memory back to the system
    (`malloc_trim`). Without it the RSS keeps what an earlier phase freed, so the peak of a phase that needs less than
    the one before it reads as the earlier phase's; with it, a peak above `current_mib()` at the reset is what the
    phase itself allocated (bench_scaling.py, which measures generation and training separately).
    """

    def __init__(self, interval: float = 0.01, release_freed: bool = False):
        self.cuda = torch.cuda.is_available()
        self._peak = 0
        self._stop = threading.Event()
        self._trim = _malloc_trim() if release_freed and not self.cuda else None
        if not self.cuda:
            import psutil

            self._process = psutil.Process()
            self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
            self._thread.start()

    def _sample(self, interval: float):
        while not self._stop.wait(interval):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def reset(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            if self._trim is not None:
                self._trim(0)
            self._peak = self._process.memory_info().rss

    def current_mib(self) -> float:
        """Memory in use now: allocated tensors on a GPU, the resident set on CPU."""
        if self.cuda:
            return torch.cuda.memory_allocated() / 2**20
        return self._process.memory_info().rss / 2**20

    def peak_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return max(self._peak, self._process.memory_info().rss) / 2**20

    def close(self):
        self._stop.set()


def _malloc_trim():
    """glibc's `malloc_trim`, or None where there is none (musl, macOS): then freed memory stays in the RSS."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


@dataclass
class BatchRecord:
    """What one generation batch cost. Token counts exclude padding unless the name says `padded`."""

    step_seconds: float = 0.0  # wall clock of the batch's E optimizer steps: generation, forwards, backwards, steps
    step_cpu_seconds: float = 0.0  # CPU time of this process over the same span (less sensitive to other jobs)
    generation_seconds: float = 0.0  # inside `_generate_and_score_completions` (sampling, tools, rewards, π_old)
    generation_cpu_seconds: float = 0.0  # CPU time of this process in the same call
    sampling_seconds: float = 0.0  # inside the token sampler alone (model.generate calls)
    sampling_cpu_seconds: float = 0.0  # CPU time of this process in the same calls (the figure to read on busy cores)
    training_seconds: float = 0.0  # step_seconds - generation_seconds: loss forwards, backwards, optimizer steps
    training_cpu_seconds: float = 0.0  # step_cpu_seconds - generation_cpu_seconds
    generated_tokens: int = 0  # tokens the policy sampled (actions; observations are not generated)
    generate_calls: int = 0  # sampling calls with at least one row (one per turn of the rows still running)
    decode_steps: int = 0  # sum over those calls of their longest row's new tokens: the steps they ran
    leaf_action_tokens: int = 0  # action tokens summed over every leaf's own trajectory (shared turns once per leaf)
    leaves: int = 0  # finished trajectories: G per prompt for GRPO, K = M(N + 1) per tree
    unique_tokens: int = 0  # trees: prompt + every unique turn once; GRPO: distinct prefixes of the group (a trie)
    flat_tokens: int = 0  # every trajectory as its own sequence (prompt + completion per leaf)
    forward_tokens: int = 0  # tokens forwarded in the loss passes (all micro-batches), padding excluded
    padded_forward_tokens: int = 0  # the same with the padding each forward actually computes
    trained_tokens: int = 0  # action tokens that carry a loss
    peak_memory_mib: float = 0.0  # the batch's peak: the larger of the two below
    start_memory_mib: float = 0.0  # memory in use when the batch starts (model, optimizer state, the process)
    generation_peak_memory_mib: float = 0.0  # peak during the generation phase
    training_peak_memory_mib: float = 0.0  # peak from the end of generation to the batch's last optimizer step
    warmup: bool = False  # a warm-up batch: recorded, left out of the summary



class BatchMeter(TrainerCallback):
    """Per-generation-batch measurements of a GRPOTrainer or a trl-tree trainer (one process).

    Wraps, on the trainer *instance*, the generation phase (`_generate_micro_batches` of a tree trainer,
    `_generate_and_score_completions` of GRPO: generation time and the batch's token counts), `compute_loss` (tokens
    forwarded in the loss passes) and the token sampler (`generation_engine.generate` of a tree trainer,
    `_generate_single_turn` of GRPO), and opens/closes a batch on the optimizer steps that start and end a generation
    batch. A batch in which no generation was seen is an error: the trainer's methods changed and this needs updating.

    A tree trainer with `max_staleness` > 0 takes its batches from a rollout worker (`trainer._async_rollouts`),
    which grows them in a thread of its own, ahead of the trainer, with an engine of its own (docs/design.md §9):
    `_measure_rollout_worker` says what is measured then.
    """

    def __init__(self, trainer, memory: PeakMemory | None = None):
        self.trainer = trainer
        self.is_tree = hasattr(trainer, "generation_engine")
        self.steps_per_batch = trainer.args.steps_per_generation // trainer.args.gradient_accumulation_steps
        self.memory = memory or PeakMemory()
        self.batches: list[BatchRecord] = []
        self._batch: BatchRecord | None = None
        self._start = (0.0, 0.0)
        # the generation phase: tree trainers grow, score and pack a whole generation batch in one call (split into
        # micro-batches before π_old is recomputed); GRPOTrainer in `_generate_and_score_completions`
        generation = next(name for name in ("_generate_micro_batches", "_generate_and_score_completions")
                          if hasattr(trainer, name))
        self._wrap(trainer, generation, self._after_generation)
        self._wrap(trainer, "compute_loss", self._after_loss)
        # batches grown by a rollout worker and not taken yet; those never taken when the run ends stay here
        self.grown: dict[int, tuple[Any, BatchRecord]] = {}
        self._growing: BatchRecord | None = None
        rollouts = getattr(trainer, "_async_rollouts", None)
        if rollouts is not None:
            self._measure_rollout_worker(rollouts)
        elif self.is_tree:
            self._wrap(trainer.generation_engine, "generate", self._after_tree_sampling)
            if hasattr(trainer, "_score_leaves"):  # sees every leaf's branch (its turns) before the tree merges them
                self._wrap(trainer, "_score_leaves", self._after_tree_scoring)
        else:
            self._wrap(trainer, "_generate_single_turn", self._after_grpo_sampling)
        trainer.add_callback(self)

    def _wrap(self, owner, name: str, after: Callable):
        """Replace `owner.name` by a timed call that hands (args, kwargs, result, wall seconds, CPU seconds of this
        process) to `after`."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            result = original(*args, **kwargs)
            if self._batch is not None:
                after(args, kwargs, result, time.perf_counter() - start, time.process_time() - cpu)
            return result

        setattr(owner, name, timed)

    def _measure_rollout_worker(self, rollouts):
        """max_staleness > 0. What the worker's engine samples (`generated_tokens`, `generate_calls`, `decode_steps`,
        `sampling_seconds`; `sampling_cpu_seconds` in the worker's thread alone, `time.thread_time`: the trainer trains
        meanwhile) and what its scorer sees (`leaf_action_tokens`) is recorded per batch as the worker grows it, and
        added to the batch the trainer trains it as: the same counts as a synchronous batch's, whatever ran when. The
        generation phase (`generation_seconds`) is the trainer's side, `micro_batches`: waiting for the worker's
        batch and recomputing π_old on it. The worker's engine exists once its session starts (`_start`)."""
        produce, start = rollouts._produce, rollouts._start

        def produce_measured(item):
            self._growing = record = BatchRecord()
            try:
                return produce(item)
            finally:  # kept even when the run stops it midway: the tokens were sampled
                self._growing = None
                self.grown[id(item)] = (item, record)

        def start_measured():
            start()
            self._wrap_in_worker(rollouts.engine, "generate", self._after_worker_sampling)

        rollouts._produce, rollouts._start = produce_measured, start_measured
        self._wrap_in_worker(rollouts, "_score", self._after_worker_scoring)
        self._wrap(rollouts, "micro_batches", self._after_taken)

    def _wrap_in_worker(self, owner, name: str, after: Callable):
        """Replace `owner.name`, called in the rollout worker's thread, by a timed call that hands (the batch being
        grown, args, kwargs, result, wall seconds, CPU seconds of the worker's thread) to `after`."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            result = original(*args, **kwargs)
            if self._growing is not None:
                after(self._growing, args, kwargs, result, time.perf_counter() - start, time.thread_time() - cpu)
            return result

        setattr(owner, name, timed)

    # -- batch boundaries ---------------------------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_batch == 0:
            self._batch = BatchRecord()
            self.memory.reset()
            self._batch.start_memory_mib = self.memory.current_mib()
            self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_batch == 0 and self._batch is not None:
            batch, (wall, cpu) = self._batch, self._start
            _synchronize()
            batch.step_seconds = time.perf_counter() - wall
            batch.step_cpu_seconds = time.process_time() - cpu
            batch.training_seconds = batch.step_seconds - batch.generation_seconds
            batch.training_cpu_seconds = batch.step_cpu_seconds - batch.generation_cpu_seconds
            # the peak since generation ended (the memory was reset there), or, if generation was never seen, the batch's
            batch.training_peak_memory_mib = self.memory.peak_mib()
            batch.peak_memory_mib = max(batch.generation_peak_memory_mib, batch.training_peak_memory_mib)
            if batch.leaves == 0 or batch.generated_tokens == 0 or batch.forward_tokens == 0:
                raise RuntimeError(
                    f"BatchMeter saw a generation batch without leaves, generated or forwarded tokens ({batch}): "
                    f"{type(self.trainer).__name__}'s generation or loss methods changed; update benchmarks/common.py."
                )
            self.batches.append(batch)
            self._batch = None

    # -- what each wrapped call tells -----------------------------------------------------------------------------------

    def _after_tree_sampling(self, args, kwargs, continuations, seconds, cpu_seconds):
        self._record_sampling(self._batch, [c.ids for c in continuations], seconds, cpu_seconds)

    def _after_grpo_sampling(self, args, kwargs, result, seconds, cpu_seconds):
        completion_ids, _ = result
        self._record_sampling(self._batch, completion_ids, seconds, cpu_seconds)

    def _after_worker_sampling(self, record, args, kwargs, continuations, seconds, cpu_seconds):
        self._record_sampling(record, [c.ids for c in continuations], seconds, cpu_seconds)

    def _record_sampling(self, record: BatchRecord, rows: list, seconds: float, cpu_seconds: float):
        """One sampling call: its time and the tokens of each row it generated."""
        record.sampling_seconds += seconds
        record.sampling_cpu_seconds += cpu_seconds
        record.generated_tokens += sum(len(ids) for ids in rows)
        if rows:
            record.generate_calls += 1
            record.decode_steps += max(len(ids) for ids in rows)

    def _after_tree_scoring(self, args, kwargs, rewards, seconds, cpu_seconds):
        self._after_worker_scoring(self._batch, args, kwargs, rewards, seconds, cpu_seconds)

    def _after_worker_scoring(self, record, args, kwargs, rewards, seconds, cpu_seconds):
        branches_per_tree = args[2] if len(args) > 2 else kwargs["branches_per_tree"]
        record.leaf_action_tokens += sum(
            len(turn.action_ids) for branches in branches_per_tree for branch in branches for turn in branch.turns)

    # what the worker recorded while growing a batch, added to the batch the trainer trains it as
    _GROWN_FIELDS = ("sampling_seconds", "sampling_cpu_seconds", "generated_tokens", "generate_calls", "decode_steps",
                     "leaf_action_tokens")

    def _after_taken(self, args, kwargs, batches, seconds, cpu_seconds):
        item = args[0] if args else kwargs["item"]
        _, grown = self.grown.pop(id(item), (None, None))
        if grown is None:
            raise RuntimeError("BatchMeter did not see the rollout worker grow the batch the trainer took: build the "
                               "meter before training starts, or the worker's methods changed (update common.py).")
        for name in self._GROWN_FIELDS:
            setattr(self._batch, name, getattr(self._batch, name) + getattr(grown, name))
        self._after_generation(args, kwargs, batches, seconds, cpu_seconds)

    def _after_generation(self, args, kwargs, batches, seconds, cpu_seconds):
        record = self._batch
        record.generation_seconds += seconds
        record.generation_cpu_seconds += cpu_seconds
        # the two phases' peaks apart: what generation held, then, from here, what training holds
        record.generation_peak_memory_mib = max(record.generation_peak_memory_mib, self.memory.peak_mib())
        self.memory.reset()
        if self.is_tree:
            # the trainer logs per-tree means of these (TreeTrainer._log_generation: tree/* metrics); one process, so mean × trees
            metrics = trl_internals.metrics(self.trainer, "train" if self.trainer.model.training else "eval")
            batches = batches if isinstance(batches, list) else [batches]
            trees = sum(batch["input_ids"].shape[0] for batch in batches)
            record.unique_tokens += round(metrics["tree/unique_tokens"][-1] * trees)
            record.flat_tokens += round(metrics["tree/flat_tokens"][-1] * trees)
            record.leaves += round(metrics["tree/leaves_per_tree"][-1] * trees)
        else:
            batch = batches
            prompt = batch["prompt_ids"].masked_select(batch["prompt_mask"].bool()).split(
                batch["prompt_mask"].sum(1).tolist())
            completion = batch["completion_ids"].masked_select(batch["completion_mask"].bool()).split(
                batch["completion_mask"].sum(1).tolist())
            sequences = [p.tolist() + c.tolist() for p, c in zip(prompt, completion)]
            group = self.trainer.num_generations
            record.leaves += len(sequences)
            record.leaf_action_tokens += int((batch["completion_mask"] * batch.get("tool_mask", 1)).sum())
            record.flat_tokens += sum(len(s) for s in sequences)
            record.unique_tokens += sum(distinct_prefixes(sequences[i : i + group])
                                        for i in range(0, len(sequences), group))

    def _after_loss(self, args, kwargs, loss, seconds, cpu_seconds):
        inputs = args[1] if len(args) > 1 else kwargs["inputs"]
        record = self._batch
        if self.is_tree:
            valid = inputs["valid"].reshape(-1)
            record.forward_tokens += int(valid.sum())
            record.padded_forward_tokens += int((valid > 0).sum()) * int(valid.max())
            record.trained_tokens += int((inputs["turn_ids"] >= 0).sum())
        else:
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            record.forward_tokens += int(mask.sum())
            record.padded_forward_tokens += mask.numel()
            action = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            record.trained_tokens += int(action.sum())


def distinct_prefixes(sequences: list[list[int]]) -> int:
    """Nodes of the token trie of `sequences`: the tokens a perfectly prefix-sharing forward would process."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; node ids in order of insertion, root 0
    for sequence in sequences:
        node = 0
        for token in sequence:
            node = nodes.setdefault((node, token), len(nodes) + 1)
    return len(nodes)


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(batches: list[BatchRecord]) -> dict[str, float]:
    """Mean over the measured generation batches of every `BatchRecord` field, plus generated tokens per leaf."""
    if not batches:
        return {}
    rows = [asdict(b) for b in batches]
    summary = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "warmup"}
    for k in ("step_seconds", "step_cpu_seconds"):
        summary[f"{k}_std"] = statistics.stdev(r[k] for r in rows) if len(rows) > 1 else 0.0
    summary["generated_tokens_per_leaf"] = summary["generated_tokens"] / max(summary["leaves"], 1)
    # the share of the leaves' action tokens that had to be sampled: 1 for GRPO; for an (M, N) tree with uniform
    # anchors, (1 + N/2) / (N + 1) in expectation (2/3 for (4, 2)), whatever the trajectories' lengths
    summary["generated_fraction"] = summary["generated_tokens"] / max(summary["leaf_action_tokens"], 1)
    summary["forward_tokens_per_unique_token"] = summary["forward_tokens"] / max(summary["unique_tokens"], 1)
    # what sampling costs per token the policy generated (a tree re-enters shared histories at every branch)
    for key in ("sampling_seconds", "sampling_cpu_seconds", "decode_steps"):
        summary[f"{key}_per_1k_generated"] = 1000 * summary[key] / max(summary["generated_tokens"], 1)
    summary["batches"] = len(rows)
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------------


def markdown_table(rows: list[dict[str, Any]], columns: list[str], headers: dict[str, str] | None = None) -> str:
    """A Markdown table of `rows` (floats to 3 significant digits, large numbers with thousands separators)."""
    headers = headers or {}

    def cell(value):
        if isinstance(value, bool):
            return str(value)
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    lines = ["| " + " | ".join(headers.get(c, c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


REPO_ROOT = Path(__file__).resolve().parent.parent
# the placeholder a stored result writes for the trl_tree cache folder (`trl_tree.model_cache.cache_root`), whatever
# it was on the machine that wrote it
CACHE_PLACEHOLDER = "$TRL_TREE_CACHE"
_CACHE_MARK = "/.cache/trl_tree/"  # the default cache folder, found in files written on other machines


def portable_path(text: str, root: Path = REPO_ROOT) -> str:
    """An absolute path as a stored result writes it, naming no machine: inside the checkout, relative to it (a
    `benchmarks/results/` path from another checkout, too); inside the trl_tree cache, `$TRL_TREE_CACHE/...` (so a
    warm start keeps its folder name, the part that identifies it); anywhere else, the file's name alone (where a
    sitting wrote its scratch output says nothing about the result). Anything that is not an absolute path is kept."""
    if not text.startswith("/") or any(c.isspace() for c in text) or not Path(text).name:
        return text
    from trl_tree.model_cache import cache_root as trl_tree_cache

    path = Path(text)
    for base, prefix in ((root, ""), (trl_tree_cache(), CACHE_PLACEHOLDER + "/")):
        if path.is_relative_to(base):
            rest = path.relative_to(base).as_posix()
            return prefix + rest if rest != "." else (prefix.rstrip("/") or ".")
    if "/benchmarks/results/" in text:
        return "benchmarks/results/" + text.split("/benchmarks/results/", 1)[1]
    if _CACHE_MARK in text:
        return f"{CACHE_PLACEHOLDER}/{text.split(_CACHE_MARK, 1)[1]}"
    return path.name


def portable(value):
    """`value` (JSON-like) with every absolute path string made `portable_path`: what `write_json` stores, so that a
    committed result file holds no path of the machine that wrote it (and can be rebuilt and compared elsewhere)."""
    if isinstance(value, str):
        return portable_path(value)
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """`payload` as JSON at `path`, its paths made `portable` (dataclasses and tensors as `_jsonable` gives them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = portable(json.loads(json.dumps(payload, default=_jsonable)))
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def environment(kernels: bool = True) -> dict[str, Any]:
    """The versions and hardware a result was measured on. TRL's version is read from its installed metadata (None
    when it is not installed), so that the scripts that never use TRL (gpu_suite.py) do not import it; they pass
    `kernels=False`, since the CPU kernel fingerprint trains the tiny model through `trl_tree`."""
    import importlib.metadata
    import platform

    import transformers

    try:
        trl_version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        trl_version = None
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if kernels:  # which machines round alike: two that both report AVX512 trained other warm-start bits
        from trl_tree.testing import kernel_fingerprint

        info["kernel_fingerprint"] = kernel_fingerprint()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info

