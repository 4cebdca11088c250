"""The llama.cpp engine's host-memory cache of evicted conversations: its bound, its order, and
which saved conversation a prompt finds (the state bytes here are stand-ins: what llama.cpp
writes is opaque to the cache)."""

from __future__ import annotations

import ctypes

import numpy as np

from rollfleet.engines.llamacpp.host_cache import MIN_TOKENS, HostCache


def state(nbytes: int) -> ctypes.Array[ctypes.c_uint8]:
    """A saved state of ``nbytes``."""
    return (ctypes.c_uint8 * nbytes)()


def tokens(start: int, n: int) -> list[int]:
    """``n`` token ids from ``start``."""
    return list(range(start, start + n))


def test_the_longest_shared_start_is_found_and_a_short_one_is_nothing() -> None:
    cache = HostCache(1 << 20)
    cache.put([1, 2, *tokens(100, 50)], state(100))
    cache.put([1, 2, *tokens(200, 50)], state(100))
    key, common = cache.best(np.asarray([1, 2, *tokens(200, 40), 7], dtype=np.int32)) or (0, 0)
    assert common == 42 and cache.entries[key].tokens[2] == 200
    assert cache.best(np.asarray([9, 9], dtype=np.int32)) is None


def test_a_conversations_next_turn_replaces_its_earlier_one() -> None:
    cache = HostCache(1 << 20)
    turn = tokens(0, 40)
    cache.put(turn, state(100))
    cache.put([*turn, *tokens(500, 40)], state(200))
    assert len(cache.entries) == 1 and cache.nbytes == 200 + 80 * 4


def test_the_budget_holds_and_the_least_recently_used_go_first() -> None:
    entry_bytes = 1000 + 40 * 4
    cache = HostCache(3 * entry_bytes)
    for i in range(3):
        cache.put(tokens(1000 * i, 40), state(1000))
    found = cache.best(np.asarray(tokens(0, 40), dtype=np.int32))
    assert found is not None
    cache.take(found[0], used=0)  # the oldest, restored whole-tail: kept, now the most recent
    cache.put(tokens(5000, 40), state(1000))
    starts = sorted(int(e.tokens[0]) for e in cache.entries.values())
    assert starts == [0, 2000, 5000] and cache.nbytes <= cache.budget
    cache.put(tokens(9000, 40), state(4 * entry_bytes))  # larger than the whole budget: not kept
    assert len(cache.entries) == 3


def test_a_restored_conversation_leaves_unless_a_long_tail_is_left_over() -> None:
    cache = HostCache(1 << 20)
    cache.put(tokens(0, 100), state(10))
    key = next(iter(cache.entries))
    cache.take(key, used=100 - MIN_TOKENS + 1)
    assert not cache.entries and cache.nbytes == 0 and cache.restored == 1
    cache.put(tokens(0, 100), state(10))
    key = next(iter(cache.entries))
    cache.take(key, used=100 - MIN_TOKENS)
    assert len(cache.entries) == 1
