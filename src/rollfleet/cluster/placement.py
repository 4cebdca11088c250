"""Placement strategies: which node and which GPUs each rank of a group gets.

Pure functions of a node list, so they are unit-tested without Ray. ``Cluster.nodes()`` supplies
the real node list; a strategy's ``plan(nodes)`` returns one :class:`RankPlacement` per rank.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from rollfleet.errors import ClusterError, InvalidInput


@dataclass(frozen=True, slots=True)
class NodeResources:
    """One Ray node as placement sees it."""

    index: int
    node_id: str
    node_ip: str
    num_cpus: float
    num_gpus: int


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where one rank runs: its node, its node-local rank and the local GPU ids it owns."""

    rank: int
    node_index: int
    gpus: tuple[int, ...] = ()
    num_cpus: float = 0.0
    local_rank: int = 0
    local_world_size: int = 1


class PlacementStrategy(Protocol):
    """Anything with ``plan(nodes) -> list[RankPlacement]``."""

    def plan(self, nodes: Sequence[NodeResources]) -> list[RankPlacement]:
        """Place every rank on ``nodes`` or raise ClusterError saying what does not fit."""
        ...


def _with_local_ranks(placements: list[RankPlacement]) -> list[RankPlacement]:
    """Fill in local_rank / local_world_size from the node each rank landed on."""
    per_node = Counter(p.node_index for p in placements)
    seen: Counter[int] = Counter()
    out = []
    for p in placements:
        out.append(
            replace(p, local_rank=seen[p.node_index], local_world_size=per_node[p.node_index])
        )
        seen[p.node_index] += 1
    return out


def gpu_shortfall(
    plan: Sequence[RankPlacement], nodes: Sequence[NodeResources], free: Mapping[str, float]
) -> str | None:
    """Why Ray cannot reserve the GPUs ``plan`` asks for, node by node (None: it can).

    ``free`` holds the GPUs no actor has reserved yet, per Ray node id (a node missing from it
    counts as all free).
    """
    demand: Counter[int] = Counter()
    for p in plan:
        demand[p.node_index] += len(p.gpus)
    problems = []
    for index, need in sorted(demand.items()):
        node = nodes[index]
        free_now = free.get(node.node_id, float(node.num_gpus))
        where = f"node {index} ({node.node_ip})"
        if need > node.num_gpus:
            problems.append(
                f"{where} has {node.num_gpus} GPU(s) and {need} are asked of it: "
                f"short by {need - node.num_gpus}"
            )
        elif need > free_now:
            problems.append(
                f"{where} has {free_now:g} of its {node.num_gpus} GPU(s) free (other actors hold "
                f"the rest) and {need} are asked of it: short by {need - free_now:g}"
            )
    return "; ".join(problems) or None


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise InvalidInput(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class PackedPlacement:
    """Fill nodes in order, ``gpus_per_rank`` contiguous GPUs per rank, at most ``ranks_per_node``.

    A rank never spans two nodes. ``gpus_per_rank=0`` packs CPU-only ranks ``ranks_per_node`` to
    a node (all on the first node when ``ranks_per_node`` is None).
    """

    num_ranks: int
    gpus_per_rank: int = 1
    ranks_per_node: int | None = None
    start_node: int = 0
    num_cpus_per_rank: float = 0.0

    def plan(self, nodes: Sequence[NodeResources]) -> list[RankPlacement]:
        """Place ranks node by node; ClusterError when the nodes run out."""
        _positive("num_ranks", self.num_ranks)
        if self.gpus_per_rank < 0:
            raise InvalidInput(f"gpus_per_rank must be >= 0, got {self.gpus_per_rank}")
        placements: list[RankPlacement] = []
        for node in nodes[self.start_node :]:
            for slot in range(self._slots(node)):
                if len(placements) == self.num_ranks:
                    return _with_local_ranks(placements)
                first = slot * self.gpus_per_rank
                gpus = tuple(range(first, first + self.gpus_per_rank))
                placements.append(
                    RankPlacement(len(placements), node.index, gpus, self.num_cpus_per_rank)
                )
        if len(placements) < self.num_ranks:
            have = sum(n.num_gpus for n in nodes[self.start_node :])
            raise ClusterError(
                f"packed placement: {self.num_ranks} ranks x {self.gpus_per_rank} GPU(s) do not "
                f"fit on nodes {self.start_node}..{len(nodes) - 1}, which have {have} GPU(s) "
                f"(room for {len(placements)} ranks): short by "
                f"{self.num_ranks - len(placements)} rank(s)"
            )
        return _with_local_ranks(placements)

    def _slots(self, node: NodeResources) -> int:
        """How many ranks fit on ``node``."""
        cap = self.ranks_per_node if self.ranks_per_node is not None else self.num_ranks
        if self.gpus_per_rank == 0:
            return cap
        return min(cap, node.num_gpus // self.gpus_per_rank)


@dataclass(frozen=True)
class CpuPlacement:
    """CPU-only ranks, spread evenly over the nodes (or ``ranks_per_node`` to a node)."""

    num_ranks: int
    ranks_per_node: int | None = None
    num_cpus_per_rank: float = 0.0

    def plan(self, nodes: Sequence[NodeResources]) -> list[RankPlacement]:
        """Place ranks in node order, ``ranks_per_node`` (default: an even share) per node."""
        _positive("num_ranks", self.num_ranks)
        if not nodes:
            raise ClusterError("cpu placement: the cluster has no nodes")
        per_node = self.ranks_per_node or math.ceil(self.num_ranks / len(nodes))
        packed = PackedPlacement(self.num_ranks, 0, per_node, 0, self.num_cpus_per_rank)
        return packed.plan(nodes)


@dataclass(frozen=True)
class ExplicitPlacement:
    """Each rank's node index and (optionally) its local GPU ids, spelled out."""

    nodes: Sequence[int]
    gpus: Sequence[Sequence[int]] | None = None
    num_cpus_per_rank: float = 0.0

    def plan(self, nodes: Sequence[NodeResources]) -> list[RankPlacement]:
        """Check every rank's node and GPUs exist and no GPU is given twice."""
        if not self.nodes:
            raise InvalidInput("explicit placement: nodes must list at least one rank")
        gpus = self.gpus if self.gpus is not None else [()] * len(self.nodes)
        if len(gpus) != len(self.nodes):
            raise InvalidInput(
                f"explicit placement: {len(self.nodes)} nodes but {len(gpus)} GPU lists"
            )
        taken: set[tuple[int, int]] = set()
        placements = []
        for rank, (node_index, rank_gpus) in enumerate(zip(self.nodes, gpus, strict=True)):
            node = self._node(nodes, rank, node_index)
            for gpu in rank_gpus:
                self._claim(taken, node, rank, gpu)
            placements.append(
                RankPlacement(rank, node_index, tuple(rank_gpus), self.num_cpus_per_rank)
            )
        return _with_local_ranks(placements)

    @staticmethod
    def _node(nodes: Sequence[NodeResources], rank: int, index: int) -> NodeResources:
        if not 0 <= index < len(nodes):
            raise ClusterError(
                f"explicit placement: rank {rank} wants node {index}, cluster has {len(nodes)}"
            )
        return nodes[index]

    @staticmethod
    def _claim(taken: set[tuple[int, int]], node: NodeResources, rank: int, gpu: int) -> None:
        if not 0 <= gpu < node.num_gpus:
            raise ClusterError(
                f"explicit placement: rank {rank} wants GPU {gpu} on node {node.index}, "
                f"which has {node.num_gpus} GPU(s)"
            )
        if (node.index, gpu) in taken:
            raise ClusterError(f"explicit placement: GPU {gpu} on node {node.index} is given twice")
        taken.add((node.index, gpu))
