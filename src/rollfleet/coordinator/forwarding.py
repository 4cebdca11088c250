"""``/batches`` on a replica that does not lead: forwarded to the leader's URL.

An ASGI middleware inside the request guard. On the leader, and for every other path, it does
nothing. Elsewhere it reads the request's body and sends it to the leader the election published,
answering with the leader's status and body. Between leaders (the old one died, the next has not
taken over yet) it waits up to ``wait_s`` for one, serving the request itself if this replica is
elected meanwhile, and then answers 503 ``StoreUnavailable``: clients retry that. A request that
was already forwarded once is never forwarded again (no loops through a stale leader record).
A batch request cut off by this replica's shutdown (a finalize waiting here, served or forwarded)
is answered 503 rather than uvicorn's 500, so the client sends it to another replica.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson

from rollfleet.coordinator.election import Election

PREFIX = "/batches"
FORWARDED = b"x-rollfleet-forwarded"
KEPT = {b"authorization", b"content-type"}
Scope = dict[str, Any]
Receive = Any
Send = Any


class LeaderForwarding:
    """Forward ``/batches`` requests to the coordinator leader unless this replica leads."""

    def __init__(self, app: Any, election: Election, wait_s: float = 20.0) -> None:
        self.app = app
        self.election = election
        self.wait_s = wait_s
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve locally when leading (or not a batch request), else forward."""
        path = scope.get("path", "")
        here = scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/"))
        if here:
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._batches(scope, receive, tracked)
        except asyncio.CancelledError:  # this replica is shutting down: clients retry a 503
            if not started:
                await _unavailable(send, "this control-plane replica is shutting down; retry")
            raise

    async def _batches(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.election.is_leader:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        replay = _replay(body, receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in KEPT}
        again = any(k == FORWARDED for k, _ in scope["headers"])
        deadline = time.monotonic() + self.wait_s
        while True:
            if self.election.is_leader:
                await self.app(scope, replay, send)
                return
            url = None if again else await self.election.leader_url()
            if url and url != self.election.url:
                answer = await self._forward(scope, url, body, headers)
                if answer is not None:
                    await _answer(send, answer.status_code, answer.content, answer.headers)
                    return
            if time.monotonic() >= deadline:
                await _unavailable(send, "no batch coordinator leads now (one takes over shortly)")
                return
            await self.election.changed(0.25)

    async def _forward(
        self, scope: Scope, url: str, body: bytes, headers: dict[str, str]
    ) -> httpx.Response | None:
        """The leader's answer, or None when it cannot be reached (it may have just died)."""
        query = scope.get("query_string", b"").decode()
        target = url.rstrip("/") + scope["path"] + (f"?{query}" if query else "")
        try:
            return await self._client.request(
                scope["method"],
                target,
                content=body,
                headers={**headers, FORWARDED.decode(): "1"},
            )
        except httpx.TransportError:
            return None


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands out the body already read, then the client's own messages."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replay


async def _unavailable(send: Send, message: str) -> None:
    content = orjson.dumps({"error": "StoreUnavailable", "message": f"{message}; retry"})
    await _answer(send, 503, content, {"content-type": "application/json"})


async def _answer(send: Send, status: int, content: bytes, headers: Any) -> None:
    kept = [(b"content-type", str(headers.get("content-type", "application/json")).encode())]
    kept.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": kept})
    await send({"type": "http.response.body", "body": content})
