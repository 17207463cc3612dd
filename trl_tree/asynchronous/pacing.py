"""Staleness pacing: which generation batches the worker may grow, with which policy version, and their rows.

A version is a generation batch: the trainer trains batch b with π_old = version b (the weights after b batches). The
worker grows batch j with version `behaviour_version(j, ...)` = max(start, j − max_staleness): exactly
`max_staleness` versions behind the batch's π_old in steady state, fewer after a (re)start. Batch j is admitted
(handed to the worker) at the trainer's boundary b = j − max_staleness, the moment version b exists; so staleness is
bounded by when a batch starts, and no finished tree is ever dropped. Taking the oldest version allowed rather than
the newest available makes the staleness exact, hence a seeded run reproducible, whatever the timing.

`ReadAhead` gives the worker the rows of upcoming generation batches before TRL's loop hands them over: it wraps the
loop's own epoch iterator, so the rows read ahead are the very objects, in the very order, the loop trains on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any


def behaviour_version(batch: int, start: int, max_staleness: int) -> int:
    """The policy version that samples generation batch `batch` of a session that started at batch `start`."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}.")
    if batch < start:
        raise ValueError(f"Generation batch {batch} comes before the session's first batch ({start}).")
    return max(start, batch - max_staleness)


def admitted(current: int, max_staleness: int) -> range:
    """The generation batches that must have been admitted once the trainer starts batch `current`: current up to
    current + max_staleness (the last of them is admitted now, with the weights just published)."""
    return range(current, current + max_staleness + 1)


class ReadAhead:
    """The training loop's epoch iterator, readable ahead.

    The loop takes items with `next`, as before; `peek(position)` returns the item at `position` (0 is the first item
    this iterator ever handed or will hand) without taking it, reading the source ahead into a buffer, or None past
    the source's end. `position_of(item)` finds an item the loop has taken by identity: the loop passes the very
    object it took to the trainer, which is how the trainer knows where in the stream it is (transformers prefetches
    a whole optimizer step of items, so counting calls would not tell)."""

    def __init__(self, source: Iterator):
        self.source = source
        self._ahead: deque = deque()  # read from the source, not yet handed to the loop
        self._handed: deque[tuple[int, Any]] = deque()  # (position, item) handed, not yet located
        self._next = 0  # position of the next item the loop takes
        self._ended = False

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self):
        item = self._ahead.popleft() if self._ahead else next(self.source)
        self._handed.append((self._next, item))
        self._next += 1
        return item

    def peek(self, position: int):
        """The item at `position` (at or after the next one the loop takes), or None past the end."""
        if position < self._next:
            raise ValueError(f"Position {position} was already handed to the training loop (next: {self._next}).")
        while len(self._ahead) <= position - self._next:
            if self._ended:
                return None
            try:
                self._ahead.append(next(self.source))
            except StopIteration:
                self._ended = True
                return None
        return self._ahead[position - self._next]

    def position_of(self, item) -> int | None:
        """The position of `item`, which the loop took from this iterator, or None if it did not come from here.
        Items handed before it are forgotten (the loop trains in order)."""
        for k, (position, handed) in enumerate(self._handed):
            if handed is item:
                for _ in range(k + 1):
                    self._handed.popleft()
                return position
        return None
