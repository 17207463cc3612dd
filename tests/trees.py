"""Hand-built rollout trees shared by the tests (values worked out by hand in the docstrings), and the few helpers
the loss tests use to feed a tree to a loss the way the trainer does and to differentiate it."""

import math

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trl_tree import RolloutTree, Turn

LOG = math.log
PROMPT = [1, 2]


def t(action, logps, obs=()):
    return Turn(action_ids=list(action), action_logps=[LOG(p) for p in logps], observation_ids=list(obs))


# Unique turns (letters) with their tokens and per-token behaviour probabilities.
A = t([10], [0.5], [90, 91])
B = t([11, 12], [0.6, 0.5], [92])
C = t([13], [0.6])
L = t([14], [0.2])
G = t([15], [0.1])
H = t([16], [0.2])
M_ = t([17], [0.1])
N_ = t([18], [0.3], [93])
P = t([19], [0.7])
D = t([20], [0.4], [90, 91])
E = t([21], [0.5])
I_ = t([22], [0.25])
J = t([23], [0.25])
F_ = t([24], [0.3])
K_ = t([25], [0.3])


def hotpot_like_tree() -> RolloutTree:
    """A (M, N) = (4, 2) tree: 4 initial trajectories, 2 branches each, K = 12.

    initial:  τ1 a→b→c (R=1)   τ2 d→e (0)   τ3 f (0)   τ4 a→g (1)
    branches: τ5 a→h (0), τ6 a→b→c (1, duplicate of τ1)      [from τ1 at anchors 1 and 2]
              τ7 d→i (1), τ8 d→j (0)                          [from τ2, anchor 1 twice]
              τ9 k (0), τ10 a→b→l (0)                         [from τ3, T = 1: resampled from the prompt]
              τ11 a→m (0), τ12 a→n→p (1)                      [from τ4]
    Unique turns: a d f k | b g h m n | c l | e i j | p = 15 (26 trajectory turns); c has multiplicity 2.
    """
    trajectories = [
        [A, B, C], [D, E], [F_], [A, G],
        [A, H], [A, B, C], [D, I_], [D, J], [K_], [A, B, L], [A, M_], [A, N_, P],
    ]
    rewards = [1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1]
    return RolloutTree.from_trajectories(PROMPT, trajectories, rewards)


def deep_tree() -> RolloutTree:
    """Depth 4, branching at the prompt and at depths 1, 2 and 3, with observations of different lengths."""
    a = t([30, 31, 32], [0.5, 0.4, 0.9], [80, 81])
    b = t([33], [0.5], [82, 83, 84])
    b2 = t([34, 35], [0.3, 0.3], [85])
    c = t([36, 37], [0.2, 0.9], [86])
    c2 = t([38], [0.6], [87, 88])
    d = t([39, 40, 41], [0.5, 0.5, 0.5])
    d2 = t([42], [0.1])
    e = t([43, 44], [0.5, 0.5])
    f = t([45], [0.8], [89])
    g = t([46, 47], [0.5, 0.5])
    trajectories = [[a, b, c, d], [a, b, c, d2], [a, b, c2, e], [a, b2, e], [f, g], [a, b, c, d]]
    return RolloutTree.from_trajectories([1, 2, 3, 4, 5], trajectories, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0])


# ---------------------------------------------------------------------------------------------------------------
# Feeding a tree to the losses
# ---------------------------------------------------------------------------------------------------------------


def flatten(tree: RolloutTree):
    """One token per entry, unique turns only, in DFS order: how the trainer feeds the losses.

    Returns (turn id per token, old log-probs [float64], the token indices of each turn as a list).
    """
    turn_ids, old, spans, start = [], [], [], 0
    for i, turn in enumerate(tree.turns):
        n = len(turn.action_ids)
        turn_ids += [i] * n
        old += turn.action_logps
        spans.append(list(range(start, start + n)))
        start += n
    return torch.tensor(turn_ids), torch.tensor(old, dtype=torch.float64), spans


def micro_batch_layout(trees: list[RolloutTree]) -> tuple[torch.Tensor, torch.Tensor]:
    """`trees` as one micro-batch of the trainer, one row a tree: [N, 1, T] turn ids (−1: padding) and π_old's
    log-probs (float64, 0 on padding), each row `flatten`ed."""
    flats = [flatten(tree) for tree in trees]
    width = max(f[0].numel() for f in flats)
    turn_ids = torch.full((len(trees), 1, width), -1)
    old = torch.zeros(len(trees), 1, width, dtype=torch.float64)
    for n, (ids, lp, _) in enumerate(flats):
        turn_ids[n, 0, : ids.numel()], old[n, 0, : lp.numel()] = ids, lp
    return turn_ids, old


def perturbed(old: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """Log-probs of a policy near the behaviour policy: old + scale · N(0, 1), reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed)
    return old + scale * torch.randn(old.shape, generator=gen, dtype=torch.float64)


def grad(loss_fn, logps: torch.Tensor) -> torch.Tensor:
    """∂ loss_fn(logps) / ∂ logps, by autograd at the given log-probs."""
    logps = logps.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(logps), logps)
    return g


def flat_gspo_token(tree: RolloutTree, lp, old, A: torch.Tensor, eps_low: float, eps_high: float | None = None):
    """GSPO-token exactly as written in the GSPO paper, one flat sequence per root-to-leaf path of `tree` (the
    reference the tree loss must equal). `lp[i]`, `old[i]`: turn i's token log-probs under π_θ and π_old (anything
    indexable by turn); `A[i]`: its advantage. s = exp(mean log-ratio over the sequence), s_t = sg(s)·π_θ/sg(π_θ)."""
    eps_high = eps_low if eps_high is None else eps_high
    per_path = []
    for path in tree.paths:
        lps, olds = torch.cat([lp[i] for i in path]), torch.cat([old[i] for i in path])
        adv = torch.cat([A[i].expand(len(lp[i])) for i in path])
        s = (lps - olds).mean().exp()
        s_t = s.detach() * (lps - lps.detach()).exp()
        per_path.append(torch.minimum(s_t * adv, s_t.clamp(1 - eps_low, 1 + eps_high) * adv).mean())
    return -torch.stack(per_path).mean()


# ------------------------------------------------------------------------------------------- random trees, random model
# (the packing tests compare packed forwards with path forwards on these; so do the attention and benchmark tests)

VOCAB = 300
# the packing tests' tiny Qwen3 shape (also the float64 golden record's model, tests/golden_float64.py)
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PAD = 0


def tiny_model(attn_implementation: str = "sdpa") -> Qwen3ForCausalLM:
    """A random tiny Qwen3; a large init range makes every output depend strongly on its context."""
    torch.manual_seed(0)
    config = Qwen3Config(**TINY_SHAPE, initializer_range=0.2)
    model = Qwen3ForCausalLM(config).float().eval()
    model.set_attn_implementation(attn_implementation)
    return model


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=gen).tolist()


def random_turn(gen: torch.Generator, n_action: int, n_obs: int) -> Turn:
    return Turn(random_ids(gen, n_action), [0.0] * n_action, random_ids(gen, n_obs))


def branching_tree(seed: int = 0, prompt_len: int = 6) -> RolloutTree:
    """Depth 3-4, branching from the prompt and at depths 1 and 2, a merged duplicate path, turns with and without
    observations, and a leaf whose tokens equal an inner turn's (a distinct node: terminal-ness differs)."""
    gen = torch.Generator().manual_seed(seed)
    a1, a2, a3, a3b = random_turn(gen, 4, 3), random_turn(gen, 3, 2), random_turn(gen, 5, 0), random_turn(gen, 2, 0)
    b2, b3 = random_turn(gen, 3, 0), random_turn(gen, 4, 2)
    c1, c2, c3, c4 = random_turn(gen, 2, 2), random_turn(gen, 3, 3), random_turn(gen, 1, 1), random_turn(gen, 4, 0)
    trajectories = [
        [a1, a2, a3],
        [a1, a2, a3b],  # branch at depth 2
        [a1, b2, b3],  # branch at depth 1 (b2 has no observation)
        [a1, a2, a3],  # duplicate: merges into the first path
        [c1, c2, c3, c4],  # branch from the prompt, depth 4
        [a1, a2],  # a2 as a leaf: a new node next to the inner a2
    ]
    return RolloutTree.from_trajectories(random_ids(gen, prompt_len), trajectories, [0.0] * len(trajectories))
