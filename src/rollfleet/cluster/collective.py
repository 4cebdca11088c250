"""Point-to-point transfers between workers.

Objects go through the receiving group's mailbox channel (the data through the object store).
Tensors go through a two-rank torch.distributed process group made lazily for each pair of
workers (gloo for CPU tensors, NCCL for CUDA ones); its rendezvous address is exchanged through
the mailboxes, and every step of it is bounded by the caller's timeout.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rollfleet.cluster.address import WorkerAddress, WorkerInfo
from rollfleet.cluster.channel import Channel, create_channel
from rollfleet.cluster.cluster import free_local_port
from rollfleet.cluster.waiting import Work
from rollfleet.errors import ClusterError, ClusterTimeout, InvalidInput

if TYPE_CHECKING:
    import torch

_mailboxes: dict[str, Channel] = {}
_pairs: dict[tuple[str, str], _Pair] = {}
_lock = threading.Lock()
STALE_STORE_WAIT = 3.0  # how long to try a mailed store address before taking the next one


def mailbox_name(group: str) -> str:
    """The channel name of ``group``'s mailbox."""
    return f"mailbox:{group}"


def _mailbox(group: str) -> Channel:
    """The (lazily created, detached) mailbox of ``group``."""
    channel = _mailboxes.get(group)
    if channel is None:
        channel = _mailboxes[group] = create_channel(
            mailbox_name(group), exist_ok=True, detached=True
        )
    return channel


def _key(src: WorkerAddress, dst: WorkerAddress, tag: str) -> str:
    return f"{tag}{src.get_name()}->{dst.get_name()}"


def _on_mailbox(group: str, use: Callable[[Channel], Any]) -> Any:
    """``use(mailbox)``, retried once on a fresh handle when the cached mailbox is gone."""
    try:
        return use(_mailbox(group))
    except ClusterTimeout:
        raise
    except ClusterError:  # the group was shut down and launched again: its mailbox is new
        _mailboxes.pop(group, None)
        return use(_mailbox(group))


def send_object(
    me: WorkerAddress,
    obj: Any,
    dst: WorkerAddress,
    async_op: bool,
    timeout: float | None,
    tag: str = "",
) -> Work | None:
    """Deliver ``obj`` to ``dst``'s mailbox (returns once it is there, or a Work)."""
    key = _key(me, dst, tag)
    try:
        work: Work | None = _on_mailbox(
            dst.group_name, lambda box: box.put(obj, key=key, timeout=timeout, async_op=async_op)
        )
        return work
    except ClusterTimeout as exc:
        raise ClusterTimeout(f"send from {me} to {dst}: not delivered within {timeout}s") from exc


def recv_object(
    me: WorkerAddress, src: WorkerAddress, async_op: bool, timeout: float | None, tag: str = ""
) -> Any:
    """The next object ``src`` sent to ``me`` (or a Work giving it)."""
    key = _key(src, me, tag)
    try:
        return _on_mailbox(
            me.group_name, lambda box: box.get(key=key, timeout=timeout, async_op=async_op)
        )
    except ClusterTimeout as exc:
        raise ClusterTimeout(f"recv on {me}: nothing from {src} within {timeout}s") from exc


@dataclass
class _Pair:
    """A two-rank process group between this worker and one peer."""

    group: Any
    rank: int
    store: Any


class TensorWork:
    """A pending tensor send/recv: ``.wait(timeout)``, ``await``, ``.done()``."""

    def __init__(self, work: Any, what: str, timeout: float, drop: tuple[str, str]) -> None:
        self._work = work
        self._what = what
        self._timeout = timeout
        self._drop = drop

    def done(self) -> bool:
        """True once the transfer has finished."""
        return bool(self._work.is_completed())

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finished; ClusterTimeout naming both ends after ``timeout``."""
        seconds = self._timeout if timeout is None else timeout
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError as exc:
            _pairs.pop(self._drop, None)
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise ClusterTimeout(f"{self._what}: not finished within {seconds}s") from exc
            raise ClusterError(f"{self._what} failed: {exc}") from exc

    async def wait_async(self, timeout: float | None = None) -> None:
        """Suspend (in a thread) until the transfer finished."""
        await asyncio.to_thread(self.wait, timeout)

    def __await__(self) -> Any:
        return self.wait_async().__await__()


def _backend(tensor: torch.Tensor) -> str:
    return "nccl" if tensor.is_cuda else "gloo"


def _pair(info: WorkerInfo, peer: WorkerAddress, backend: str, timeout: float) -> _Pair:
    """The process group shared with ``peer`` for ``backend``, made on first use."""
    key = (peer.get_name(), backend)
    with _lock:
        pair = _pairs.get(key)
        if pair is None:
            pair = _pairs[key] = _rendezvous(info, peer, backend, timeout)
        return pair


def _rendezvous(info: WorkerInfo, peer: WorkerAddress, backend: str, timeout: float) -> _Pair:
    """Meet ``peer``: the lower address hosts the store and mails its host:port to the other."""
    dist: Any = importlib.import_module("torch.distributed")
    me = info.address
    if me == peer:
        raise InvalidInput(f"{me}: cannot send a tensor to itself")
    rank = 0 if me.get_name() < peer.get_name() else 1
    tag = f"rdzv:{backend}|"
    wait = timedelta(seconds=timeout)
    try:
        if rank == 0:
            port = free_local_port()
            store = dist.TCPStore(info.node_ip, port, 2, True, wait, wait_for_workers=False)
            send_object(me, (info.node_ip, port), peer, False, timeout, tag)
        else:
            store = _join_store(dist, me, peer, tag, time.monotonic() + timeout)
        names = sorted((me.get_name(), peer.get_name()))
        prefixed = dist.PrefixStore(f"{names[0]}|{names[1]}|{backend}", store)
        return _Pair(_make_group(prefixed, rank, backend, wait, info.node_ip), rank, store)
    except (RuntimeError, dist.DistError) as exc:
        raise ClusterTimeout(
            f"tensor rendezvous between {me} and {peer} ({backend}) failed: {exc}"
        ) from exc


def _join_store(
    dist: Any, me: WorkerAddress, peer: WorkerAddress, tag: str, deadline: float
) -> Any:
    """Connect to the store ``peer`` mailed; skip addresses left by earlier, abandoned attempts."""
    while True:
        remaining = max(deadline - time.monotonic(), 0.01)
        host, port = recv_object(me, peer, False, remaining, tag)
        try:
            return dist.TCPStore(
                host, port, 2, False, timedelta(seconds=min(remaining, STALE_STORE_WAIT))
            )
        except (RuntimeError, dist.DistError):
            if time.monotonic() >= deadline:
                raise


def _make_group(store: Any, rank: int, backend: str, timeout: timedelta, host: str) -> Any:
    dist: Any = importlib.import_module("torch.distributed")
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def send_tensor(
    info: WorkerInfo, tensor: torch.Tensor, dst: WorkerAddress, async_op: bool, timeout: float
) -> TensorWork | None:
    """Send ``tensor`` to ``dst``, which must ``recv_tensor`` into a buffer of the same shape."""
    return _transfer("send", info, tensor, dst, async_op, timeout)


def recv_tensor(
    info: WorkerInfo, tensor: torch.Tensor, src: WorkerAddress, async_op: bool, timeout: float
) -> TensorWork | None:
    """Receive into ``tensor`` from ``src``."""
    return _transfer("recv", info, tensor, src, async_op, timeout)


def _transfer(
    op: str,
    info: WorkerInfo,
    tensor: torch.Tensor,
    peer: WorkerAddress,
    async_op: bool,
    timeout: float,
) -> TensorWork | None:
    """Start ``op`` ("send"/"recv") with ``peer`` on the pair's process group; wait unless
    ``async_op``."""
    backend = _backend(tensor)
    pair = _pair(info, peer, backend, timeout)
    arrow = "->" if op == "send" else "<-"
    started = getattr(pair.group, op)([tensor], 1 - pair.rank, 0)
    work = TensorWork(
        started, f"{op}_tensor {info.address} {arrow} {peer}", timeout, (peer.get_name(), backend)
    )
    if async_op:
        return work
    work.wait()
    return None
