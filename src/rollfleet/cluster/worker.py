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
from rollfleet.errors import ClusterError

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

    # -- point to point ---------------------------------------------------------------------
    def send(
        self,
        obj: Any,
        dst_group: str,
        dst_rank: int,
        *,
        async_op: bool = False,
        timeout: float | None = DEFAULT_P2P_TIMEOUT,
    ) -> Work | None:
        """Send a Python object to rank ``dst_rank`` of ``dst_group`` (through the object store)."""
        from rollfleet.cluster import collective

        return collective.send_object(
            self.worker_address, obj, _peer(dst_group, dst_rank), async_op, timeout
        )

    def recv(
        self,
        src_group: str,
        src_rank: int,
        *,
        async_op: bool = False,
        timeout: float | None = DEFAULT_P2P_TIMEOUT,
    ) -> Any:
        """Receive the next object rank ``src_rank`` of ``src_group`` sent to this rank."""
        from rollfleet.cluster import collective

        return collective.recv_object(
            self.worker_address, _peer(src_group, src_rank), async_op, timeout
        )

    def send_tensor(
        self,
        tensor: torch.Tensor,
        dst_group: str,
        dst_rank: int,
        *,
        async_op: bool = False,
        timeout: float = DEFAULT_P2P_TIMEOUT,
    ) -> TensorWork | None:
        """Send ``tensor`` over torch.distributed (gloo on CPU, NCCL on GPU); the peer needs a
        buffer."""
        from rollfleet.cluster import collective

        return collective.send_tensor(
            self.worker_info, tensor, _peer(dst_group, dst_rank), async_op, timeout
        )

    def recv_tensor(
        self,
        tensor: torch.Tensor,
        src_group: str,
        src_rank: int,
        *,
        async_op: bool = False,
        timeout: float = DEFAULT_P2P_TIMEOUT,
    ) -> TensorWork | None:
        """Receive into the pre-allocated ``tensor`` from rank ``src_rank`` of ``src_group``."""
        from rollfleet.cluster import collective

        return collective.recv_tensor(
            self.worker_info, tensor, _peer(src_group, src_rank), async_op, timeout
        )

    # -- channels ---------------------------------------------------------------------------
    def create_channel(self, name: str, maxsize: int = 0) -> Channel:
        """Create a named channel (owned by this worker) that other workers can connect to."""
        from rollfleet.cluster.channel import create_channel

        return create_channel(name, maxsize)

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


def _peer(group: str, rank: int) -> WorkerAddress:
    """The address of ``rank`` in the group called ``group``."""
    return WorkerAddress.parse(group).get_child_address(rank)


__all__ = ["DEFAULT_P2P_TIMEOUT", "Worker", "actor_class", "group_methods"]
