"""Conversations evicted from the KV cells, kept in host memory and restored on their next turn.

The engine's KV cells hold one conversation per sequence. When a new conversation needs a free
sequence, the one that sequence held is dropped, and its next turn (a tool call that took a
while, a runner that died and resumes the rollout on another) prefills every prompt token again:
on one CPU thread, ~300 tokens cost about a second. Keeping more idle sequences in the cells
avoids that but slows every decode step, since each token attends over every cell in use
(docs/engines/llamacpp.md). Here an evicted sequence's cells are copied out instead
(``llama_state_seq_get_data``: its K and V rows, ~23 KB a token for the bundled model), and a
later prompt that starts with the same tokens copies them back into its sequence
(``llama_state_seq_set_data``) and prefills only the rest: a memory copy instead of a forward
pass, and nothing for a decode step to walk meanwhile. llama-server's ``--cache-ram`` does the
same.

The cache is bounded by bytes, least recently used first out; a conversation that a later one
extends (its next turn) is replaced by it. Entries belong to one model: a weight swap or a new
adapter drops them all (their keys and values were computed with the old weights).
"""

from __future__ import annotations

import ctypes
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 32  # a shorter conversation (or a shorter dropped tail) is cheaper to prefill again


@dataclass(frozen=True, slots=True)
class Entry:
    """One saved conversation: the tokens its cells hold and their state, as llama.cpp wrote it."""

    tokens: np.ndarray  # int32
    state: ctypes.Array[ctypes.c_uint8]

    @property
    def nbytes(self) -> int:
        """The memory it holds."""
        return len(self.state) + self.tokens.nbytes


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two int32 arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class HostCache:
    """Saved KV states, bounded by ``budget`` bytes, least recently used first out."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.nbytes = 0
        self._keys = itertools.count()
        self.restored = 0  # conversations taken back, for the figures

    def put(self, tokens: list[int], state: ctypes.Array[ctypes.c_uint8]) -> None:
        """Keep a conversation; the ones it extends go, and older ones while over budget."""
        entry = Entry(np.asarray(tokens, dtype=np.int32), state)
        if entry.nbytes > self.budget:
            return
        for key, old in list(self.entries.items()):
            if common_length(old.tokens, entry.tokens) == len(old.tokens):
                self._drop(key)  # an earlier turn of the same conversation
        self.entries[next(self._keys)] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget:
            self._drop(next(iter(self.entries)))

    def best(self, prompt: np.ndarray) -> tuple[int, int] | None:
        """The entry sharing the longest start with ``prompt``: its key and that length."""
        found = None
        for key, entry in self.entries.items():
            common = common_length(entry.tokens, prompt)
            if common and (found is None or common > found[1]):
                found = (key, common)
        return found

    def take(self, key: int, used: int) -> Entry:
        """An entry, to restore its first ``used`` tokens: dropped from the cache, unless the rest
        is long enough to be worth keeping (then it is the most recently used)."""
        entry = self.entries[key]
        if len(entry.tokens) - used >= MIN_TOKENS:
            self.entries.move_to_end(key)
        else:
            self._drop(key)
        self.restored += 1
        return entry

    def clear(self) -> None:
        """Drop every entry (new weights)."""
        self.entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
