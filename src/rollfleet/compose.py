"""The whole control plane of ``rollfleet serve``: the store API plus batches, pools and engines.

This is composition, so it lives at the top, beside the CLI: the service layer (``server/``) knows
only :class:`~rollfleet.server.parts.ServerParts`, and every part wired here (the batch coordinator,
hosted pools, the engines behind an OpenAI-compatible gateway) sits above it. Each part is optional;
the dashboard's side panels show whatever is mounted, and "none configured" otherwise. With a
gateway mounted, the coordinator's abort hook is the gateway's: cancelling a running rollout (a
batch abort, the ``cancel`` policy) also ends its LLM calls in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rollfleet.errors import Conflict, NotFound
from rollfleet.server.parts import PartsFactory, ServerParts
from rollfleet.store.base import Store
from rollfleet.store.sql_store import SqlStore

if TYPE_CHECKING:
    from rollfleet.coordinator.coordinator import RolloutCoordinator
    from rollfleet.coordinator.election import Election
    from rollfleet.coordinator.stragglers import AbortHook
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.images import BlobScope, BlobSource
    from rollfleet.store.blobs import Blob


@dataclass(frozen=True)
class EngineOptions:
    """Which engines ``rollfleet serve`` starts behind its OpenAI-compatible gateway (``/v1``)."""

    kind: str
    replicas: int = 1
    model: str | None = None
    url: str | None = None
    token: str | None = None
    mmproj: str | None = None  # llama.cpp: a projector file makes the engine take images


def mount_gateway(
    store: Store, options: EngineOptions, parts: ServerParts, extras: dict[str, Any]
) -> Gateway:
    """Mount the gateway now, start its engines as the app starts; each LLM call becomes a Step."""
    from rollfleet.engines.factory import make_engine
    from rollfleet.engines.gateway.app import gateway_router
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.model import StepIn

    async def record(rollout_id: str, attempt_id: str, step: StepIn) -> None:
        await store.add_steps(attempt_id, [step])

    gateway = Gateway(record)

    async def start_engines() -> None:
        for index in range(options.replicas):
            engine = make_engine(
                options.kind,
                model=options.model,
                url=options.url,
                index=index,
                mmproj=options.mmproj,
            )
            await engine.start()
            gateway.add_replica(engine)

    parts.checked.append(("", gateway_router(gateway, options.token, blobs=blob_scope(store))))
    parts.on_startup.append(start_engines)
    parts.on_shutdown.append(gateway.close)
    extras["engines"] = gateway.replicas
    return gateway


def blob_scope(store: Store) -> BlobScope:
    """The stored images a gateway caller may show: any of them for the operator's token, for an
    attempt's capability only those its rollout references (its input or its steps)."""

    def scope(rollout_id: str | None) -> BlobSource:
        if rollout_id is None:
            return store.get_blob
        referenced: set[str] | None = None

        async def get(sha256: str) -> Blob:
            nonlocal referenced
            if referenced is None:  # looked up once per call, when it references an image
                referenced = await rollout_images(store, rollout_id)
            if sha256 not in referenced:  # the same answer as an image nobody stored
                raise NotFound(f"no image {sha256[:64]!r}")
            return await store.get_blob(sha256)

        return get

    return scope


async def rollout_images(store: Store, rollout_id: str) -> set[str]:
    """The sha256 of every image a rollout's input or steps reference."""
    from rollfleet.store.blobs import image_refs

    found = set(image_refs((await store.get_rollout(rollout_id)).input))
    cursor: str | None = None
    while True:
        page = await store.query_steps(rollout_id, cursor=cursor)
        for step in page.items:
            found.update(image_refs(step.payload))
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


def abort_generations(gateway: Gateway) -> AbortHook:
    """The coordinator's abort hook: a cancelled rollout's calls in flight end now, each with its
    partial output (``finish_reason`` ``abort``)."""

    async def abort(rollout_id: str) -> None:
        await gateway.abort(rollout_id)

    return abort


def mount_pools(
    config: Path, parts: ServerParts, extras: dict[str, Any], store: Store | None = None
) -> None:
    """Host the pools of a config file under ``/pools``; over PostgreSQL their leases live in the
    store, so every replica of the control plane honours them."""
    from rollfleet.pool import load_registry, pool_router
    from rollfleet.pool.shared import SharedPoolRegistry, load_shared_registry

    registry = (
        load_shared_registry(config, store)
        if isinstance(store, SqlStore) and store.backend.dialect == "postgresql"
        else load_registry(config)
    )
    if isinstance(registry, SharedPoolRegistry):
        parts.on_startup.append(registry.start)  # its sweep expires leases of dead replicas too
    parts.routers.append(("/pools", pool_router(registry)))
    parts.on_shutdown.append(registry.close)
    extras["pools"] = lambda: [s.model_dump(mode="json") for s in registry.stats()]


def mount_batches(
    store: Store,
    parts: ServerParts,
    extras: dict[str, Any],
    abort_hook: AbortHook | None = None,
    experience_dir: Path | None = None,
    advertise: str | None = None,
) -> None:
    """Serve the batch coordinator at ``/batches``; persisted batches resume as the app starts.
    Over PostgreSQL one replica leads (``advertise``: the URL others forward batches to).

    ``abort_hook`` (the mounted gateway's, when there is one) stops the generations of the
    rollouts a batch abort or the ``cancel`` policy cancels."""
    from rollfleet.coordinator import RolloutCoordinator
    from rollfleet.coordinator.election import stored_batches
    from rollfleet.coordinator.service import coordinator_router

    coordinator = RolloutCoordinator(store, abort_hook=abort_hook, experience_dir=experience_dir)
    parts.routers.append(("/batches", coordinator_router(coordinator)))
    election = None
    if isinstance(store, SqlStore) and store.backend.dialect == "postgresql":
        election = elect_coordinator(coordinator, store, parts, advertise)
    else:
        parts.on_startup.append(coordinator.prepare)
    parts.on_shutdown.append(coordinator.shutdown)

    async def batches() -> list[dict[str, Any]]:
        if election is not None and not election.is_leader:  # read them, never act on them
            listed = await stored_batches(store)
        else:
            listed = await coordinator.list_batches(refresh=False)
        return [b.model_dump(mode="json", exclude={"rollout_statuses"}) for b in listed]

    async def abort_batch(batch_id: str, reason: str) -> Any:
        if election is not None and not election.is_leader:
            leader = await election.leader_url()
            raise Conflict(f"this replica does not run the batch coordinator; abort at {leader}")
        return (await coordinator.abort_batch(batch_id, reason=reason)).model_dump(mode="json")

    extras.setdefault("batches", batches)
    extras.setdefault("abort_batch", abort_batch)


def elect_coordinator(
    coordinator: RolloutCoordinator, store: SqlStore, parts: ServerParts, url: str | None
) -> Election:
    """Run the coordinator only while this replica holds the election's lock; forward otherwise."""
    from rollfleet.coordinator.election import Election
    from rollfleet.coordinator.forwarding import LeaderForwarding

    async def elected() -> None:
        coordinator.forget()
        await coordinator.prepare()

    async def deposed() -> None:
        coordinator.forget()

    dsn = str(cast(Any, store.backend).url)  # a PostgresBackend's
    election = Election(dsn, store, url, on_elected=elected, on_deposed=deposed)
    parts.on_startup.append(election.start)
    parts.on_shutdown.append(election.close)
    parts.middleware.append((LeaderForwarding, {"election": election}))
    return election


def control_plane(
    store: Store,
    *,
    pools: Path | None = None,
    engine: EngineOptions | None = None,
    extras: dict[str, Any] | None = None,
    experience_dir: Path | None = None,
    advertise: str | None = None,
) -> ServerParts:
    """Every part of ``rollfleet serve``: engines and pools when given, batches (their
    experiences written to ``experience_dir``; ``advertise``: this replica's URL), the
    dashboard."""
    from rollfleet.server.dashboard import dashboard_router

    parts = ServerParts()
    extras = dict(extras or {})
    abort_hook = None
    if engine is not None:
        abort_hook = abort_generations(mount_gateway(store, engine, parts, extras))
    if pools is not None:
        mount_pools(pools, parts, extras, store)
    mount_batches(store, parts, extras, abort_hook, experience_dir, advertise)
    parts.routers.append(("", dashboard_router(store, extras)))
    return parts


def control_plane_parts(
    *,
    pools: Path | None = None,
    engine: EngineOptions | None = None,
    experience_dir: Path | None = None,
) -> PartsFactory:
    """:func:`control_plane` as a factory for an embedded server (``ServerThread(parts=…)``)."""
    return lambda store: control_plane(
        store, pools=pools, engine=engine, experience_dir=experience_dir
    )
