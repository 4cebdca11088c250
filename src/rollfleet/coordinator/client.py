"""``CoordinatorClient``: the coordinator's API over HTTP, for trainers using ``rollfleet serve``.

Results are the same records the in-process coordinator returns (``BatchInfo``,
``FinalizeResult``, ``AbortResult``, ``ExperienceStats``), read from the server's JSON; errors are
the same rollfleet errors (NotFound, Conflict, InvalidInput), rebuilt from the server's
``{"error", "message"}`` body. With one URL nothing is retried. Given several control-plane
replicas, a call whose replica cannot be reached or answers 503 (no coordinator leads for now) goes
to the next one, for up to ``failover_s``: finalize is safe to send again (a finalized batch
answers the same result), and a submit sent again after its answer was lost answers ``Conflict``
(the batch id is taken: ``get_batch`` shows it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Hashable, Sequence
from typing import Any, TypeVar, cast

import httpx

from rollfleet.client.endpoints import split_urls
from rollfleet.coordinator.experiences import ExperienceStats
from rollfleet.coordinator.state import (
    AbortResult,
    BatchInfo,
    BatchType,
    FinalizeResult,
    StragglerPolicy,
)
from rollfleet.errors import StoreUnavailable
from rollfleet.model import RolloutConfig, RolloutSpec, adapter
from rollfleet.web.errors import error_from_answer
from rollfleet.web.serving import segment

FINALIZE_MARGIN_S = 30.0
FAILOVER_S = 60.0  # with several replicas: how long to go round them (a leader election included)
_DEFAULT: Any = object()
T = TypeVar("T")


class CoordinatorClient:
    """Submit, finalize, abort and process batches on a remote control plane (one URL, or several
    replicas: comma-separated or a list)."""

    def __init__(
        self,
        url: str | list[str],
        *,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        failover_s: float = FAILOVER_S,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self.urls = split_urls(url)
        self._failover_s = failover_s
        self._current = 0
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)

    async def _call(
        self, answer: type[T], method: str, path: str, body: Any = None, *, timeout: Any = _DEFAULT
    ) -> T:
        wait = self._timeout if timeout is _DEFAULT else timeout
        deadline = time.monotonic() + self._failover_s
        for attempt in itertools.count():
            url = self.urls[self._current]
            try:
                resp = await self._client.request(
                    method, url + "/batches" + path, json=body, timeout=wait
                )
            except httpx.TransportError as exc:
                failed: Exception = StoreUnavailable(f"coordinator at {url} unreachable: {exc}")
                failed.__cause__ = exc
            else:
                if resp.status_code < 400:
                    found: T = adapter(cast(Hashable, answer)).validate_json(resp.content)
                    return found
                failed = error_from_answer(resp.status_code, resp.content)
                if resp.status_code != 503:
                    raise failed
            # a dead replica, or none leads yet: with replicas, the next one, until failover_s
            if len(self.urls) == 1 or time.monotonic() >= deadline:
                raise failed
            self._current = (self._current + 1) % len(self.urls)
            if (attempt + 1) % len(self.urls) == 0:
                await asyncio.sleep(0.25)
        raise AssertionError("unreachable")

    async def submit_batch(
        self,
        batch_id: str | int,
        tasks: Sequence[Any],
        batch_type: BatchType = "train",
        min_wait_num: int | None = None,
        repeat_times: int = 1,
        *,
        policy: StragglerPolicy | str | None = None,
        mode: str | None = None,
        config: RolloutConfig | None = None,
        priority: int = 0,
        max_staleness: int | None = None,
    ) -> BatchInfo:
        """Submit task inputs or RolloutSpecs; the server checks the body (SubmitBatch)."""
        body: dict[str, Any] = {
            "batch_id": str(batch_id),
            "batch_type": batch_type,
            "min_wait_num": min_wait_num,
            "repeat_times": repeat_times,
            "policy": policy.value if isinstance(policy, StragglerPolicy) else policy,
            "mode": mode,
            "config": None if config is None else config.model_dump(mode="json"),
            "priority": priority,
            "max_staleness": max_staleness,
        }
        if tasks and all(isinstance(t, RolloutSpec) for t in tasks):
            body["specs"] = [t.model_dump(mode="json") for t in tasks]
        else:
            body["tasks"] = list(tasks)
        return await self._call(BatchInfo, "POST", "", body)

    async def get_batch(self, batch_id: str | int) -> BatchInfo:
        """One batch, its rollouts counted by status as they are now."""
        return await self._call(BatchInfo, "GET", f"/{segment(str(batch_id))}")

    async def list_batches(self) -> list[BatchInfo]:
        """Every batch, oldest first."""
        return await self._call(list[BatchInfo], "GET", "")

    async def _finalize(
        self, batch_id: str | int, timeout: float | None, wait_after_min: float | None
    ) -> FinalizeResult:
        body = {"timeout": timeout, "wait_after_min": wait_after_min}
        http_timeout = (
            None if timeout is None else timeout + (wait_after_min or 0.0) + FINALIZE_MARGIN_S
        )
        # no timeout: the request waits as long as the batch takes
        return await self._call(
            FinalizeResult,
            "POST",
            f"/{segment(str(batch_id))}/finalize",
            body,
            timeout=http_timeout,
        )

    async def finalize_train_batch(
        self,
        batch_id: str | int,
        *,
        timeout: float | None = None,
        wait_after_min: float | None = None,
    ) -> FinalizeResult:
        """Finalize a train batch on the server."""
        return await self._finalize(batch_id, timeout, wait_after_min)

    async def finalize_eval_batch(
        self, batch_id: str | int, *, timeout: float | None = None
    ) -> FinalizeResult:
        """Finalize an eval batch on the server."""
        return await self._finalize(batch_id, timeout, None)

    async def abort_batch(
        self, batch_id: str | int, *, reason: str, keep_partial_results: bool = False
    ) -> AbortResult:
        """Abort a batch on the server."""
        body = {"reason": reason, "keep_partial_results": keep_partial_results}
        return await self._call(AbortResult, "POST", f"/{segment(str(batch_id))}/abort", body)

    async def process_experiences(
        self, batch_id: str | int, *, estimator: str = "grpo"
    ) -> ExperienceStats:
        """Write the batch's experiences in the server's buffer directory, with advantages by
        ``estimator`` (grpo, drgrpo or rloo); return their figures."""
        return await self._call(
            ExperienceStats,
            "POST",
            f"/{segment(str(batch_id))}/experiences",
            {"estimator": estimator},
        )

    async def set_policy_version(self, version: int) -> list[str]:
        """Report the version the engines serve; the ids of held batches now admitted."""
        answer = await self._call(dict[str, Any], "POST", "/policy_version", {"version": version})
        return list(answer["admitted"])

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
