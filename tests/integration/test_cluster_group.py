"""WorkerGroup on a real local Ray cluster: env, info, calls, execute_on, scatter, errors, restart."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.ray

HAVE_RAY = importlib.util.find_spec("ray") is not None
if HAVE_RAY:
    import ray

    from rollfleet.cluster import Cluster, CpuPlacement, Worker, create_channel
    from rollfleet.errors import ClusterError, ClusterTimeout

    class Probe(Worker):
        def __init__(self, base: int) -> None:
            self.base = base
            self.count = 0
            names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
            self.env_at_init = {k: os.environ.get(k) for k in names}

        def env(self) -> dict[str, str | None]:
            return self.env_at_init

        def info(self) -> Any:
            return self.worker_info

        def add(self, x: int, y: int = 0) -> int:
            return self.base + x + y + self.rank

        def bump(self) -> int:
            self.count += 1
            return self.count

        def fail_on(self, rank: int) -> str:
            if self.rank == rank:
                raise ValueError(f"rank {rank} refuses")
            return "ok"

        def wait_for(self, channel: Any) -> Any:
            return channel.get(timeout=60)

        def spawn_child(self) -> list[str]:
            child = Leaf.create_group().launch(Cluster(), CpuPlacement(1))
            try:
                return [i.address.get_name() for i in child.worker_infos] + child.whoami().wait()
            finally:
                child.shutdown()

    class Leaf(Worker):
        def whoami(self) -> str:
            return self.worker_address.get_name()

    class AsyncProbe(Worker):
        async def echo(self, channel: Any) -> tuple[str, Any]:
            item = await channel.get_async(timeout=60)
            return self.worker_address.get_name(), item

    class Broken(Worker):
        def __init__(self) -> None:
            raise RuntimeError("cannot build")


@pytest.fixture(scope="module")
def group(cluster: Any) -> Iterator[Any]:
    g = Probe.create_group(10).launch(cluster, CpuPlacement(2), name="probe")
    yield g
    g.shutdown()


def test_cluster_env_is_set_before_user_init(group: Any, cluster: Any) -> None:
    envs = group.env().wait()
    master = cluster.nodes()[0].node_ip
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {master}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0


def test_cluster_worker_info_describes_each_rank(group: Any) -> None:
    infos = group.info().wait()
    assert [i.address.get_name() for i in infos] == ["probe:0", "probe:1"]
    assert [i.rank for i in infos] == [0, 1]
    assert {i.world_size for i in infos} == {2}
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert all(i.node_id in alive and i.gpu_id is None and i.available_gpus == () for i in infos)
    assert infos == group.worker_infos


def test_cluster_group_call_runs_on_every_rank(group: Any) -> None:
    assert group.add(1).wait() == [11, 12]
    assert group.add(1, y=5).wait(timeout=30) == [16, 17]


def test_cluster_execute_on_and_scatter(group: Any) -> None:
    assert group.execute_on(1).add(5).wait() == [16]
    assert group.execute_on([1, 0]).add(0).wait() == [11, 10]
    assert group.add([1, 2], y=[100, 200], scatter=True).wait() == [111, 213]
    with pytest.raises(Exception, match="ranks 0..1"):
        group.execute_on(2)


async def test_cluster_group_call_is_awaitable(group: Any) -> None:
    assert await group.add(2) == [12, 13]
    assert await group.execute_on(0).add(3).wait_async(timeout=30) == [13]


def test_cluster_rank_error_is_the_original_exception_with_the_address(group: Any) -> None:
    before = group.bump().wait()
    with pytest.raises(ValueError, match="rank 1 refuses") as info:
        group.fail_on(1).wait()
    assert info.value.worker_address == "probe:1"  # type: ignore[attr-defined]
    assert any("probe:1" in note for note in info.value.__notes__)
    assert group.bump().wait() == [b + 1 for b in before]  # no rank was restarted or killed


def test_cluster_wait_timeout_names_the_rank_and_the_caller(group: Any) -> None:
    gate = create_channel("gate")
    try:
        call = group.execute_on(0).wait_for(gate)
        with pytest.raises(ClusterTimeout, match=r"probe:0 did not answer driver"):
            call.wait(timeout=0.5)
        assert not call.done()
        gate.put("go")
        assert call.wait(timeout=60) == ["go"]
    finally:
        gate.destroy()


def test_cluster_child_group_gets_a_hierarchical_address(group: Any) -> None:
    assert group.execute_on(0).spawn_child().wait() == [["probe:0:0", "probe:0:0"]]


def test_cluster_constructor_failure_surfaces_at_launch(cluster: Any) -> None:
    with pytest.raises(RuntimeError, match="cannot build") as info:
        Broken.create_group().launch(cluster, CpuPlacement(1), name="broken")
    assert any("broken:0" in note for note in info.value.__notes__)


def test_cluster_group_name_in_use_is_refused(cluster: Any, group: Any) -> None:
    with pytest.raises(ClusterError, match="probe:0 is already running"):
        Probe.create_group(0).launch(cluster, CpuPlacement(1), name="probe")
    assert group.add(0).wait() == [10, 11]  # the running group is untouched


async def test_cluster_async_worker_methods(cluster: Any) -> None:
    group = AsyncProbe.create_group().launch(cluster, CpuPlacement(2), name="async-probe")
    channel = create_channel("async-items")
    try:
        work = group.echo(channel)
        await channel.put_async("x")
        await channel.put_async("y")
        got = await work.wait_async(timeout=60)
        assert [address for address, _ in got] == ["async-probe:0", "async-probe:1"]
        assert sorted(item for _, item in got) == ["x", "y"]  # each rank got one of the two
    finally:
        channel.destroy()
        group.shutdown()


def test_cluster_waiting_for_missing_nodes_times_out(cluster: Any) -> None:
    with pytest.raises(ClusterTimeout, match="waited 0s for 99 nodes"):
        Cluster(num_nodes=99, timeout=0.3)


def test_cluster_killed_rank_is_reported_and_restarted(group: Any) -> None:
    ray.kill(group.handles[1], no_restart=True)  # asynchronous: wait until the rank is gone
    deadline = time.monotonic() + 60
    while group.alive() != [True, False]:
        assert time.monotonic() < deadline, "rank 1 did not die"
    with pytest.raises(ClusterError, match="probe:1 died"):
        group.add(0).wait(timeout=60)
    group.restart(1)
    assert group.alive() == [True, True]
    assert group.add(0).wait() == [10, 11]
    assert group.execute_on(1).env().wait()[0]["RANK"] == "1"
