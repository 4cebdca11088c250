"""Pack named tensors into buckets of at most B bytes, in order, for weight transfer.

A weight update streams the trainer's tensors to an engine bucket by bucket, so peak extra
memory is one bucket, not a second copy of the model. Rules: order is kept, nothing is
dropped, a bucket never exceeds ``max_bytes`` unless it holds a single tensor that is
larger than ``max_bytes`` on its own (that tensor gets a bucket to itself).

Works with anything that has ``nbytes`` (numpy arrays) or ``numel()``/``element_size()``
(torch tensors); torch is only imported by :func:`flatten_bucket`/:func:`unflatten_bucket`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rollfleet.errors import InvalidInput

T = TypeVar("T")
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def tensor_nbytes(tensor: Any) -> int:
    """Size of ``tensor``'s data in bytes (torch tensor, numpy array or bytes-like)."""
    if hasattr(tensor, "element_size") and hasattr(tensor, "numel"):
        return int(tensor.numel()) * int(tensor.element_size())
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    if isinstance(tensor, (bytes, bytearray, memoryview)):
        return len(tensor)
    raise InvalidInput(f"cannot size a {type(tensor).__name__}: not a tensor, array or bytes")


@dataclass
class Bucket(Generic[T]):
    """Consecutive named tensors whose total size is at most the bucket limit."""

    items: list[tuple[str, T]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: T, size: int) -> None:
        """Append one named tensor of ``size`` bytes."""
        self.items.append((name, tensor))
        self.nbytes += size

    @property
    def names(self) -> list[str]:
        """The tensor names, in order."""
        return [name for name, _ in self.items]


def bucket_tensors(tensors: Iterable[tuple[str, T]], max_bytes: int) -> Iterator[Bucket[T]]:
    """Yield buckets of consecutive tensors of at most ``max_bytes`` each (lazily, in order)."""
    if max_bytes <= 0:
        raise InvalidInput(f"bucket size must be positive, got max_bytes={max_bytes}")
    bucket: Bucket[T] = Bucket()
    for name, tensor in tensors:
        size = tensor_nbytes(tensor)
        if bucket.items and bucket.nbytes + size > max_bytes:
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor, size)
    if bucket.items:
        yield bucket


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a flattened bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def flatten_bucket(bucket: Bucket[Any]) -> tuple[Any, list[TensorMeta]]:
    """Concatenate a bucket of torch tensors into one uint8 buffer plus the metadata to undo it."""
    import torch

    metas: list[TensorMeta] = []
    parts = []
    offset = 0
    for name, tensor in bucket.items:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append(
            TensorMeta(
                name,
                str(tensor.dtype).removeprefix("torch."),
                tuple(tensor.shape),
                offset,
                flat.numel(),
            )
        )
        parts.append(flat)
        offset += flat.numel()
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return buffer, metas


def unflatten_bucket(buffer: Any, metas: list[TensorMeta]) -> list[tuple[str, Any]]:
    """Rebuild the named tensors of a flattened bucket (views into ``buffer``, no copies)."""
    import torch

    out = []
    for meta in metas:
        raw = buffer[meta.offset : meta.offset + meta.nbytes]
        dtype = getattr(torch, meta.dtype)
        out.append((meta.name, raw.view(dtype).reshape(meta.shape)))
    return out
