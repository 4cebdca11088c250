"""rollfleet.cluster: Worker, WorkerGroup, WorkerAddress, Channel and placement on Ray.

::

    cluster = Cluster()                                   # a local Ray, or join one
    group = MyWorker.create_group(cfg).launch(cluster, CpuPlacement(2), name="actor")
    results = group.step(batch).wait()                    # one result per rank
    channel = create_channel("experiences", maxsize=64)   # small items inline, big ones by
    reference

Names are imported on first use, so addresses and placement work without Ray installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollfleet.cluster.address import WorkerAddress, WorkerInfo
    from rollfleet.cluster.channel import (
        DEFAULT_KEY,
        Channel,
        connect_channel,
        create_channel,
    )
    from rollfleet.cluster.cluster import Cluster
    from rollfleet.cluster.collective import TensorWork
    from rollfleet.cluster.group import WorkerGroup, WorkerGroupSpec
    from rollfleet.cluster.placement import (
        CpuPlacement,
        ExplicitPlacement,
        NodeResources,
        PackedPlacement,
        PlacementStrategy,
        RankPlacement,
    )
    from rollfleet.cluster.waiting import Work
    from rollfleet.cluster.worker import Worker
    from rollfleet.errors import ChannelEmpty, ChannelFull

_WHERE = {
    "WorkerAddress": "address",
    "WorkerInfo": "address",
    "DEFAULT_KEY": "channel",
    "Channel": "channel",
    "ChannelEmpty": "channel",
    "ChannelFull": "channel",
    "connect_channel": "channel",
    "create_channel": "channel",
    "Cluster": "cluster",
    "TensorWork": "collective",
    "WorkerGroup": "group",
    "WorkerGroupSpec": "group",
    "CpuPlacement": "placement",
    "ExplicitPlacement": "placement",
    "NodeResources": "placement",
    "PackedPlacement": "placement",
    "PlacementStrategy": "placement",
    "RankPlacement": "placement",
    "Work": "waiting",
    "Worker": "worker",
}

__all__ = [
    "Channel",
    "ChannelEmpty",
    "ChannelFull",
    "Cluster",
    "CpuPlacement",
    "DEFAULT_KEY",
    "ExplicitPlacement",
    "NodeResources",
    "PackedPlacement",
    "PlacementStrategy",
    "RankPlacement",
    "TensorWork",
    "Work",
    "Worker",
    "WorkerAddress",
    "WorkerGroup",
    "WorkerGroupSpec",
    "WorkerInfo",
    "connect_channel",
    "create_channel",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rollfleet.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rollfleet.cluster.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
