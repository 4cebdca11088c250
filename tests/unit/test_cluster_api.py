"""The public surface of rollfleet.cluster and the pure helpers behind group calls (no Ray)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
from support import require

import rollfleet.cluster as cluster
from rollfleet.cluster import Worker
from rollfleet.cluster.worker import group_methods
from rollfleet.errors import ClusterError, InvalidInput

HAVE_RAY = importlib.util.find_spec("ray") is not None


def _scatter(*args: Any) -> Any:
    require(HAVE_RAY, "Ray (pip install 'rollfleet[cluster]')")
    from rollfleet.cluster.group import _scatter as scatter

    return scatter(*args)


def test_cluster_public_names_are_exported() -> None:
    expected = {
        "Cluster",
        "Worker",
        "WorkerInfo",
        "WorkerAddress",
        "WorkerGroup",
        "Channel",
        "create_channel",
        "connect_channel",
        "PackedPlacement",
        "CpuPlacement",
        "ExplicitPlacement",
        "ChannelEmpty",
        "ChannelFull",
    }
    assert expected <= set(cluster.__all__)
    require(HAVE_RAY, "Ray (pip install 'rollfleet[cluster]')")
    assert all(hasattr(cluster, name) for name in cluster.__all__)
    with pytest.raises(AttributeError):
        _ = cluster.NoSuchName  # type: ignore[attr-defined]


def test_cluster_addresses_and_placement_import_without_ray() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from rollfleet.cluster import WorkerAddress, CpuPlacement, Worker\n"
        "assert WorkerAddress.parse('g:1').rank == 1 and CpuPlacement(1).num_ranks == 1"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


class Base(Worker):
    def step(self) -> None: ...

    def _hidden(self) -> None: ...


class Child(Base):
    def extra(self) -> None: ...

    @classmethod
    def factory(cls) -> None: ...


def test_cluster_group_methods_are_the_subclass_public_methods() -> None:
    assert group_methods(Child) == {"step", "extra"}


def test_cluster_worker_outside_a_group_says_so() -> None:
    with pytest.raises(ClusterError, match="not launched in a WorkerGroup"):
        _ = Child().worker_info


def test_cluster_scatter_splits_lists_and_broadcasts_the_rest() -> None:
    calls = _scatter(([1, 2], "shared"), {"k": ["a", "b"], "flag": True}, 2, "m")
    assert calls == [
        ((1, "shared"), {"k": "a", "flag": True}),
        ((2, "shared"), {"k": "b", "flag": True}),
    ]


def test_cluster_scatter_rejects_a_list_of_the_wrong_length() -> None:
    with pytest.raises(InvalidInput, match="argument 'k' has 3 entries for 2 ranks"):
        _scatter((), {"k": [1, 2, 3]}, 2, "m")
