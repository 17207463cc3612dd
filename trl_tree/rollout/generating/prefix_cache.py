"""Keys and values computed once per rollout: a turn's `generate` call reuses the KV of the sequences earlier calls
of the same rollout already processed (docs/design.md §5).

A tree's branches share their histories: turn t+1 of a branch continues the very sequence turn t generated, and a
branch grown from an anchor's turn prefix continues a prefix of the anchor's sequence. Plain `model.generate`
prefills every prefix from its first token at every call, so on CPU a multi-turn rollout spends most of its time
re-encoding histories it has already encoded. `PrefixKVStore` keeps, for every row of every call, the KV of the
tokens that row holds (its prefix and the turn it generated); the next call finds for each prefix the stored row
sharing its longest common prefix and prefills only the rest.

Layout of a call with reuse (one row per prefix, left-aligned padding as usual):

    cache columns:  [ pad … | reused KV of the row's first k tokens ]     width L = max k
    input columns:  [ pad … | the row's first k ids | pad … | the row's other tokens ]

The attention mask is 0 on both pads, so a row may have a hole in the middle; `generate` derives position ids from
the mask's cumulative sum, so every real token keeps the position it has in an unpadded sequence. Keys and values
depend only on a token's own prefix and position, so the reused ones equal those a full prefill would compute (up to
floating-point summation order: sampled ids are the same but for near-ties).

Each call's cache holds its keys and values in buffers with room for the tokens it will generate (`GrowingLayer`):
a decode step writes its column in place, where a `DynamicCache` concatenates every layer's whole cache at every
step, which costs in proportion to the history, and a tree's histories are long (its continuations carry their
anchor's).

The store is valid for one set of weights: callers empty it when a rollout ends (`HFEngine.rollout`). It holds
each live sequence once (a row that a later row extends is dropped), i.e. about as much memory as one batched
`generate` over all the rollout's sequences at once: a tree's leaves' histories, which grows with the tree.

`max_bytes` caps it (`TreeConfig.max_prefix_cache_bytes`): after each call, the least recently used rows (stored or
reused longest ago) are dropped until the keys and values held fit. A dropped row only means that a later prefix
reuses less and prefills more; what a call computes for a token never depends on where its KV came from, so a capped
store samples what an uncapped one samples (up to the floating-point summation order every reuse already has).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Reusing fewer tokens than this is not worth a row of padding in the cache (a pad column costs attention, not MLP).
MIN_REUSE = 8
# Spare columns a call's cache starts with, at most (its token budget when smaller): a budget of thousands of tokens
# reserved for every row would hold far more memory than turns of tens or hundreds of tokens use; a turn that runs
# past the room doubles it (`GrowingLayer`), a copy of the history each time.
MAX_INITIAL_ROOM = 256


@dataclass
class _Entry:
    tokens: np.ndarray  # the token ids whose KV is stored, in order
    keys: list[torch.Tensor]  # per layer: [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    key: bytes = field(init=False, repr=False)  # the store's sort key (`_sort_key`)
    nbytes: int = field(init=False, repr=False)  # of its keys and values: what `PrefixKVStore.max_bytes` counts
    last_used: int = field(default=0, repr=False)  # the store's clock when it was stored or last reused (LRU)

    def __post_init__(self):
        self.key = _sort_key(self.tokens)
        self.nbytes = sum(t.nbytes for t in (*self.keys, *self.values))


def _sort_key(tokens: np.ndarray) -> bytes:
    """Token ids as big-endian 4-byte words: bytes compare (memcmp) in the ids' lexicographic order, and one sequence
    is a prefix of another exactly when its bytes are; comparing tuples of ints instead walks shared histories of
    thousands of tokens one Python object at a time."""
    return np.asarray(tokens, dtype=">u4").tobytes()


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views into buffers with spare columns.

    `update` writes new columns in place while they fit; when they do not, it moves to buffers with twice the spare
    room, so a call of n decode steps copies its history O(log n) times instead of n times (`DynamicLayer.update`
    concatenates at every step). `room` is the number of spare columns to have after the call's first forward (the
    prefill): its token budget, so a call that stays within it never moves. `buffers` and `length`: buffers that
    already hold `length` columns (the reused KV). Anything that replaces the tensors (`batch_select_indices`,
    `reorder_cache`, offloading) makes it a plain `DynamicLayer`: the next `update` finds tensors that are not views
    of its buffers and concatenates."""

    def __init__(self, room: int, buffers: tuple[torch.Tensor, torch.Tensor] | None = None, length: int = 0):
        super().__init__()
        self.room = max(1, room)
        self._buffers, self._views = buffers, None
        self._reserve = buffers is None  # the first forward's columns are not known yet: reserve them then
        if buffers is not None:
            self._set_views(length)
            self.device, self.is_initialized = buffers[0].device, True

    def _move(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        n = keys.shape[-2]
        self._buffers = tuple(t.new_empty(*t.shape[:-2], capacity, t.shape[-1]) for t in (keys, values))
        for buffer, t in zip(self._buffers, (keys, values)):
            buffer[..., :n, :] = t
        self._set_views(n)
        self.device, self.is_initialized = keys.device, True

    def _set_views(self, length: int) -> None:
        self.keys, self.values = self._views = tuple(buffer[..., :length, :] for buffer in self._buffers)

    def _owns_tensors(self) -> bool:
        """Whether `keys` / `values` are still the views this layer set (nothing replaced them since)."""
        return self._buffers is not None and self.keys is self._views[0] and self.values is self._views[1]

    def update(self, key_states, value_states, *args, **kwargs):
        if self._reserve:
            self._reserve = False
            self._move(key_states[..., :0, :], value_states[..., :0, :], key_states.shape[-2] + self.room)
        if not self._owns_tensors():
            self._buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if n + m > self._buffers[0].shape[-2]:
            self.room *= 2
            self._move(self.keys, self.values, n + m + self.room)
        for buffer, t in zip(self._buffers, (key_states, value_states)):
            buffer[..., n : n + m, :] = t
        self._set_views(n + m)
        return self.keys, self.values


@dataclass
class ReusePlan:
    """One call's inputs: the cache of the reused tokens and the ids / mask to give `generate` (each row's reused
    tokens in the cache's columns, which `generate` skips, then its tokens not covered by the cache). `cache` is None
    only in a plain layout (`left_padded`); with reuse it is always a cache the caller owns, which `generate` extends
    in place and `store` then reads (a model whose config says `use_cache=False` does not return it)."""

    cache: object | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    reused: list[int]  # tokens of each prefix whose KV came from the store


def left_padded(prefixes: list[list[int]], pad_id: int) -> ReusePlan:
    """The plain layout of a call that reuses nothing: every prefix whole, left-padded."""
    return PrefixKVStore()._plan(prefixes, pad_id, config=None)


def supports_reuse(model) -> bool:
    """Whether `model`'s default cache is a plain `DynamicCache` of full-attention layers, the only layout whose
    per-row KV can be cut out and spliced back (sliding-window, linear-attention or custom caches cannot)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if not getattr(base, "_supports_default_dynamic_cache", lambda: False)():
        return False
    try:
        cache = DynamicCache(config=config)
    except (KeyError, ValueError, TypeError, NotImplementedError):
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def check_max_bytes(max_bytes: int | None) -> None:
    """A cap on the prefix store is a positive whole number of bytes, or None (no cap)."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(
            f"max_prefix_cache_bytes must be a positive whole number of bytes of reused keys and values to keep, or "
            f"None (no cap); got {max_bytes!r}. To turn reuse off, set generation_cache='static' instead; to bound it, "
            "give e.g. 4 * 2**30 for 4 GiB."
        )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    return int(differ.argmax()) if differ.any() else n


class PrefixKVStore:
    """The KV of every sequence the current rollout's calls have processed, reused by the calls that continue them.

    Lookups go through the stored token sequences in lexicographic order (`_sorted`): the sequences that share a
    query's longest common prefix sit next to where the query would be inserted, so a lookup costs a binary search
    and a few comparisons instead of one comparison per stored row (a tree's rollout stores one row per branch and
    asks once per branch and call).

    Args:
        min_reuse: a prefix reuses a stored row only if they share at least this many tokens.
        max_bytes: the most bytes of keys and values kept between calls (None: no cap). Past it, the rows stored or
            reused longest ago are dropped (`_evict`). A call's own cache is not counted: it lives only during the
            call, as any `generate`'s does.
    """

    def __init__(self, min_reuse: int = MIN_REUSE, max_bytes: int | None = None):
        check_max_bytes(max_bytes)
        self.min_reuse = min_reuse
        self.max_bytes = max_bytes
        self.entries: list[_Entry] = []  # in the order they were stored
        self._sorted: list[tuple[bytes, int]] = []  # (entry.key, index in `entries`), sorted
        self._clock = 0  # advances at every plan and store: the recency `_evict` orders rows by
        self.reused_tokens = 0  # prefill tokens saved since the last clear (for benchmarks and tests)
        self.prefilled_tokens = 0
        self.bytes_held = 0  # keys and values of `entries`
        self.peak_bytes = 0  # the most `bytes_held` since the store was made or `reset_peak()` (kept by `clear`)
        self.evicted_bytes = 0  # dropped by the cap since the last clear

    def clear(self) -> None:
        self._keep([])
        self.reused_tokens = self.prefilled_tokens = self.evicted_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.bytes_held

    def _best(self, prefix) -> tuple[_Entry | None, int]:
        """The stored row sharing the longest common prefix with `prefix` (the earliest stored among equals), and
        how many of its tokens to reuse."""
        query = np.asarray(prefix, dtype=np.int64)
        position = bisect.bisect_left(self._sorted, (_sort_key(query), -1))
        # The common prefix with the query shrinks away from its insertion point, so the rows sharing the longest
        # one are its neighbours and the run of rows around them that share as much.
        neighbours = self._sorted[max(position - 1, 0) : position + 1]
        common = {i: _common_prefix(self.entries[i].tokens, query) for _, i in neighbours}
        best_len = max(common.values(), default=0)
        if not best_len:
            return None, 0
        for step, j in ((-1, position - 2), (1, position + 1)):
            while 0 <= j < len(self._sorted):
                i = self._sorted[j][1]
                common[i] = _common_prefix(self.entries[i].tokens, query)
                if common[i] < best_len:
                    break
                j += step
        best = min(i for i, n in common.items() if n == best_len)
        # at least one token is left to prefill: the next token's logits come from the last prefix token's forward
        best_len = min(best_len, len(query) - 1)
        return (self.entries[best], best_len) if best_len >= self.min_reuse else (None, 0)

    def plan(self, prefixes: list[list[int]], pad_id: int, model, max_new_tokens: int = 0) -> ReusePlan:
        """The cache of each prefix's longest stored prefix, and the ids left to prefill, for one `generate` call
        that samples at most `max_new_tokens` per row (the cache keeps room for them, up to `MAX_INITIAL_ROOM`).

        Heads that several prefixes of the call share beyond what is stored (a system prompt on the first turn, the
        prompt of a tree's M trajectories) are encoded first, once each (`_encode_shared_heads`); so are long tails
        in a call where most rows have almost nothing to prefill (`_encode_uneven_tails`)."""
        arrays = [np.asarray(p, dtype=np.int64) for p in prefixes]  # once: converting long lists is not free
        # the rows this call will reuse are the most recently used before anything is stored: the heads encoded
        # next must not push them out of a capped store in favour of older rows
        self._touch(entry for entry, _ in map(self._best, arrays))
        self._encode_shared_heads(prefixes, arrays, pad_id, model)
        self._encode_uneven_tails(prefixes, arrays, pad_id, model)
        return self._plan(prefixes, pad_id, model.config, arrays, room=min(max_new_tokens, MAX_INITIAL_ROOM))

    def _encode_shared_heads(self, prefixes: list[list[int]], arrays: list[np.ndarray], pad_id: int, model) -> None:
        """Store the KV of every longest head that two prefixes of the call share and no stored row covers: one
        forward, batch = distinct heads, itself reusing what is stored. Sorting the prefixes puts each one next to
        the prefix it shares most with, so the neighbours' common prefixes are every row's longest shared head."""
        order = sorted(range(len(prefixes)), key=lambda i: prefixes[i])
        shared = [0] * len(prefixes)
        for a, b in zip(order, order[1:]):
            n = _common_prefix(arrays[a], arrays[b])
            shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
        heads: dict[tuple[int, ...], None] = {}
        for i, prefix in enumerate(prefixes):
            n = min(shared[i], len(prefix) - 1)
            if n >= self.min_reuse and self._best(arrays[i])[1] < n:
                heads.setdefault(tuple(prefix[:n]), None)
        if heads:
            self._encode([list(h) for h in heads], pad_id, model)

    def _encode_uneven_tails(self, prefixes: list[list[int]], arrays: list[np.ndarray], pad_id: int, model) -> None:
        """`generate` prefills every row as wide as the longest tail, so a call that mixes rows resuming a turn (one
        token to prefill: chunked generation, `TurnLoop.step`) with rows starting one after an observation (hundreds)
        would pay the long tail for every row. When the rows with more than `min_reuse` tokens to prefill are at most
        half of the call, their prefixes (but their last token) are encoded first, in a forward of their own."""
        tails = [len(a) - self._best(a)[1] for a in arrays]
        long = [p[:-1] for p, tail in zip(prefixes, tails) if tail > self.min_reuse]
        if long and 2 * len(long) <= len(prefixes):
            self._encode(long, pad_id, model)

    def _encode(self, heads: list[list[int]], pad_id: int, model) -> None:
        """Store the KV of `heads` (each reusing what is stored): one forward, batch = heads."""
        plan = self._plan(heads, pad_id, model.config)
        mask = plan.attention_mask.to(model.device)
        cached = max(plan.reused)  # unlike `generate`, a forward does not skip the cache's columns
        with torch.no_grad():
            model(input_ids=plan.input_ids[:, cached:].to(model.device), attention_mask=mask,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, cached:], use_cache=True, logits_to_keep=1,
                  cache=plan.cache)
        self.store(plan.cache, plan.attention_mask, heads, [[] for _ in heads])

    def _plan(self, prefixes: list[list[int]], pad_id: int, config, arrays: list[np.ndarray] | None = None,
              room: int = 0) -> ReusePlan:
        """The call's layout; with a model config, also its cache: every layer a `GrowingLayer` holding the reused
        KV (an empty one when nothing is reused: a cache of our own, which `generate` fills in place whatever it
        returns), with `room` spare columns after the prefill."""
        if arrays is None:
            arrays = [np.asarray(p, dtype=np.int64) for p in prefixes]
        matches = [self._best(a) for a in arrays]
        self._touch(entry for entry, _ in matches)
        reused = [k for _, k in matches]
        width = max(reused)
        rest = max(len(p) - k for p, k in zip(prefixes, reused))
        input_ids = torch.full((len(prefixes), width + rest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (ids, k) in enumerate(zip(arrays, reused)):
            tail = torch.from_numpy(ids[k:])
            input_ids[row, width + rest - len(tail) :] = tail
            attention_mask[row, width + rest - len(tail) :] = 1
            if k:  # the reused tokens' own ids (`generate` skips them; a patched `generate` reads the whole prefix)
                input_ids[row, width - k : width] = torch.from_numpy(ids[:k])
                attention_mask[row, width - k : width] = 1
        self.reused_tokens += sum(reused)
        self.prefilled_tokens += sum(len(p) - k for p, k in zip(prefixes, reused))
        if config is None:
            return ReusePlan(None, input_ids, attention_mask, reused)
        cache = DynamicCache(config=config)
        if width == 0:
            cache.layers = [GrowingLayer(room) for _ in cache.layers]
            return ReusePlan(cache, input_ids, attention_mask, reused)
        reference = next(entry for entry, _ in matches if entry is not None)
        layers = []
        for layer, (k0, v0) in enumerate(zip(reference.keys, reference.values)):
            buffers = tuple(t.new_zeros(len(prefixes), t.shape[0], width + rest + room, t.shape[-1]) for t in (k0, v0))
            for row, (entry, k) in enumerate(matches):
                if entry is not None:
                    buffers[0][row, :, width - k : width] = entry.keys[layer][:, :k]
                    buffers[1][row, :, width - k : width] = entry.values[layer][:, :k]
            layers.append(GrowingLayer(room, buffers, width))
        cache.layers = layers
        return ReusePlan(cache, input_ids, attention_mask, reused)

    def store(self, cache, attention_mask: torch.Tensor, prefixes: list[list[int]], new_ids: list[list[int]]) -> None:
        """Keep each row's KV after a call: its prefix and the tokens it generated (`new_ids`, cut at its end of
        turn). `cache` is the plan's cache after the call and `attention_mask` the mask the call was given; the last
        generated token never went through the model, so its KV is not there."""
        width = attention_mask.shape[1]
        if cache.get_seq_length() < width:  # `generate` did not run on this cache (patched, e.g. scripted in tests)
            self._keep([])
            return
        generated_columns = cache.get_seq_length() - width
        fresh = []
        for row, (prefix, new) in enumerate(zip(prefixes, new_ids)):
            kept = min(len(new), generated_columns)
            columns = torch.cat([attention_mask[row].nonzero().flatten(), torch.arange(width, width + kept)])
            columns = columns.to(cache.layers[0].keys.device)
            fresh.append(
                _Entry(
                    tokens=np.asarray(list(prefix) + list(new[:kept]), dtype=np.int64),
                    keys=[layer.keys[row].index_select(1, columns) for layer in cache.layers],
                    values=[layer.values[row].index_select(1, columns) for layer in cache.layers],
                )
            )
        self._add(fresh)

    def _add(self, fresh: list[_Entry]) -> None:
        """Add the new rows; drop every row (old or new) whose tokens another row extends: its KV is a prefix of
        that row's, so no future prefix matches it better. Of identical rows the earliest stored stays. Then keep
        within `max_bytes` (`_evict`).

        In lexicographic order a row that another extends is a prefix of the row right after it (everything
        between a sequence and its extensions starts with it), so one pass over the sorted rows finds them."""
        self._touch(fresh)
        pool = self.entries + fresh
        order = sorted(range(len(pool)), key=lambda i: (pool[i].key, -i))  # identical rows: the earliest last
        dropped = {i for i, j in zip(order, order[1:]) if pool[j].key.startswith(pool[i].key)}
        kept = [i for i in range(len(pool)) if i not in dropped]
        self._keep(self._evict([pool[i] for i in kept]))

    def _touch(self, entries) -> None:
        """`entries` (None skipped) become the most recently used rows (`_evict`'s order)."""
        self._clock += 1
        for entry in entries:
            if entry is not None:
                entry.last_used = self._clock

    def _evict(self, entries: list[_Entry]) -> list[_Entry]:
        """`entries` less the least recently used ones, until their keys and values fit in `max_bytes`.

        Least recently used first, since a tree's next call continues its newest rows (a branch's next turn, a
        continuation from a turn its trajectory just reached), while a finished branch's row is reused only by a
        later anchor inside it. Among rows of the same call, the earliest stored goes first. Whole rows are
        dropped: a row's KV is only ever reused from its first token, so a part of it would be a shorter row."""
        held = sum(entry.nbytes for entry in entries)
        if self.max_bytes is None or held <= self.max_bytes:
            return entries
        evicted = set()
        for i in sorted(range(len(entries)), key=lambda i: (entries[i].last_used, i)):
            if held <= self.max_bytes:
                break
            evicted.add(i)
            held -= entries[i].nbytes
            self.evicted_bytes += entries[i].nbytes
        return [entry for i, entry in enumerate(entries) if i not in evicted]

    def _keep(self, entries: list[_Entry]) -> None:
        """The stored rows become `entries`, with their sorted index (every change of the rows goes through here)."""
        self.entries = entries
        self._sorted = sorted((entry.key, i) for i, entry in enumerate(entries))
        self.bytes_held = sum(entry.nbytes for entry in entries)
        self.peak_bytes = max(self.peak_bytes, self.bytes_held)
