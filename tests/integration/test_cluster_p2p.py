"""send/recv of objects and tensors between workers on a real local Ray cluster (gloo on CPU)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from support import require

pytestmark = pytest.mark.ray

HAVE_DEPS = all(importlib.util.find_spec(m) is not None for m in ("ray", "torch"))
if HAVE_DEPS:
    import torch

    from rollfleet.cluster import CpuPlacement, Worker
    from rollfleet.errors import ClusterTimeout

    class Node(Worker):
        def send_many(self, group: str, rank: int, objs: list[Any]) -> None:
            for obj in objs:
                self.send(obj, group, rank)

        def recv_many(self, group: str, rank: int, n: int) -> list[Any]:
            return [self.recv(group, rank, timeout=60) for _ in range(n)]

        def send_async(self, group: str, rank: int, obj: Any) -> None:
            self.send(obj, group, rank, async_op=True).wait(timeout=60)

        def recv_async(self, group: str, rank: int) -> Any:
            return self.recv(group, rank, async_op=True).wait(timeout=60)

        def recv_timeout(self, group: str, rank: int) -> str:
            try:
                self.recv(group, rank, timeout=0.3)
            except ClusterTimeout as exc:
                return str(exc)
            return "no timeout"

        def send_tensor_to(self, group: str, rank: int, value: float, async_op: bool) -> None:
            tensor = torch.full((4, 3), value)
            work = self.send_tensor(tensor, group, rank, async_op=async_op, timeout=60)
            if work is not None:
                work.wait()

        def recv_tensor_from(self, group: str, rank: int, async_op: bool) -> list[list[float]]:
            buffer = torch.zeros(4, 3)
            work = self.recv_tensor(buffer, group, rank, async_op=async_op, timeout=60)
            if work is not None:
                work.wait()
            return buffer.tolist()

        def mail_stale_rendezvous(self, group: str, rank: int) -> None:
            from rollfleet.cluster import collective
            from rollfleet.cluster.cluster import free_local_port

            peer = self.worker_address.parse(group).get_child_address(rank)
            dead = (self.worker_info.node_ip, free_local_port())  # nothing listens there
            collective.send_object(self.worker_address, dead, peer, False, 30, "rdzv:gloo|")

        def recv_tensor_timeout(self, group: str, rank: int) -> str:
            try:
                self.recv_tensor(torch.zeros(1), group, rank, timeout=0.5)
            except ClusterTimeout as exc:
                return str(exc)
            return "no timeout"


@pytest.fixture(scope="module")
def nodes(cluster: Any) -> Iterator[Any]:
    require(HAVE_DEPS, "Ray and torch (pip install 'rollfleet[cluster]')")
    g = Node.create_group().launch(cluster, CpuPlacement(2), name="p2p")
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def others(cluster: Any) -> Iterator[Any]:
    g = Node.create_group().launch(cluster, CpuPlacement(1), name="other")
    yield g
    g.shutdown()


def test_cluster_send_recv_objects_in_order(nodes: Any) -> None:
    objs = [{"step": i, "data": list(range(i))} for i in range(5)] + [b"x" * 300_000]
    recv = nodes.execute_on(1).recv_many("p2p", 0, len(objs))
    nodes.execute_on(0).send_many("p2p", 1, objs).wait(timeout=60)
    assert recv.wait(timeout=60) == [objs]


def test_cluster_send_recv_across_groups_with_async_op(nodes: Any, others: Any) -> None:
    got = others.recv_async("p2p", 1)
    nodes.execute_on(1).send_async("other", 0, ("hello", 42)).wait(timeout=60)
    assert got.wait(timeout=60) == [("hello", 42)]


def test_cluster_recv_timeout_names_both_ends(nodes: Any) -> None:
    message = nodes.execute_on(0).recv_timeout("other", 0).wait(timeout=60)[0]
    assert "p2p:0" in message and "other:0" in message and "0.3s" in message


@pytest.mark.parametrize("async_op", [False, True])
def test_cluster_send_recv_tensor_over_gloo(nodes: Any, async_op: bool) -> None:
    recv = nodes.execute_on(1).recv_tensor_from("p2p", 0, async_op)
    nodes.execute_on(0).send_tensor_to("p2p", 1, 7.0 if async_op else 3.0, async_op).wait(
        timeout=120
    )
    assert recv.wait(timeout=120) == [[[7.0 if async_op else 3.0] * 3] * 4]


def test_cluster_tensor_both_directions_reuse_the_pair(nodes: Any) -> None:
    back = nodes.execute_on(0).recv_tensor_from("p2p", 1, False)
    nodes.execute_on(1).send_tensor_to("p2p", 0, -1.5, False).wait(timeout=120)
    assert back.wait(timeout=120) == [[[-1.5] * 3] * 4]


def test_cluster_recv_tensor_timeout_names_both_ends(nodes: Any) -> None:
    message = nodes.execute_on(1).recv_tensor_timeout("other", 0).wait(timeout=60)[0]
    assert "p2p:1" in message and "other:0" in message


def test_cluster_send_reaches_a_group_launched_again(cluster: Any, nodes: Any) -> None:
    for attempt in range(2):  # the sender's cached mailbox of "again" is gone the second time
        target = Node.create_group().launch(cluster, CpuPlacement(1), name="again")
        try:
            got = target.recv_many("p2p", 0, 1)
            nodes.execute_on(0).send_many("again", 0, [attempt]).wait(timeout=60)
            assert got.wait(timeout=60) == [[attempt]]
        finally:
            target.shutdown()


def test_cluster_tensor_rendezvous_skips_a_stale_address(nodes: Any, others: Any) -> None:
    others.mail_stale_rendezvous("p2p", 0).wait(timeout=60)  # as an abandoned attempt would leave
    got = nodes.execute_on(0).recv_tensor_from("other", 0, False)
    others.send_tensor_to("p2p", 0, 2.5, False).wait(timeout=120)
    assert got.wait(timeout=120) == [[[2.5] * 3] * 4]
