"""``Worker``: the base class of everything a WorkerGroup runs as Ray actors.

Subclass it, then ``MyWorker.create_group(*args).launch(cluster, placement, name)``. Inside a
rank, ``self.worker_info`` / ``self.worker_address`` say who it is, the torch.distributed
variables (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) are already in ``os.environ``
when the subclass's ``__init__`` runs, and ``send``/``recv``/``send_tensor``/``recv_tensor``/
channels talk to other workers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

from rollfleet.cluster.address import WorkerAddress, WorkerInfo
from rollfleet.cluster.rank import actor_class, current_worker, group_methods
from rollfleet.errors import ClusterError, InvalidInput

if TYPE_CHECKING:
    import torch

    from rollfleet.cluster.channel import Channel
    from rollfleet.cluster.collective import TensorWork
    from rollfleet.cluster.group import WorkerGroupSpec
    from rollfleet.cluster.waiting import Work

W = TypeVar("W", bound="Worker")

DEFAULT_P2P_TIMEOUT = 300.0


class Worker:
    """Base class of a group's ranks (one Ray actor per rank)."""

    _rf_base = True  # group_methods skips the methods of classes that set this themselves
    _rf_info: WorkerInfo | None = None
    _rf_init_error: Exception | None = None

    @classmethod
    def current(cls) -> Worker | None:
        """The worker running in this process, or None in a driver."""
        found = current_worker()
        return found if isinstance(found, Worker) else None

    @classmethod
    def create_group(cls: type[W], *args: Any, **kwargs: Any) -> WorkerGroupSpec[W]:
        """A group of this class built with ``(*args, **kwargs)``; call ``.launch(...)`` on it."""
        from rollfleet.cluster.group import WorkerGroupSpec

        return WorkerGroupSpec(cls, args, kwargs)

    @property
    def worker_info(self) -> WorkerInfo:
        """Who this rank is: address, rank, world size, node, GPUs."""
        if self._rf_info is None:
            raise ClusterError(f"{type(self).__name__} was not launched in a WorkerGroup")
        return self._rf_info

    @property
    def worker_address(self) -> WorkerAddress:
        """This rank's hierarchical address, e.g. ``Trainer:1``."""
        return self.worker_info.address

    @property
    def rank(self) -> int:
        """This rank's index in its group."""
        return self.worker_info.rank

    @property
    def world_size(self) -> int:
        """How many ranks this rank's group has."""
        return self.worker_info.world_size

    # -- point to point (RLinf's ``dst_group_name``/``src_group_name``; ``dst_group``/``src_group``
    # are the older spellings, still accepted) -----------------------------------------------
    def send(
        self,
        obj: Any,
        dst_group_name: str | None = None,
        dst_rank: int | None = None,
        *,
        async_op: bool = False,
        timeout: float | None = DEFAULT_P2P_TIMEOUT,
        dst_group: str | None = None,
    ) -> Work | None:
        """Send a Python object to rank ``dst_rank`` of ``dst_group_name`` (through the object
        store)."""
        from rollfleet.cluster import collective

        peer = _peer("send", dst_group_name, dst_group, dst_rank)
        return collective.send_object(self.worker_address, obj, peer, async_op, timeout)

    def recv(
        self,
        src_group_name: str | None = None,
        src_rank: int | None = None,
        *,
        async_op: bool = False,
        timeout: float | None = DEFAULT_P2P_TIMEOUT,
        src_group: str | None = None,
    ) -> Any:
        """Receive the next object rank ``src_rank`` of ``src_group_name`` sent to this rank."""
        from rollfleet.cluster import collective

        peer = _peer("recv", src_group_name, src_group, src_rank)
        return collective.recv_object(self.worker_address, peer, async_op, timeout)

    def send_tensor(
        self,
        tensor: torch.Tensor,
        dst_group_name: str | None = None,
        dst_rank: int | None = None,
        *,
        async_op: bool = False,
        timeout: float = DEFAULT_P2P_TIMEOUT,
        dst_group: str | None = None,
    ) -> TensorWork | None:
        """Send ``tensor`` over torch.distributed (gloo on CPU, NCCL on GPU); the peer needs a
        buffer."""
        from rollfleet.cluster import collective

        peer = _peer("send_tensor", dst_group_name, dst_group, dst_rank)
        return collective.send_tensor(self.worker_info, tensor, peer, async_op, timeout)

    def recv_tensor(
        self,
        tensor: torch.Tensor,
        src_group_name: str | None = None,
        src_rank: int | None = None,
        *,
        async_op: bool = False,
        timeout: float = DEFAULT_P2P_TIMEOUT,
        src_group: str | None = None,
    ) -> TensorWork | None:
        """Receive into the pre-allocated ``tensor`` from rank ``src_rank`` of
        ``src_group_name``."""
        from rollfleet.cluster import collective

        peer = _peer("recv_tensor", src_group_name, src_group, src_rank)
        return collective.recv_tensor(self.worker_info, tensor, peer, async_op, timeout)

    # -- channels ---------------------------------------------------------------------------
    def create_channel(
        self, name: str, node_id: int | str | None = None, maxsize: int = 0, **options: Any
    ) -> Channel:
        """Create a named channel (owned by this worker) that other workers can connect to;
        ``node_id`` (a node index or Ray id) pins its actor, as RLinf's spelling does."""
        from rollfleet.cluster.channel import create_channel

        return create_channel(name, node_id, maxsize, **options)

    def connect_channel(self, name: str, timeout: float = 0.0) -> Channel:
        """Connect to an existing channel by name (waiting up to ``timeout`` for it to appear)."""
        from rollfleet.cluster.channel import connect_channel

        return connect_channel(name, timeout)

    # -- runtime hooks (not group methods) ----------------------------------------------------
    def _rf_ping(self) -> tuple[str, int]:
        """Liveness probe used by the group: this rank's address and process id.

        Raises the exception the subclass's ``__init__`` raised, so a launch reports it as is.
        """
        if self._rf_init_error is not None:
            raise self._rf_init_error
        return self.worker_address.get_name(), os.getpid()

    def _rf_info_now(self) -> WorkerInfo:
        """This rank's WorkerInfo as it runs (with the GPUs Ray reserved for it)."""
        return self.worker_info


def _peer(op: str, group: str | None, alias: str | None, rank: int | None) -> WorkerAddress:
    """The address of ``rank`` in the group named by ``group`` or its older spelling ``alias``."""
    if (group is None) == (alias is None) or rank is None:
        raise InvalidInput(
            f"{op} needs a group (the *_group_name argument, or the older *_group) and a rank; "
            f"got group={group!r}, older spelling={alias!r}, rank={rank!r}"
        )
    return WorkerAddress.parse(group or alias or "").get_child_address(rank)


__all__ = ["DEFAULT_P2P_TIMEOUT", "Worker", "actor_class", "group_methods"]
