"""``CoordinatorClient``: the coordinator's API over HTTP, for a trainer talking to ``rollfleet serve``.

Results are the same dicts the in-process coordinator returns; errors are the same rollfleet
errors (NotFound, Conflict, InvalidInput), rebuilt from the server's ``{"error", "message"}`` body.
Only reads are retried: a submit is idempotent by batch id on the server, but a repeated finalize
could wait twice as long, so nothing else is retried blindly.
"""

from __future__ import annotations

from typing import Any

import httpx

from rollfleet.errors import StoreUnavailable
from rollfleet.model import RolloutConfig, RolloutSpec
from rollfleet.web.errors import error_from_answer

FINALIZE_MARGIN_S = 30.0
_DEFAULT: Any = object()


class CoordinatorClient:
    """Submit, finalize, abort and process batches on a remote control plane."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                         timeout=timeout, transport=transport)

    async def _call(self, method: str, path: str, body: Any = None, *, timeout: Any = _DEFAULT) -> Any:
        wait = self._timeout if timeout is _DEFAULT else timeout
        try:
            resp = await self._client.request(method, "/batches" + path, json=body, timeout=wait)
        except httpx.TransportError as exc:
            raise StoreUnavailable(f"coordinator at {self._client.base_url} unreachable: {exc}") from exc
        if resp.status_code >= 400:
            raise error_from_answer(resp.status_code, resp.content)
        return resp.json()

    async def submit_batch(self, batch_id: str | int, tasks: list[Any], batch_type: str = "train",
                           min_wait_num: int | None = None, repeat_times: int = 1, **options: Any) -> dict[str, Any]:
        """Submit a batch of task inputs or RolloutSpecs (options: policy, mode, config, priority)."""
        body = {"batch_id": str(batch_id), "batch_type": batch_type, "min_wait_num": min_wait_num,
                "repeat_times": repeat_times, **options}
        if tasks and all(isinstance(t, RolloutSpec) for t in tasks):
            body["specs"] = [t.model_dump(mode="json") for t in tasks]
        else:
            body["tasks"] = tasks
        if isinstance(body.get("config"), RolloutConfig):
            body["config"] = body["config"].model_dump(mode="json")
        result: dict[str, Any] = await self._call("POST", "", body)
        return result

    async def get_batch(self, batch_id: str | int) -> dict[str, Any]:
        """One batch."""
        result: dict[str, Any] = await self._call("GET", f"/{batch_id}")
        return result

    async def list_batches(self) -> list[dict[str, Any]]:
        """Every batch."""
        result: list[dict[str, Any]] = await self._call("GET", "")
        return result

    async def _finalize(self, batch_id: str | int, timeout: float | None, wait_after_min: float | None) -> Any:
        body = {"timeout": timeout, "wait_after_min": wait_after_min}
        http_timeout = None if timeout is None else timeout + (wait_after_min or 0.0) + FINALIZE_MARGIN_S
        return await self._call("POST", f"/{batch_id}/finalize", body, timeout=http_timeout)  # None: as long as it takes

    async def finalize_train_batch(self, batch_id: str | int, *, timeout: float | None = None,
                                   wait_after_min: float | None = None) -> dict[str, Any]:
        """Finalize a train batch on the server."""
        result: dict[str, Any] = await self._finalize(batch_id, timeout, wait_after_min)
        return result

    async def finalize_eval_batch(self, batch_id: str | int, *, timeout: float | None = None) -> dict[str, Any]:
        """Finalize an eval batch on the server."""
        result: dict[str, Any] = await self._finalize(batch_id, timeout, None)
        return result

    async def abort_batch(self, batch_id: str | int, *, reason: str,
                          keep_partial_results: bool = False) -> dict[str, Any]:
        """Abort a batch on the server."""
        body = {"reason": reason, "keep_partial_results": keep_partial_results}
        result: dict[str, Any] = await self._call("POST", f"/{batch_id}/abort", body)
        return result

    async def process_experiences(self, batch_id: str | int, *, std_normalize: bool = True) -> dict[str, Any]:
        """Write the batch's experiences into the server's buffer directory; returns their metrics."""
        result: dict[str, Any] = await self._call("POST", f"/{batch_id}/experiences",
                                                  {"std_normalize": std_normalize})
        return result

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
