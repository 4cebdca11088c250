"""Weights from a trainer to the gateway's engines: :func:`push_weights`, in process or over
HTTP (the format, and the same-host memfd: :mod:`rollfleet.engines.weights.wire`).

A push names every weight of the model, or is a *delta*: headers ``X-Rollfleet-Weights-Delta: 1``
and ``X-Rollfleet-Weights-Base: N`` (in process:
:class:`~rollfleet.engines.base.WeightsDelta`) say that it holds only some tensors, computed
against weights version ``N``; the others keep their values. The gateway refuses a delta (409)
unless every replica serves version ``N``. :func:`snapshot` and :func:`changed` find what to
send: the tensors whose bytes differ from the last push.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from rollfleet.engines.weights.lora import LoraAdapter
from rollfleet.engines.weights.memfd import memfd_path, new_push_memfd, write_push_parts
from rollfleet.engines.weights.wire import (
    BASE_HEADER,
    DELTA_HEADER,
    FILE_HEADER,
    JUMP_HEADER,
    LORA_HEADER,
    PUSH_BUCKET_BYTES,
    dtype_name,
    encode,
    raw_view,
)
from rollfleet.errors import InvalidInput


def snapshot(tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """A copy (in host memory) of named tensors, to find what the next push must send with
    :func:`changed`. Tied names (an LM head sharing the embedding) share one copy."""
    import numpy as np

    out: dict[str, Any] = {}
    copies: dict[Any, Any] = {}
    for name, tensor in tensors:
        key = _storage(tensor) or name
        if key not in copies:
            copies[key] = (
                tensor.detach().to("cpu", copy=True)
                if hasattr(tensor, "detach")
                else np.array(tensor, copy=True)
            )
        out[name] = copies[key]
    return out


def changed(
    previous: Mapping[str, Any], tensors: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """The named tensors whose dtype, shape or bytes differ from ``previous`` (a :func:`snapshot`
    of what the gateway serves), or that it lacks: what a delta push sends. Bytes are compared,
    not values, so a -0.0 or NaN that changed counts; a tensor on a GPU is copied to compare.
    After a push, ``previous.update(snapshot(sent))`` makes it the new base."""
    for name, tensor in tensors:
        old = previous.get(name)
        if old is None or not _same(old, tensor):
            yield name, tensor


def _same(a: Any, b: Any) -> bool:
    if dtype_name(a) != dtype_name(b) or tuple(a.shape) != tuple(b.shape):
        return False
    if not (hasattr(a, "detach") and hasattr(b, "detach")):
        return bool(raw_view(a) == raw_view(b))
    import torch  # torch.equal over integers of the element's width: 6x a memoryview compare

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(*(t.detach().to("cpu").contiguous().reshape(-1).view(ints) for t in (a, b)))


def _storage(tensor: Any) -> tuple[int, tuple[int, ...], str] | None:
    """What makes two names the same tensor (tied weights); None when it cannot be told."""
    if hasattr(tensor, "data_ptr") and tensor.numel():
        return tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype)
    return None


def weights_url(base_url: str, version: int) -> str:
    """The push URL of a gateway (base URL with or without ``/v1``)."""
    base = base_url.rstrip("/").removesuffix("/v1")
    return f"{base}/v1/rollfleet/weights/{version}"


async def push_weights(
    target: Any,
    tensors: Iterable[tuple[str, Any]],
    version: int,
    *,
    token: str | None = None,
    bucket_bytes: int = PUSH_BUCKET_BYTES,
    progress: bool = False,
    transport: str = "auto",
    delta: bool = False,
    base: int | None = None,
    jump: bool = False,
    lora_alpha: float | None = None,
) -> dict[str, Any]:
    """Send named tensors as weights ``version`` to a gateway: a :class:`Gateway` in this
    process, or its URL. To a URL on this host (``transport="auto"`` on Linux, or ``"file"``)
    the push is written to sealed memfds (one a core for a large push) and only their
    ``/proc/<pid>/fd/<fd>`` paths are sent; elsewhere (or ``"http"``) it streams in the request
    body. The gateway must see this process's pid: a gateway in another container (another pid
    namespace) behind a loopback port cannot open the paths and refuses them (InvalidInput), so
    push to it with ``"http"``.
    Returns the gateway's answer: the version, each replica's time to install and, over HTTP,
    the gateway's time to read and check the push (``receive_s``) and, through a memfd, this
    process's time to write it (``write_s``). Raises what the gateway refused with (Conflict
    for a version that is not newer, InvalidInput for a bad tensor or bucket).

    A full push names every weight. ``delta=True`` sends only some (:func:`changed` finds them),
    computed against weights version ``base`` (required): the rest keep their values, and the
    gateway refuses with Conflict unless every replica serves ``base``. A gateway over HTTP
    refuses a version more than 1000 past the one it serves unless ``jump``. ``lora_alpha``
    makes the tensors a LoRA adapter (:mod:`~rollfleet.engines.weights.lora`), for gateways whose
    replicas all apply adapters."""
    from rollfleet.engines.gateway.gateway import Gateway

    if delta != (base is not None):
        raise InvalidInput(
            "weights: a delta push needs base=, the version it was computed"
            " against, and only a delta takes one"
        )
    named = untied(tensors)
    if isinstance(target, Gateway):
        sent = named if lora_alpha is None else LoraAdapter(named, lora_alpha)
        return await target.update_weights(sent, version, base=base)
    headers = {} if base is None else {DELTA_HEADER: "1", BASE_HEADER: str(base)}
    if lora_alpha is not None:
        headers[LORA_HEADER] = repr(float(lora_alpha))
    if jump:
        headers[JUMP_HEADER] = "1"
    host = urlsplit(str(target)).hostname
    local = host in ("127.0.0.1", "localhost", "::1") and hasattr(os, "memfd_create")
    if transport == "file" or (transport == "auto" and local):
        return await _push_memfd(str(target), named, version, token, bucket_bytes, headers)
    return await _push_http(str(target), named, version, token, bucket_bytes, progress, headers)


def untied(tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Named tensors without the second name of a tied one (an LM head sharing the embedding's
    storage): the receiver's model ties them too, so one copy installs both."""
    out, seen = [], set()
    for name, tensor in tensors:
        key = _storage(tensor)
        if key is not None and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


SPARE_MAX = 4 << 30  # bytes: a larger push's memfds are made during the push, not kept between
log = logging.getLogger("rollfleet.engines")


class _Spares:
    """The allocated memfds this process keeps for its next push on this host, one a part
    (:func:`~rollfleet.engines.weights.memfd.new_push_memfd`), made after each push, off its
    path, the sizes of that push's parts: the next one only copies into them. A forked child
    never fills its parent's. Freed by the kernel with the process, however it ends. They cost
    the process that memory between pushes: none is kept for a push over :data:`SPARE_MAX`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: list[int] = []
        self.pid = os.getpid()

    def take(self) -> list[int]:
        """The spares' descriptors, now the caller's (none when there are none)."""
        with self.lock:
            fds, self.fds = self.fds, []
            if self.pid != os.getpid():  # a forked child's copies: let them go
                for fd in fds:
                    os.close(fd)
                return []
            return fds

    def refill(self, used: list[int], sizes: list[int]) -> None:
        """Close a push's memfds, then make the next spares of ``sizes`` bytes unless some
        wait or they would be over :data:`SPARE_MAX` (none when memory is short: the next push
        makes its memfds itself, and says so if it cannot)."""
        for fd in used:
            os.close(fd)
        if sum(sizes) > SPARE_MAX:
            return
        with self.lock:
            if self.fds and self.pid == os.getpid():
                return
            made: list[int] = []
            try:
                made.extend(new_push_memfd(size) for size in sizes)
            except OSError as exc:
                log.debug("weights: no spare push memfds of %s bytes: %s", sizes, exc)
                for fd in made:
                    os.close(fd)
                return
            self.fds, self.pid = made, os.getpid()


_SPARES = _Spares()


async def _push_memfd(
    url: str,
    named: list[tuple[str, Any]],
    version: int,
    token: str | None,
    bucket_bytes: int,
    headers: dict[str, str],
) -> dict[str, Any]:
    """Same host: write the push to sealed memfds, in parts side by side (the spares, when
    there are some), and send only the paths the gateway opens them by. Once the gateway
    answered, a thread closes the memfds (their memory goes with the last reference, even if
    this process is killed) and makes the next spares, while the caller goes on."""
    import asyncio
    import time

    started = time.monotonic()
    fds = await asyncio.to_thread(write_push_parts, named, bucket_bytes, _SPARES.take())
    written = time.monotonic() - started
    try:
        paths = ",".join(memfd_path(fd) for fd in fds)
        answer = await _put(url, version, token, None, {**headers, FILE_HEADER: paths})
        return {**answer, "write_s": round(written, 6)}
    finally:
        sizes = [os.fstat(fd).st_size for fd in fds]
        threading.Thread(
            target=_SPARES.refill, args=(fds, sizes), name="rollfleet-push-spare", daemon=True
        ).start()


async def _push_http(
    url: str,
    named: list[tuple[str, Any]],
    version: int,
    token: str | None,
    bucket_bytes: int,
    progress: bool,
    headers: dict[str, str],
) -> dict[str, Any]:
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    from rollfleet.engines.weights.buckets import tensor_nbytes

    size = sum(tensor_nbytes(t) for _, t in named)
    bar = Progress(
        *Progress.get_default_columns(),
        DownloadColumn(),
        TransferSpeedColumn(),
        disable=not progress,
        transient=True,
    )
    task = bar.add_task(f"weights v{version}", total=size)

    async def body() -> AsyncIterator[bytes]:
        for part in encode(named, bucket_bytes):
            yield part if isinstance(part, bytes) else part.tobytes()  # httpx sends bytes only
            bar.advance(task, part.nbytes if isinstance(part, memoryview) else 0)

    with bar:
        headers = {**headers, "content-type": "application/octet-stream"}
        return await _put(url, version, token, body(), headers)


async def _put(
    url: str, version: int, token: str | None, content: Any, headers: dict[str, str]
) -> dict[str, Any]:
    import httpx

    from rollfleet.web.errors import error_named

    if token:
        headers["authorization"] = f"Bearer {token}"
    timeout = httpx.Timeout(connect=30.0, read=None, write=None, pool=None)
    async with httpx.AsyncClient(timeout=timeout, verify=_tls()) as client:
        reply = await client.put(weights_url(url, version), content=content, headers=headers)
    answer: dict[str, Any] = reply.json()
    if reply.status_code != 200:
        error = answer.get("error") or {}
        raise error_named(error.get("type"), str(error.get("message") or reply.text))
    return answer


@functools.cache
def _tls() -> ssl.SSLContext:
    """The certificate checks for an https gateway, made once: a client made per push would
    build its own each time (27 ms here, a tenth of a same-host push)."""
    import httpx

    return httpx.create_ssl_context()


__all__ = ["changed", "push_weights", "snapshot", "untied", "weights_url"]
