"""A weights push on the same host: the push's bytes (the :mod:`~rollfleet.engines.weights.wire`
format) in a sealed memfd the trainer writes, and the gateway's mapping of it; only the memfd's
``/proc/<pid>/fd/<fd>`` path travels in the request. The seal keeps the trainer from changing
what the gateway checked and an engine serves; the path is untrusted, so what it names is
checked before it is mapped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import mmap
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import xxhash

from rollfleet.engines.weights.wire import (
    MAGIC,
    MAX_HEADER,
    MAX_TOTAL,
    EncodedBucket,
    encoded_buckets,
)
from rollfleet.errors import InvalidInput

CHUNK = 1 << 20  # a push memfd is written and hashed a chunk at a time, while it is in cache
ALIGN = 64  # a push memfd's bucket payloads start on this boundary (a cache line)
MEMFD_PATH = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,10}")  # what FILE_HEADER may name


def push_dir() -> str:
    """Shared memory where there is some (served engines' checkpoints go there); pushes on this
    host use a memfd instead (:func:`write_push_memfd`)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_push_memfd(size: int) -> int:
    """A new memfd (Linux) of ``size`` bytes whose pages are allocated and first written now,
    for :func:`write_push_memfd` to fill: a push into it then only copies. Allocating alone
    (``fallocate``) leaves the first write of each page to the push, and in a virtual machine
    that hands free memory back to its host, that first write is the host's fault too: a push
    of 538 MB into an allocated memfd took 0.06–1.2 s on this project's VM, into a written one
    0.065–0.083 s (:data:`POPULATE_WRITE`). Freed by the kernel with its last descriptor, so a
    process killed while holding one leaves nothing behind (it is in no directory)."""
    fd = os.memfd_create("rollfleet-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
            _first_write(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13 names it


def _first_write(fd: int, size: int) -> None:
    """Write-fault every page of the memfd at once, through a shared mapping closed again
    (a sealed push must have none left); a kernel without ``MADV_POPULATE_WRITE`` skips it."""
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mapped:
        with contextlib.suppress(OSError):
            mapped.madvise(POPULATE_WRITE)


def write_push_memfd(
    tensors: Iterable[tuple[str, Any]], bucket_bytes: int, spare: int | None = None
) -> int:
    """Write a push to ``spare`` (a :func:`new_push_memfd`, never sealed, any size: it is cut or
    grown to the push) or else a new memfd, seal it against any change, and return its
    descriptor, for :func:`memfd_path`. The caller closes it once the gateway answered: the
    memory goes with the last reference, so a trainer killed mid-push leaves nothing behind.
    Written with ``pwrite`` a chunk at a time, each chunk hashed just before, while in cache
    (copying through a writable mapping is faster, but mapping it costs more: its pages are
    write-faulted one by one, 0.19 s for 538 MB here)."""
    return _write_part(list(encoded_buckets(tensors, bucket_bytes)), spare)


def write_push_parts(
    tensors: Iterable[tuple[str, Any]],
    bucket_bytes: int,
    spares: Sequence[int] = (),
    parts: int | None = None,
) -> list[int]:
    """Write a push in ``parts`` memfds side by side, one thread each, and return their
    descriptors in order: each part is a whole push stream, sealed as :func:`write_push_memfd`
    seals one, holding a run of buckets about a ``parts``-th of the bytes. The kernel writes
    one memfd a page at a time under one lock, so two threads writing one memfd are no faster
    than one, and two writing one each are (538 MB: 41-54 ms against 77-95 ms here). ``parts``
    defaults to one a core, with at least :data:`MIN_PART` bytes each. ``spares`` fill the
    parts in order; the rest are closed. On an error every descriptor is closed."""
    buckets = list(encoded_buckets(tensors, bucket_bytes))
    groups = _runs(buckets, parts or _part_count(buckets))
    fds: list[int | None] = [*spares[: len(groups)], *[None] * (len(groups) - len(spares))]
    for extra in spares[len(groups) :]:
        os.close(extra)
    if len(groups) == 1:
        return [_write_part(groups[0], fds[0])]
    with concurrent.futures.ThreadPoolExecutor(len(groups), "rollfleet-push-part") as pool:
        pairs = zip(groups, fds, strict=True)
        futures = [pool.submit(_write_part, group, fd) for group, fd in pairs]
        concurrent.futures.wait(futures)
    errors = [error for future in futures if (error := future.exception()) is not None]
    if errors:
        for future in futures:
            if future.exception() is None:
                os.close(future.result())
        raise errors[0]
    return [future.result() for future in futures]


MIN_PART = 64 << 20  # bytes: a part smaller than this is not worth a thread of its own
MAX_PARTS = 64  # memfds one push may name


def _part_count(buckets: list[EncodedBucket]) -> int:
    """One part a core this process may run on, each of at least :data:`MIN_PART` bytes."""
    size = sum(bucket.nbytes for bucket in buckets)
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, MAX_PARTS, len(buckets), size // MIN_PART))


def _runs(buckets: list[EncodedBucket], parts: int) -> list[list[EncodedBucket]]:
    """The buckets in ``parts`` consecutive runs (fewer if there are fewer buckets; none empty)
    of about equal bytes: a run ends where the next bucket's middle passes its share."""
    share = sum(bucket.nbytes for bucket in buckets) / max(1, parts)
    runs: list[list[EncodedBucket]] = [[]]
    done = 0
    for i, bucket in enumerate(buckets):
        size = bucket.nbytes
        wanted = parts - len(runs)  # runs still to start
        late = len(buckets) - i <= wanted  # one bucket each for them from here on
        if runs[-1] and wanted > 0 and (late or done + size / 2 > share * len(runs)):
            runs.append([])
        runs[-1].append(bucket)
        done += size
    return runs


def _write_part(buckets: list[EncodedBucket], spare: int | None) -> int:
    """One sealed push stream of ``buckets`` in ``spare`` or a new memfd (closed on an error)."""
    fd = new_push_memfd(0) if spare is None else spare
    try:
        at = _pwrite(fd, MAGIC, 0)
        for bucket in buckets:
            at = _write_bucket(fd, bucket, at)
        at = _pwrite(fd, struct.pack("<I", 0), at)
        os.ftruncate(fd, at)  # a spare larger than this push: its tail goes
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_path(fd: int) -> str:
    """The path a gateway on this host opens this process's descriptor ``fd`` by (it must see
    this process's pid: the same pid namespace)."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def _write_bucket(fd: int, bucket: EncodedBucket, at: int) -> int:
    """Write one bucket at offset ``at``: room for its header (as long as the longest digest
    makes it, padded so that the payload starts on an :data:`ALIGN` boundary: an engine may
    serve tensors from the mapping as they lie), the payload, then the header, padded with
    spaces; return where it ends."""
    room = len(bucket.header(2**64 - 1))
    room += -(at + 4 + room) % ALIGN
    head_at, at = at, at + 4 + room
    digest = xxhash.xxh3_64()
    for view in bucket.views:
        for i in range(0, view.nbytes, CHUNK):
            piece = view[i : i + CHUNK]
            digest.update(piece)
            at = _pwrite(fd, piece, at)
    _pwrite(fd, struct.pack("<I", room) + bucket.header(digest.intdigest()).ljust(room), head_at)
    return at


def _pwrite(fd: int, data: bytes | memoryview, at: int) -> int:
    """Write all of ``data`` at offset ``at``; return the offset after it."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written
    return at


@contextlib.contextmanager
def mapped_push_memfd(path: str) -> Iterator[memoryview]:
    """A push a client on this host wrote to a memfd (:func:`write_push_memfd`), named by
    ``path`` (``/proc/<pid>/fd/<fd>``), mapped. Tensors are made over it without a copy, and an
    engine may serve them from it (:func:`decode` with ``sealed``): the mapping lives as long
    as a tensor over it. It is private: the memfd's own pages are read through it, and a write
    in this process (none is meant) would get a copy of its page instead of the fault a
    read-only mapping gives. Pages are mapped as they are first read (the checksum pass), not
    ahead. The path is untrusted: only a regular file of this process's user, sealed against
    shrinking and writing (so nobody can truncate it under the mapping, which would kill this
    process with SIGBUS, nor change the bytes once checked), is mapped; InvalidInput naming
    what is wrong otherwise."""
    if not MEMFD_PATH.fullmatch(path):
        raise InvalidInput(f"weights: {path[:200]!r} is not a push memfd (/proc/<pid>/fd/<fd>)")
    fd = _open_regular(path)
    try:
        _check_seals(fd, path)
        size = os.fstat(fd).st_size
        if not 0 < size <= MAX_TOTAL + MAX_HEADER:
            raise InvalidInput(f"weights: {path!r} has {size} bytes")
        prot = mmap.PROT_READ | mmap.PROT_WRITE  # private: a write copies, never reaches it
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=prot)
    finally:
        os.close(fd)
    try:
        yield memoryview(mapped)
    finally:
        with contextlib.suppress(BufferError):  # tensors still over it: the GC unmaps it
            mapped.close()


@contextlib.contextmanager
def mapped_push_memfds(paths: str) -> Iterator[list[memoryview]]:
    """The memfds of a push in parts (:func:`write_push_parts`), named by ``paths`` separated
    by commas (at most :data:`MAX_PARTS`), each mapped as :func:`mapped_push_memfd` maps one;
    InvalidInput naming the first that is wrong."""
    names = paths.split(",")
    if len(names) > MAX_PARTS:
        raise InvalidInput(f"weights: the push names {len(names)} memfds, at most {MAX_PARTS}")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(mapped_push_memfd(name.strip())) for name in names]


def _open_regular(path: str) -> int:
    """``path`` opened for reading if it is a regular file of this process's user. It is first
    only named (``O_PATH``: a pipe, socket or device behind it is not opened, so nothing blocks
    or happens), checked, then that very file reopened through ``/proc/self/fd``."""
    try:
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidInput(f"weights: cannot open {path!r}: {exc.strerror}") from exc
    try:
        info = os.fstat(handle)
        if not stat_is_regular(info.st_mode) or info.st_uid != os.geteuid():
            raise InvalidInput(f"weights: {path!r} is not a regular file of this server's user")
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        return os.open(f"/proc/self/fd/{handle}", flags)
    except OSError as exc:
        raise InvalidInput(f"weights: cannot open {path!r}: {exc.strerror}") from exc
    finally:
        os.close(handle)


def _check_seals(fd: int, path: str) -> None:
    """InvalidInput naming the seals the file lacks of those that keep a mapping of it whole
    (shrinking: SIGBUS) and its checked bytes as they were (writing)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # a file that cannot be sealed (not a memfd or on tmpfs)
        seals = 0
    needed = {fcntl.F_SEAL_SHRINK: "shrinking", fcntl.F_SEAL_WRITE: "writing"}
    missing = [what for seal, what in needed.items() if not seals & seal]
    if missing:
        raise InvalidInput(
            f"weights: {path!r} is not sealed against {' or '.join(missing)}"
            " (push_weights writes a sealed memfd)"
        )


def stat_is_regular(mode: int) -> bool:
    """True for a regular file's ``st_mode``."""
    import stat

    return stat.S_ISREG(mode)
