"""A call asked again is answered, not generated again.

When a runner dies while its model call is being generated, the gateway finishes the call for a
client that is gone: its step is refused (the attempt was fenced) or lands too late for the next
attempt to see it. The next attempt resumes at that turn and sends the same call again: same
rollout, messages, tools and sampling, with a seed (or greedily), so the engine would sample the
very same tokens. :class:`Repeats` answers it with the tokens already generated, or waits for
them while the first call still runs, and the gateway records them under the asking attempt with
``reuses`` naming the call that generated them.

Only calls whose answer is determined are reused: a seed or temperature 0, the weights version
the replica serves now, a result that was not aborted. A rollout only ever gets its own calls
back (the key names the rollout; a capability names the rollout). Bounded in calls kept.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import orjson

from rollfleet.engines.base import Generation, GenerationRequest

MAX_KEPT = 8192  # finished calls kept for a later attempt to be answered with


def call_key(
    request: GenerationRequest, rollout_id: str | None, model: str, version: int
) -> str | None:
    """What makes two calls of a rollout ask for the same tokens (None: nothing determines them:
    no rollout, a completion prompt, or sampling with no seed)."""
    params = request.params
    if not rollout_id or request.messages is None:
        return None
    if params.seed is None and params.temperature != 0:
        return None
    asked = [
        rollout_id,
        model,
        version,
        request.messages,
        request.tools,
        request.tool_choice,
        [params.max_tokens, params.temperature, params.top_p, params.seed, list(params.stop)],
        [params.logprobs, params.ignore_eos],
    ]
    return hashlib.sha256(orjson.dumps(asked, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Repeats:
    """The answers of determined calls, finished or in progress, by :func:`call_key`."""

    def __init__(self, kept: int = MAX_KEPT) -> None:
        self.kept = kept
        self.finished: OrderedDict[str, Generation] = OrderedDict()
        self.running: dict[str, asyncio.Future[Generation | None]] = {}
        self.answered = 0  # calls answered from here, for the gateway's figures

    async def answer(self, key: str | None) -> Generation | None:
        """The answer a call with ``key`` already has (waiting for the call that is producing
        it), or None: the caller generates it."""
        if key is None:
            return None
        result = self.finished.get(key)
        if result is None and key in self.running:
            result = await asyncio.shield(self.running[key])
        if result is None or result.aborted:
            return None
        self.answered += 1
        return result

    @contextmanager
    def producing(self, key: str | None) -> Iterator[asyncio.Future[Generation | None]]:
        """Mark the call with ``key`` as in progress; set the future to its result (an
        aborted one and a failure leave callers waiting on it to generate their own)."""
        future: asyncio.Future[Generation | None] = asyncio.get_running_loop().create_future()
        if key is not None:
            self.running.setdefault(key, future)
        try:
            yield future
        finally:
            if key is not None and self.running.get(key) is future:
                del self.running[key]
            result = future.result() if future.done() else None
            if not future.done():
                future.set_result(None)
            if key is not None and result is not None and not result.aborted:
                self.finished[key] = result
                self.finished.move_to_end(key)
                while len(self.finished) > self.kept:
                    self.finished.popitem(last=False)
