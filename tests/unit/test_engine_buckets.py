"""Bucketing named tensors for weight transfer: sizes at, below and above B; order; nothing lost."""

from __future__ import annotations

import numpy as np
import pytest

from rollfleet.engines.weights.buckets import (
    bucket_tensors,
    flatten_bucket,
    tensor_nbytes,
    unflatten_bucket,
)
from rollfleet.errors import InvalidInput


def named(*sizes: int) -> list[tuple[str, np.ndarray]]:
    """Tensors of the given byte sizes named t0, t1, …"""
    return [(f"t{i}", np.full(size, i, dtype=np.uint8)) for i, size in enumerate(sizes)]


def layout(tensors: list[tuple[str, np.ndarray]], limit: int) -> list[list[str]]:
    return [bucket.names for bucket in bucket_tensors(tensors, limit)]


def test_engine_buckets_exactly_at_the_limit_fill_one_bucket() -> None:
    assert layout(named(40, 60, 100), 100) == [["t0", "t1"], ["t2"]]


def test_engine_buckets_below_the_limit_share_a_bucket() -> None:
    assert layout(named(10, 20, 30), 100) == [["t0", "t1", "t2"]]


def test_engine_buckets_one_byte_over_the_limit_starts_a_new_bucket() -> None:
    assert layout(named(50, 51), 100) == [["t0"], ["t1"]]


def test_engine_buckets_tensor_larger_than_limit_gets_its_own_bucket() -> None:
    buckets = list(bucket_tensors(named(10, 250, 10, 10), 100))
    assert [b.names for b in buckets] == [["t0"], ["t1"], ["t2", "t3"]]
    assert [b.nbytes for b in buckets] == [10, 250, 20]


def test_engine_buckets_keep_order_and_lose_nothing() -> None:
    rng = np.random.default_rng(7)
    tensors = named(*rng.integers(1, 300, size=200).tolist())
    buckets = list(bucket_tensors(iter(tensors), 256))
    flat = [item for bucket in buckets for item in bucket.items]
    assert [n for n, _ in flat] == [n for n, _ in tensors]
    assert all(a is b for (_, a), (_, b) in zip(flat, tensors, strict=True))
    assert all(b.nbytes <= 256 or len(b.items) == 1 for b in buckets)
    assert sum(b.nbytes for b in buckets) == sum(t.nbytes for _, t in tensors)


def test_engine_buckets_empty_input_yields_nothing() -> None:
    assert list(bucket_tensors([], 10)) == []


def test_engine_buckets_refuse_a_nonpositive_limit() -> None:
    with pytest.raises(InvalidInput, match="max_bytes=0"):
        list(bucket_tensors(named(1), 0))


def test_engine_buckets_size_torch_tensors_by_dtype() -> None:
    torch = pytest.importorskip("torch")
    assert tensor_nbytes(torch.zeros(3, 4, dtype=torch.float32)) == 48
    assert tensor_nbytes(torch.zeros(5, dtype=torch.bfloat16)) == 10
    with pytest.raises(InvalidInput, match="cannot size a object"):
        tensor_nbytes(object())


def test_engine_buckets_flatten_round_trips_mixed_dtypes() -> None:
    torch = pytest.importorskip("torch")
    items = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1, -2], dtype=torch.int64)),
        ("c", torch.ones(3, dtype=torch.bfloat16)),
    ]
    bucket = next(bucket_tensors(items, 1 << 20))
    buffer, metas = flatten_bucket(bucket)
    assert buffer.numel() == bucket.nbytes
    back = unflatten_bucket(buffer, metas)
    assert [n for n, _ in back] == ["a", "b", "c"]
    for (_, want), (_, got) in zip(items, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
