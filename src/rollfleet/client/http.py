"""``HttpStore``: the Store protocol over the control plane's HTTP API.

Retries only what is safe: reads, heartbeats, enqueues (ids are chosen here, so a retried
enqueue finds the rollout it already created) and completions (repeating the same completion
is answered with the same rollout). Claims are never retried blindly: a lost answer leaves a
lease that simply expires. Given several control-plane URLs (replicas over one PostgreSQL
database), a failed request moves to the next replica, and the retries above go there; a claim
whose replica died is not sent again, but the runner's next claim goes to a live replica. An
answer 503 (a replica over its connection limit, or its store unavailable) moves the next request
on too; once every replica has failed in a row, retries wait from 0.5 s to 10 s with full jitter
(refused or reset connections: 0.05 s to 2 s), so that a refused fleet does not retry in step.

The transport is :mod:`rollfleet.client.wire`, a lean HTTP/1.1 client: this is every runner's
hot path, and the CPU a general-purpose client spends per request is CPU the runners' agents
do not get (docs/store.md has the measurements).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import orjson
from pydantic import BaseModel

from rollfleet.client.endpoints import Endpoints, backoff_s, split_urls
from rollfleet.errors import RollfleetError, StoreUnavailable
from rollfleet.model import (
    Attempt,
    AttemptStatus,
    Completion,
    CompletionOutcome,
    Handover,
    HeartbeatReply,
    Page,
    ReapReport,
    Resources,
    Rollout,
    RolloutResult,
    RolloutSpec,
    RolloutStatus,
    Statistics,
    Step,
    StepIn,
    Worker,
    WorkerStatus,
    adapter,
    new_id,
)
from rollfleet.store.blobs import Blob
from rollfleet.web.errors import error_from_answer
from rollfleet.web.serving import segment

T = TypeVar("T")
RETRIES = 4


def _decode(tp: type[T], content: bytes) -> T:
    return cast(T, adapter(cast(Any, tp)).validate_json(content))


def _body(value: Any) -> bytes:
    if isinstance(value, BaseModel):
        return value.model_dump_json().encode()
    return orjson.dumps(value, default=lambda v: v.model_dump(mode="json"))


async def _pause(attempt: int, replicas: int, overloaded: bool = False) -> None:
    """Back off once every replica has failed in a row; moving to another one waits for nothing.

    Overloaded replicas (503) are waited for with full jitter from 0.5 s up to 10 s; unreachable
    ones (a restart) 0.05 s doubling up to 2 s."""
    if (attempt + 1) % replicas == 0:
        rounds = attempt // replicas
        wait = backoff_s(rounds) if overloaded else min(2.0, 0.05 * 2**rounds)
        await asyncio.sleep(wait)


def _query(params: dict[str, Any] | None) -> list[tuple[str, str]] | None:
    """Query parameters as pairs; a list value repeats its key (``status=a&status=b``)."""
    if params is None:
        return None
    return [(k, str(x)) for k, v in params.items() for x in (v if isinstance(v, list) else [v])]


class HttpStore:
    """The Store protocol over HTTP, to one control plane or to several replicas (failover)."""

    def __init__(
        self, url: str | Sequence[str], *, token: str | None = None, timeout: float = 30.0
    ) -> None:
        urls = split_urls(url)
        self.url = urls[0]
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._endpoints = Endpoints(urls, headers)

    @property
    def urls(self) -> list[str]:
        """Every control-plane URL this store fails over between."""
        return self._endpoints.urls

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Any = None,
        retry: bool = False,
        timeout: float | None = None,
    ) -> bytes:
        content = None if body is None else _body(body)
        n = len(self._endpoints)
        tries = (RETRIES if retry else 1) + n - 1
        last: Exception | None = None
        for attempt in range(tries):
            index, client = self._endpoints.current()
            try:
                status, data = await client.request(
                    method, path, content, params=_query(params), timeout=timeout or self._timeout
                )
            except (OSError, TimeoutError) as exc:  # refused, reset, closed early, or too slow
                last = exc
                self._endpoints.failed(index)
                unsent = isinstance(exc, ConnectionRefusedError)  # no server read it
                if attempt < tries - 1 and (retry or unsent):
                    await _pause(attempt, n)
                    continue
                break
            if status >= 500:  # the next request goes to the next replica, retried or not
                self._endpoints.failed(index)
                if retry and attempt < tries - 1:
                    await _pause(attempt, n, overloaded=status == 503)
                    continue
            if status >= 400:  # a bare 503 (a server over its connection limit) is unavailable
                unavailable = StoreUnavailable if status == 503 else RollfleetError
                raise error_from_answer(status, data, default=unavailable)
            return data
        where = ", ".join(self._endpoints.urls)
        raise StoreUnavailable(f"cannot reach the rollfleet server at {where}: {last!r}") from last

    # --- writes ---------------------------------------------------------------------------------

    async def enqueue_rollout(self, input: Any, mode: str | None = None, **fields: Any) -> Rollout:
        """Queue one rollout; the id is chosen here so a retry cannot enqueue twice."""
        return (await self.enqueue_many([RolloutSpec(input=input, mode=mode, **fields)]))[0]

    async def enqueue_many(self, specs: Sequence[RolloutSpec]) -> list[Rollout]:
        """Queue many rollouts in one transaction: all or nothing."""
        items = [
            sp if sp.rollout_id else sp.model_copy(update={"rollout_id": new_id("ro")})
            for sp in specs
        ]
        if not items:
            return []
        body = {"items": [i.model_dump(mode="json") for i in items]}
        return _decode(list[Rollout], await self._call("POST", "/rollouts/batch", body, retry=True))

    async def start_rollout(
        self, input: Any, mode: str | None = None, worker_id: str | None = None, **fields: Any
    ) -> Rollout:
        """Create a rollout already PREPARING and leased to the caller."""
        spec = RolloutSpec(input=input, mode=mode, **fields).model_dump(mode="json")
        return _decode(
            Rollout, await self._call("POST", "/rollouts/start", {**spec, "worker_id": worker_id})
        )

    async def claim(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[Rollout]:
        """Lease up to ``max_n`` queued rollouts; waits up to ``wait_s`` for one to arrive.

        Cancelling this call closes its connection; the server then leases nothing to it
        (``abandoned`` is for in-process stores and is not sent).
        """
        return _decode(list[Rollout], await self._claim(worker_id, wait_s, max_n))

    async def claim_documents(
        self,
        worker_id: str,
        wait_s: float = 0.0,
        max_n: int = 1,
        abandoned: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[dict[str, Any]]:
        """``claim``, answered as plain JSON values."""
        return list(orjson.loads(await self._claim(worker_id, wait_s, max_n)))

    async def _claim(self, worker_id: str, wait_s: float, max_n: int) -> bytes:
        body = {"worker_id": worker_id, "wait_s": wait_s, "max_n": max_n}
        return await self._call("POST", "/claims", body, timeout=wait_s + self._timeout)

    async def heartbeat(self, attempt_id: str) -> HeartbeatReply:
        """Extend an attempt's lease; the reply says whether to keep going."""
        return _decode(
            HeartbeatReply,
            await self._call("POST", f"/attempts/{segment(attempt_id)}/heartbeat", retry=True),
        )

    async def heartbeat_many(
        self, attempt_ids: Sequence[str], worker_id: str | None = None
    ) -> list[HeartbeatReply]:
        """Extend several leases and the worker's own heartbeat in one call."""
        path = f"/workers/{segment(worker_id or '-')}/heartbeat"
        return _decode(
            list[HeartbeatReply],
            await self._call("POST", path, {"attempt_ids": list(attempt_ids)}, retry=True),
        )

    async def add_steps(self, attempt_id: str, steps: Sequence[StepIn]) -> int:
        """Append trajectory steps; refused unless the attempt still owns the rollout."""
        body = {"steps": [st.model_dump(mode="json") for st in steps]}
        return int(
            orjson.loads(await self._call("POST", f"/attempts/{segment(attempt_id)}/steps", body))[
                "added"
            ]
        )

    async def complete(
        self,
        attempt_id: str,
        status: AttemptStatus,
        result: RolloutResult | None = None,
        error: str | None = None,
    ) -> Rollout:
        """End an attempt with its outcome; fenced by attempt id, safe to retry."""
        body = {
            "status": AttemptStatus(status).value,
            "result": None if result is None else result.model_dump(mode="json"),
            "error": error,
        }
        return _decode(
            Rollout,
            await self._call("POST", f"/attempts/{segment(attempt_id)}/complete", body, retry=True),
        )

    async def complete_many(self, items: Sequence[Completion]) -> list[CompletionOutcome]:
        """End many attempts in one request; each is fenced and answered on its own (safe to
        retry)."""
        if not items:
            return []
        body = {"items": [i.model_dump(mode="json") for i in items]}
        return _decode(
            list[CompletionOutcome],
            await self._call("POST", "/attempts/complete", body, retry=True),
        )

    async def complete_and_claim(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> Handover:
        """End attempts and lease up to ``max_n`` more in one request; a refused completion
        claims nothing. Not sent again after a failure (a lost answer's lease would be orphaned):
        StoreUnavailable, and the caller completes alone (``complete_many`` is safe to retry)."""
        return _decode(Handover, await self._complete_and_claim(items, worker_id, max_n))

    async def complete_and_claim_documents(
        self, items: Sequence[Completion], worker_id: str, max_n: int = 1
    ) -> dict[str, Any]:
        """``complete_and_claim``, answered as plain JSON values."""
        return dict(orjson.loads(await self._complete_and_claim(items, worker_id, max_n)))

    async def _complete_and_claim(
        self, items: Sequence[Completion], worker_id: str, max_n: int
    ) -> bytes:
        body = {
            "items": [i.model_dump(mode="json") for i in items],
            "worker_id": worker_id,
            "max_n": max_n,
        }
        return await self._call("POST", "/attempts/complete-and-claim", body)

    async def release(self, attempt_id: str, reason: str = "released") -> Rollout:
        """Give a rollout back to the queue without charging its retry budget."""
        return _decode(
            Rollout,
            await self._call(
                "POST", f"/attempts/{segment(attempt_id)}/release", {"reason": reason}
            ),
        )

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout that has not finished (idempotent)."""
        return _decode(
            Rollout, await self._call("POST", f"/rollouts/{segment(rollout_id)}/cancel", retry=True)
        )

    async def requeue(
        self,
        statuses: Sequence[RolloutStatus] = (RolloutStatus.PREPARING,),
        rollout_ids: Sequence[str] | None = None,
        older_than_s: float = 0.0,
    ) -> list[str]:
        """Operator reset: put stuck PREPARING/RUNNING rollouts back in the queue."""
        body = {
            "statuses": [RolloutStatus(x).value for x in statuses],
            "rollout_ids": None if rollout_ids is None else list(rollout_ids),
            "older_than_s": older_than_s,
        }
        return list(
            orjson.loads(await self._call("POST", "/rollouts/requeue", body))["rollout_ids"]
        )

    async def reap(self) -> ReapReport:
        """Ask the server to expire lapsed leases now."""
        return _decode(ReapReport, await self._call("POST", "/reap", retry=True))

    # --- reads ----------------------------------------------------------------------------------

    async def get_rollout(self, rollout_id: str) -> Rollout:
        """Return one rollout or raise NotFound."""
        return _decode(
            Rollout, await self._call("GET", f"/rollouts/{segment(rollout_id)}", retry=True)
        )

    async def query_rollouts(
        self,
        *,
        status: Any = None,
        mode: str | None = None,
        batch_id: str | None = None,
        group_id: str | None = None,
        worker_id: str | None = None,
        search: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        order: str = "asc",
    ) -> Page[Rollout]:
        """Return a page of rollouts matching the filters."""
        if isinstance(status, (str, RolloutStatus)):
            status = [status]
        params = {
            "status": None if status is None else [RolloutStatus(x).value for x in status],
            "mode": mode,
            "batch_id": batch_id,
            "group_id": group_id,
            "worker_id": worker_id,
            "search": search,
            "cursor": cursor,
            "limit": limit,
            "order": order,
        }
        clean = {k: v for k, v in params.items() if v is not None}
        return _decode(
            Page[Rollout], await self._call("GET", "/rollouts", params=clean, retry=True)
        )

    async def query_attempts(
        self,
        rollout_id: str | None = None,
        worker_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> Page[Attempt]:
        """Return a page of attempts."""
        params = {
            "rollout_id": rollout_id,
            "worker_id": worker_id,
            "cursor": cursor,
            "limit": limit,
            "status": None if status is None else [AttemptStatus(x).value for x in status],
        }
        clean = {k: v for k, v in params.items() if v is not None}
        return _decode(
            Page[Attempt], await self._call("GET", "/attempts", params=clean, retry=True)
        )

    async def register_worker(
        self, worker_id: str, metadata: dict[str, Any] | None = None, lease_s: float = 30.0
    ) -> Worker:
        """Create or revive a worker as IDLE."""
        body = {"worker_id": worker_id, "metadata": metadata or {}, "lease_s": lease_s}
        return _decode(Worker, await self._call("POST", "/workers", body, retry=True))

    async def update_worker(self, worker_id: str, status: WorkerStatus | None = None) -> Worker:
        """Record a worker's heartbeat and, if given, its status."""
        body = {"status": None if status is None else WorkerStatus(status).value}
        return _decode(
            Worker, await self._call("PATCH", f"/workers/{segment(worker_id)}", body, retry=True)
        )

    async def query_workers(self, cursor: str | None = None, limit: int = 100) -> Page[Worker]:
        """Return a page of workers."""
        params = {k: v for k, v in {"cursor": cursor, "limit": limit}.items() if v is not None}
        return _decode(Page[Worker], await self._call("GET", "/workers", params=params, retry=True))

    async def query_steps(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        cursor: str | None = None,
        limit: int = 500,
    ) -> Page[Step]:
        """Return a page of a rollout's steps in order."""
        params = {
            k: v
            for k, v in {"attempt_id": attempt_id, "cursor": cursor, "limit": limit}.items()
            if v is not None
        }
        return _decode(
            Page[Step],
            await self._call(
                "GET", f"/rollouts/{segment(rollout_id)}/steps", params=params, retry=True
            ),
        )

    async def query_steps_many(
        self, rollout_ids: Sequence[str], cursor: str | None = None, limit: int = 500
    ) -> Page[Step]:
        """Return a page of the steps of up to 1,000 rollouts, by rollout id then sequence."""
        body = {"rollout_ids": list(rollout_ids), "cursor": cursor, "limit": limit}
        answer = await self._call("POST", "/rollouts/steps", body, retry=True)
        page: Page[Step] = _decode(Page[Step], answer)
        return page

    async def add_resources(
        self, values: dict[str, Any], resources_id: str | None = None
    ) -> Resources:
        """Store a new version of the resources agents use (id chosen here: safe to retry)."""
        body = {"values": values, "resources_id": resources_id or new_id("res")}
        return _decode(Resources, await self._call("POST", "/resources", body))

    async def get_blob(self, sha256: str) -> Blob:
        """One image of a trajectory by its sha256 (``rollfleet-blob:<sha256>`` in a step)."""
        doc = orjson.loads(await self._call("GET", f"/blobs/{segment(sha256)}", retry=True))
        return Blob(doc["sha256"], doc["media_type"], base64.b64decode(doc["data"]))

    async def get_latest_resources(self) -> Resources | None:
        """Return the newest resources, or None."""
        found = await self._call("GET", "/resources/latest", retry=True)
        return cast(Resources | None, adapter(Resources | None).validate_json(found))

    async def statistics(self) -> Statistics:
        """Counts by status, queue depth and totals."""
        return _decode(Statistics, await self._call("GET", "/statistics", retry=True))

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: float) -> list[Rollout]:
        """Wait until every given rollout is terminal or the timeout passes; return them as they
        are."""
        body = {"rollout_ids": list(rollout_ids), "timeout": timeout}
        return _decode(
            list[Rollout],
            await self._call(
                "POST", "/rollouts/wait", body, retry=True, timeout=timeout + self._timeout
            ),
        )

    async def put_state(self, key: str, value: Any) -> None:
        """Store a JSON value under a key."""
        await self._call("PUT", f"/state/{segment(key)}", {"value": value}, retry=True)

    async def get_state(self, key: str) -> Any:
        """Return the JSON value under a key, or None."""
        return orjson.loads(await self._call("GET", f"/state/{segment(key)}", retry=True))["value"]

    async def scan_state(self, prefix: str) -> dict[str, Any]:
        """Return every stored key/value under a prefix."""
        found: dict[str, Any] = orjson.loads(
            await self._call(
                "GET", f"/state/{segment(prefix)}", params={"prefix": "true"}, retry=True
            )
        )
        return found

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Nothing to start: the server this store talks to runs the reaper."""

    async def close(self) -> None:
        """Close the HTTP connections."""
        self._endpoints.close()
