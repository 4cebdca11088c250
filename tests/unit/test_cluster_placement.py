"""Placement strategies are pure functions of a node list (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollfleet.cluster import (
    CpuPlacement,
    ExplicitPlacement,
    NodeResources,
    PackedPlacement,
    RankPlacement,
)
from rollfleet.cluster.placement import gpu_shortfall
from rollfleet.errors import ClusterError, InvalidInput


def nodes(*gpus: int) -> list[NodeResources]:
    return [NodeResources(i, f"node{i}", f"10.0.0.{i}", 8.0, g) for i, g in enumerate(gpus)]


def test_cluster_packed_fills_nodes_with_contiguous_gpus() -> None:
    plan = PackedPlacement(num_ranks=3, gpus_per_rank=2).plan(nodes(4, 4))
    assert [(p.rank, p.node_index, p.gpus) for p in plan] == [
        (0, 0, (0, 1)),
        (1, 0, (2, 3)),
        (2, 1, (0, 1)),
    ]
    assert [(p.local_rank, p.local_world_size) for p in plan] == [(0, 2), (1, 2), (0, 1)]


def test_cluster_packed_respects_ranks_per_node_and_start_node() -> None:
    plan = PackedPlacement(num_ranks=2, gpus_per_rank=1, ranks_per_node=1, start_node=1).plan(
        nodes(4, 4, 4)
    )
    assert [(p.node_index, p.gpus) for p in plan] == [(1, (0,)), (2, (0,))]


def test_cluster_packed_never_splits_a_rank_across_nodes() -> None:
    plan = PackedPlacement(num_ranks=2, gpus_per_rank=2).plan(nodes(3, 2))
    assert [(p.node_index, p.gpus) for p in plan] == [(0, (0, 1)), (1, (0, 1))]


def test_cluster_packed_says_what_does_not_fit() -> None:
    with pytest.raises(ClusterError, match="3 ranks x 2 GPU"):
        PackedPlacement(num_ranks=3, gpus_per_rank=2).plan(nodes(2, 2))
    with pytest.raises(InvalidInput):
        PackedPlacement(num_ranks=0).plan(nodes(1))


@given(st.lists(st.integers(0, 8), min_size=1, max_size=4), st.integers(1, 8), st.integers(1, 3))
def test_cluster_packed_never_gives_a_gpu_twice(gpus: list[int], ranks: int, per_rank: int) -> None:
    try:
        plan = PackedPlacement(num_ranks=ranks, gpus_per_rank=per_rank).plan(nodes(*gpus))
    except ClusterError:
        assert sum(g // per_rank for g in gpus) < ranks  # refused only when it really does not fit
        return
    owned = [(p.node_index, g) for p in plan for g in p.gpus]
    assert len(owned) == len(set(owned)) == ranks * per_rank
    assert all(g < gpus[p.node_index] for p in plan for g in p.gpus)


def test_cluster_cpu_placement_spreads_evenly_or_packs() -> None:
    assert [p.node_index for p in CpuPlacement(4).plan(nodes(0, 0))] == [0, 0, 1, 1]
    assert [p.node_index for p in CpuPlacement(3, ranks_per_node=3).plan(nodes(0, 0))] == [0, 0, 0]
    assert all(p.gpus == () for p in CpuPlacement(5).plan(nodes(0)))
    with pytest.raises(ClusterError, match="no nodes"):
        CpuPlacement(1).plan([])


def test_cluster_explicit_placement_checks_nodes_and_gpus() -> None:
    plan = ExplicitPlacement(nodes=[1, 0, 1], gpus=[[1], [0], [0]]).plan(nodes(1, 2))
    assert [(p.node_index, p.gpus, p.local_rank) for p in plan] == [
        (1, (1,), 0),
        (0, (0,), 0),
        (1, (0,), 1),
    ]
    with pytest.raises(ClusterError, match="wants node 5"):
        ExplicitPlacement(nodes=[5]).plan(nodes(1))
    with pytest.raises(ClusterError, match="GPU 0 on node 0 is given twice"):
        ExplicitPlacement(nodes=[0, 0], gpus=[[0], [0]]).plan(nodes(1))
    with pytest.raises(ClusterError, match="has 1 GPU"):
        ExplicitPlacement(nodes=[0], gpus=[[3]]).plan(nodes(1))
    with pytest.raises(InvalidInput, match="2 nodes but 1 GPU lists"):
        ExplicitPlacement(nodes=[0, 0], gpus=[[0]]).plan(nodes(1))


def test_cluster_gpu_shortfall_names_each_short_node() -> None:
    plan = ExplicitPlacement(nodes=[0, 1, 1], gpus=[[0], [0], [1]]).plan(nodes(1, 2))
    assert gpu_shortfall(plan, nodes(1, 2), {}) is None  # nothing reserved yet: all free
    assert gpu_shortfall(plan, nodes(1, 2), {"node0": 1.0, "node1": 2.0}) is None
    short = gpu_shortfall(plan, nodes(1, 2), {"node0": 1.0, "node1": 1.0})
    assert (
        short
        == "node 1 (10.0.0.1) has 1 of its 2 GPU(s) free (other actors hold the rest) and 2 are asked of it: short by 1"
    )
    too_many = [RankPlacement(0, 0, (0, 1, 2))]
    assert (
        gpu_shortfall(too_many, nodes(2), {})
        == "node 0 (10.0.0.0) has 2 GPU(s) and 3 are asked of it: short by 1"
    )
    assert (
        gpu_shortfall(CpuPlacement(3).plan(nodes(0)), nodes(0), {"node0": 0.0}) is None
    )  # CPU ranks ask none


def test_cluster_packed_placement_says_the_shortfall() -> None:
    with pytest.raises(
        ClusterError,
        match=r"3 ranks x 2 GPU\(s\) .* have 4 GPU\(s\) \(room for 2 ranks\): short by 1",
    ):
        PackedPlacement(num_ranks=3, gpus_per_rank=2).plan(nodes(2, 2))
