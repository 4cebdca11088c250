"""``WorkerGroup``: one Ray actor per rank, every public method callable on all ranks at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray

from rollfleet.cluster.address import WorkerAddress, WorkerInfo
from rollfleet.cluster.cluster import NAMESPACE, Cluster, alive_nodes, free_gpus, pinned_options
from rollfleet.cluster.placement import (
    CpuPlacement,
    NodeResources,
    PlacementStrategy,
    RankPlacement,
    gpu_shortfall,
)
from rollfleet.cluster.rank import actor_class, current_worker, group_methods
from rollfleet.cluster.waiting import DEATH_ERRORS, Work, get_all
from rollfleet.errors import ClusterError, ClusterTimeout, InvalidInput

if TYPE_CHECKING:
    from rollfleet.cluster.worker import Worker

log = logging.getLogger("rollfleet.cluster")

W = TypeVar("W", bound="Worker")


class _NameTaken(ClusterError):
    """A rank's actor name is still held by a live (or not yet forgotten) actor."""


@dataclass(frozen=True)
class _RankSlot:
    """Everything needed to (re)start one rank."""

    info: WorkerInfo
    node_id: str
    num_cpus: float
    num_gpus: int = 0

    @property
    def where(self) -> str:
        """The rank's node, as errors name it."""
        return f"{self.info.node_ip} ({self.node_id[:12]})"


@dataclass
class WorkerGroupSpec(Generic[W]):
    """What ``Worker.create_group(...)`` returns: a class and its constructor arguments."""

    worker_cls: type[W]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def launch(
        self,
        cluster: Cluster,
        placement: PlacementStrategy | None = None,
        name: str | None = None,
        *,
        max_concurrency: int | None = None,
        max_restarts: int = 0,
        timeout: float = 120.0,
    ) -> WorkerGroup[W]:
        """Start one actor per placed rank and wait (up to ``timeout``) until all are
        constructed."""
        nodes = cluster.nodes()[: cluster.num_nodes]
        plan = (placement or CpuPlacement(1)).plan(nodes)
        address = _group_address(self.worker_cls, name)
        master = nodes[plan[0].node_index]
        port = cluster.free_port(master)
        short = gpu_shortfall(plan, nodes, free_gpus())
        if short:
            raise ClusterError(f"group {address}: not enough GPUs for its ranks: {short}")
        slots = [_slot(address, p, len(plan), nodes, master.node_ip, port) for p in plan]
        options = {"max_restarts": max_restarts}
        if max_concurrency is not None:
            options["max_concurrency"] = max_concurrency
        group: WorkerGroup[W] = WorkerGroup(self, address, slots, options)
        group._start(range(len(slots)), timeout)
        log.info(
            "group %s launched: %d rank(s) of %s", address, len(slots), self.worker_cls.__name__
        )
        return group


def _named(name: str) -> bool:
    """Whether a live actor holds ``name`` in rollfleet's namespace."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _group_address(worker_cls: type[Worker], name: str | None) -> WorkerAddress:
    """The explicit name, or the launching worker's address for a child group, or the class name."""
    if name is not None:
        return WorkerAddress.parse(name)
    parent = current_worker()
    return parent.worker_address if parent is not None else WorkerAddress(worker_cls.__name__)


def _slot(
    group: WorkerAddress,
    p: RankPlacement,
    world: int,
    nodes: Sequence[NodeResources],
    ip: str,
    port: int,
) -> _RankSlot:
    """The info and resources of rank ``p.rank``."""
    node = nodes[p.node_index]
    info = WorkerInfo(
        address=group.get_child_address(p.rank),
        rank=p.rank,
        world_size=world,
        node_id=node.node_id,
        node_ip=node.node_ip,
        local_rank=p.local_rank,
        local_world_size=p.local_world_size,
        gpu_id=p.gpus[0] if p.gpus else None,
        available_gpus=p.gpus,
        master_addr=ip,
        master_port=port,
    )
    return _RankSlot(info, node.node_id, p.num_cpus, len(p.gpus))


class WorkerGroup(Generic[W]):
    """The launched ranks of one group; ``group.method(...)`` runs on every selected rank."""

    def __init__(
        self,
        spec: WorkerGroupSpec[W],
        address: WorkerAddress,
        slots: list[_RankSlot],
        options: dict[str, Any],
        handles: list[Any] | None = None,
        selected: tuple[int, ...] | None = None,
    ) -> None:
        self._spec = spec
        self._address = address
        self._slots = slots
        self._options = options
        self._handles: list[Any] = handles if handles is not None else [None] * len(slots)
        self._selected = selected if selected is not None else tuple(range(len(slots)))
        self._methods = group_methods(spec.worker_cls)
        self._label = address.get_name()

    # -- lifecycle ------------------------------------------------------------------------------
    def _start(self, ranks: Iterable[int], timeout: float) -> None:
        """Create the actors of ``ranks`` and wait for their constructors (none is left on
        failure)."""
        remote_cls = actor_class(self._spec.worker_cls)  # type: ignore[arg-type]
        created: list[int] = []
        current = -1
        try:
            for current in ranks:
                slot = self._slots[current]
                self._handles[current] = remote_cls.options(
                    **pinned_options(
                        slot.info.address.get_name(),
                        slot.node_id,
                        num_cpus=slot.num_cpus,
                        num_gpus=slot.num_gpus,
                        **self._options,
                    )
                ).remote(slot.info, *self._spec.args, **self._spec.kwargs)
                created.append(current)
            self._ping(created, timeout, "start")
            self._learn_gpus(created)
        except BaseException as exc:
            for rank in created:
                ray.kill(self._handles[rank], no_restart=True)
            if isinstance(exc, ValueError):  # Ray: the actor name is taken
                raise _NameTaken(
                    f"a worker named {self._name(current)} is already running; "
                    "launch with another name="
                ) from exc
            raise

    def _ping(self, ranks: Sequence[int], timeout: float | None, what: str) -> None:
        refs = [self._handles[r]._rf_ping.remote() for r in ranks]
        nodes = [self._slots[r].where for r in ranks]
        get_all(refs, [self._name(r) for r in ranks], f"{self._address}.{what}", timeout, nodes)

    def _learn_gpus(self, ranks: Sequence[int]) -> None:
        """Record which GPUs Ray gave each GPU rank (Ray picks them, the plan only counts)."""
        gpu_ranks = [r for r in ranks if self._slots[r].num_gpus]
        refs = [self._handles[r]._rf_info_now.remote() for r in gpu_ranks]
        for rank, info in zip(gpu_ranks, ray.get(refs, timeout=60), strict=True):
            self._slots[rank] = replace(self._slots[rank], info=info)

    def _replace_dead_node(self, rank: int) -> None:
        """Move ``rank`` to another alive node when its own node has died."""
        slot = self._slots[rank]
        nodes = alive_nodes()
        if any(n.node_id == slot.node_id for n in nodes):
            return
        free = free_gpus()
        fits = [n for n in nodes if free.get(n.node_id, n.num_gpus) >= slot.num_gpus]
        if not fits:
            raise ClusterError(
                f"restart of {self._name(rank)}: its node {slot.where} is dead and no alive node "
                f"has {slot.num_gpus} free GPU(s)"
            )
        load = {n.node_id: 0 for n in fits}
        for other in self._slots:
            if other.node_id in load:
                load[other.node_id] += 1
        node = min(fits, key=lambda n: load[n.node_id])
        info = replace(slot.info, node_id=node.node_id, node_ip=node.node_ip)
        log.warning(
            "group %s: rank %d's node %s is dead; restarting it on %s",
            self._address,
            rank,
            slot.where,
            node.node_ip,
        )
        self._slots[rank] = replace(slot, info=info, node_id=node.node_id)

    def restart(self, rank: int, timeout: float = 120.0) -> None:
        """Replace rank ``rank`` (dead or alive) with a fresh actor built with the same
        arguments."""
        self._check_ranks([rank])
        ray.kill(self._handles[rank], no_restart=True)
        self._replace_dead_node(rank)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._start([rank], max(deadline - time.monotonic(), 1.0))
                break
            except _NameTaken as exc:  # the dead actor's name is not released yet
                if time.monotonic() > deadline:
                    raise ClusterTimeout(
                        f"restart of {self._name(rank)}: name still taken after {timeout}s"
                    ) from exc
                time.sleep(0.2)
        log.info("group %s: rank %d restarted", self._address, rank)

    def alive(self, timeout: float = 10.0) -> list[bool]:
        """Whether each selected rank answers a ping within ``timeout``."""
        refs = [self._handles[r]._rf_ping.remote() for r in self._selected]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        out = []
        for ref in refs:
            try:
                out.append(ref in ready and bool(ray.get(ref)))
            except DEATH_ERRORS:
                out.append(False)
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        """Kill every rank of the group and its mailbox; return once their names are free again."""
        from rollfleet.cluster.collective import mailbox_name

        names = [slot.info.address.get_name() for slot in self._slots] + [
            f"channel:{mailbox_name(self.name)}"
        ]
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass  # never started, already gone, or (mailbox) never used
        deadline = time.monotonic() + timeout
        while any(_named(name) for name in names):
            if time.monotonic() > deadline:
                raise ClusterTimeout(
                    f"group {self.name}: actors still registered {timeout}s after kill"
                )
            time.sleep(0.05)
        log.info("group %s shut down", self._address)

    # -- selection and calls ------------------------------------------------------------------
    def execute_on(self, *ranks: int | Iterable[int]) -> WorkerGroup[W]:
        """A view of this group whose method calls run only on ``ranks``."""
        flat = [r for item in ranks for r in ([item] if isinstance(item, int) else item)]
        self._check_ranks(flat)
        return WorkerGroup(
            self._spec, self._address, self._slots, self._options, self._handles, tuple(flat)
        )

    def _check_ranks(self, ranks: Sequence[int]) -> None:
        bad = [r for r in ranks if not 0 <= r < len(self._slots)]
        if bad or not ranks:
            raise InvalidInput(
                f"group {self._address} has ranks 0..{len(self._slots) - 1}; got {list(ranks)}"
            )

    def call(self, method: str, *args: Any, scatter: bool = False, **kwargs: Any) -> Work:
        """Run ``method`` on every selected rank; ``scatter=True`` gives list arguments out per
        rank."""
        handles = self._handles
        if scatter:
            per_rank = _scatter(args, kwargs, len(self._selected), method)
            refs = [
                getattr(handles[r], method).remote(*a, **kw)
                for r, (a, kw) in zip(self._selected, per_rank, strict=True)
            ]
        else:
            refs = [getattr(handles[r], method).remote(*args, **kwargs) for r in self._selected]
        wheres = [self._name(r) for r in self._selected]
        nodes = [self._slots[r].where for r in self._selected]
        return Work(refs, wheres, f"{self._label}.{method}", nodes=nodes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._methods:
            raise AttributeError(f"{self._spec.worker_cls.__name__} has no public method {name!r}")
        bound = _GroupMethod(self, name)
        self.__dict__[name] = bound  # later lookups skip __getattr__
        return bound

    def _name(self, rank: int) -> str:
        return self._slots[rank].info.address.get_name()

    @property
    def name(self) -> str:
        """The group's name (its address)."""
        return self._address.get_name()

    @property
    def world_size(self) -> int:
        """How many ranks the whole group has."""
        return len(self._slots)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this view calls."""
        return self._selected

    @property
    def worker_infos(self) -> list[WorkerInfo]:
        """The WorkerInfo of every selected rank."""
        return [self._slots[r].info for r in self._selected]

    @property
    def handles(self) -> list[Any]:
        """The Ray actor handles of the selected ranks."""
        return [self._handles[r] for r in self._selected]


class _GroupMethod:
    """``group.method``: call it like the method; get a Work whose result is one value per rank."""

    __slots__ = ("_group", "_name")

    def __init__(self, group: WorkerGroup[Any], name: str) -> None:
        self._group = group
        self._name = name

    def __call__(self, *args: Any, scatter: bool = False, **kwargs: Any) -> Work:
        return self._group.call(self._name, *args, scatter=scatter, **kwargs)


def _scatter(
    args: tuple[Any, ...], kwargs: dict[str, Any], n: int, method: str
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Split every list argument into one entry per rank; other arguments go to every rank."""

    def check(label: str, value: Any) -> None:
        if isinstance(value, list) and len(value) != n:
            raise InvalidInput(
                f"{method}(scatter=True): argument {label} has {len(value)} entries for {n} ranks"
            )

    for i, value in enumerate(args):
        check(f"#{i}", value)
    for key, value in kwargs.items():
        check(repr(key), value)
    return [
        (
            tuple(v[i] if isinstance(v, list) else v for v in args),
            {k: (v[i] if isinstance(v, list) else v) for k, v in kwargs.items()},
        )
        for i in range(n)
    ]
