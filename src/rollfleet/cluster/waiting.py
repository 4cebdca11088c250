"""Waiting on Ray results: timeouts that name both ends, and remote errors turned back into
the exception the worker raised, annotated with the worker's address."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from typing import Any

import ray
from ray import exceptions as rayexc

from rollfleet.cluster.rank import current_worker
from rollfleet.errors import ClusterError, ClusterTimeout

DEATH_ERRORS = (
    rayexc.RayActorError,
    rayexc.ActorUnavailableError,
    rayexc.OwnerDiedError,
    rayexc.ObjectLostError,
)


def unwrap(exc: BaseException, where: str, what: str, node: str | None = None) -> BaseException:
    """The exception to raise for a Ray error that happened at ``where`` (on ``node``) while doing
    ``what``."""
    if isinstance(exc, rayexc.RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException) and not isinstance(cause, rayexc.RayError):
            cause.add_note(f"raised on worker {where} during {what}")
            cause.__cause__ = exc
            cause.worker_address = where  # type: ignore[attr-defined]
            return cause
        return ClusterError(f"{what} failed on worker {where}: {exc}")
    if isinstance(exc, DEATH_ERRORS):
        on = "" if node is None else f" (it ran on node {node})"
        return ClusterError(f"worker {where} died during {what}{on}: {type(exc).__name__}: {exc}")
    if isinstance(exc, rayexc.GetTimeoutError):
        return ClusterTimeout(f"{what}: no answer from {where}")
    return exc


def caller_name() -> str:
    """The address of the worker this code runs in, or ``"driver"``."""
    current = current_worker()
    return current.worker_address.get_name() if current is not None else "driver"


def get_all(
    refs: Sequence[ray.ObjectRef[Any]],
    wheres: Sequence[str],
    what: str,
    timeout: float | None,
    nodes: Sequence[str] | None = None,
) -> list[Any]:
    """``ray.get`` every ref; raise the first (lowest-rank) failure once all have finished.

    ``nodes``: where each worker runs, named when one of them died."""
    refs = list(refs)
    try:
        return list(ray.get(refs, timeout=timeout))
    except rayexc.GetTimeoutError:
        raise _timeout(refs, wheres, what, timeout) from None
    except Exception:  # noqa: BLE001 - sorted out per rank below
        pass
    if len(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0]) < len(refs):
        raise _timeout(refs, wheres, what, timeout)
    return _results_or_raise(refs, wheres, what, nodes)


def _timeout(
    refs: list[ray.ObjectRef[Any]], wheres: Sequence[str], what: str, timeout: float | None
) -> ClusterTimeout:
    """A ClusterTimeout naming the caller and the workers that have not answered."""
    pending = set(ray.wait(refs, num_returns=len(refs), timeout=0)[1])
    late = [w for ref, w in zip(refs, wheres, strict=True) if ref in pending] or list(wheres)
    return ClusterTimeout(
        f"{what}: {', '.join(late)} did not answer {caller_name()} within {timeout}s"
    )


def _results_or_raise(
    refs: Sequence[ray.ObjectRef[Any]],
    wheres: Sequence[str],
    what: str,
    nodes: Sequence[str] | None = None,
) -> list[Any]:
    """Wait for every ref, then raise the first error (others are attached as notes)."""
    results: list[Any] = []
    errors: list[BaseException] = []
    for i, (ref, where) in enumerate(zip(refs, wheres, strict=True)):
        try:
            results.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            errors.append(unwrap(exc, where, what, None if nodes is None else nodes[i]))
    if not errors:
        return results
    first = errors[0]
    for other in errors[1:]:
        first.add_note(
            f"also failed: {type(other).__name__}: {other} ({getattr(other, 'worker_address', '')})"
        )
    raise first


async def get_all_async(
    refs: Sequence[ray.ObjectRef[Any]],
    wheres: Sequence[str],
    what: str,
    timeout: float | None,
    nodes: Sequence[str] | None = None,
) -> list[Any]:
    """Awaitable twin of :func:`get_all`."""
    done = asyncio.gather(*refs, return_exceptions=True)
    try:
        outcomes = await asyncio.wait_for(done, timeout)
    except TimeoutError:
        raise ClusterTimeout(
            f"{what}: {', '.join(wheres)} did not answer {caller_name()} within {timeout}s"
        ) from None
    errors = [
        unwrap(o, w, what, None if nodes is None else nodes[i])
        for i, (o, w) in enumerate(zip(outcomes, wheres, strict=True))
        if isinstance(o, BaseException)
    ]
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"also failed: {type(other).__name__}: {other}")
        raise errors[0]
    return list(outcomes)


class Work:
    """A waitable result: ``.wait(timeout)`` blocks, ``await work`` suspends; ``.done()`` peeks."""

    __slots__ = ("_refs", "_wheres", "_what", "_finish", "_nodes")

    def __init__(
        self,
        refs: list[ray.ObjectRef[Any]],
        wheres: Sequence[str],
        what: str,
        finish: Callable[[list[Any]], Any] = list,
        *,
        nodes: Sequence[str] | None = None,
    ) -> None:
        self._refs = refs
        self._wheres = wheres
        self._what = what
        self._finish = finish
        self._nodes = nodes

    def done(self) -> bool:
        """True once every part has finished (successfully or not)."""
        return not ray.wait(self._refs, num_returns=len(self._refs), timeout=0)[1]

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; raise the remote exception or ClusterTimeout."""
        return self._finish(get_all(self._refs, self._wheres, self._what, timeout, self._nodes))

    async def wait_async(self, timeout: float | None = None) -> Any:
        """Suspend until done; raise the remote exception or ClusterTimeout."""
        return self._finish(
            await get_all_async(self._refs, self._wheres, self._what, timeout, self._nodes)
        )

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait_async().__await__()
