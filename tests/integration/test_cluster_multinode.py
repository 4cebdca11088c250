"""Past one machine: a real multi-node Ray cluster on this machine (ray.cluster_utils: a head and
two worker nodes, each a raylet of its own with its own resources; node ``gpu`` declares two
simulated GPUs). Runners spread over the nodes and a removed node's rollouts finish elsewhere,
exactly once; a WorkerGroup names a dead rank's node and restarts it elsewhere; a Channel outlives
its consumer's node; GPU ranks reserve GPUs from Ray; RLinf's spellings work across nodes."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import ServeProcess, eventually, require

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

HAVE_RAY = importlib.util.find_spec("ray") is not None
if HAVE_RAY:
    import ray
    from ray.cluster_utils import Cluster as RayNodes

    from rollfleet.cluster import (
        Cluster,
        CpuPlacement,
        ExplicitPlacement,
        PackedPlacement,
        Worker,
        create_channel,
    )
    from rollfleet.errors import ClusterError, InvalidInput

    class Where(Worker):
        def node(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

        def gpus(self) -> tuple[Any, str | None]:
            return self.worker_info.available_gpus, os.environ.get("CUDA_VISIBLE_DEVICES")

        def take(self, channel: Any, n: int) -> list[Any]:
            return list(channel.get_batch(n, timeout=120))

        def pass_on(self, peer: str) -> str:  # RLinf's spellings of send/recv
            self.send({"from": self.rank}, dst_group_name=peer, dst_rank=self.rank, timeout=60)
            return f"sent by {self.worker_address}"

        def collect(self, peer: str) -> Any:
            return self.recv(src_group_name=peer, src_rank=self.rank, timeout=60)

        def make_channel(self, name: str, node: str) -> str:
            channel = self.create_channel(name, node, 4)  # RLinf: (name, node_id, maxsize)
            channel.put("made in a worker")
            return f"{channel.maxsize}"


WAIT_S = 60.0
MIB = 1024 * 1024
NODE_ARGS = {"object_store_memory": 80 * MIB, "dashboard_agent_listen_port": 0}
LABELS: dict[str, dict[str, Any]] = {
    "head": {"num_cpus": 1},
    "spare": {"num_cpus": 1},
    "gpu": {"num_cpus": 1, "num_gpus": 2},
}


@dataclass
class Nodes:
    """The Ray cluster's nodes by label; a removed node comes back as a fresh one (new id)."""

    ray_nodes: Any
    by_label: dict[str, Any] = field(default_factory=dict)

    def add(self, label: str) -> None:
        args = {**NODE_ARGS, **LABELS[label], "resources": {label: 1}}
        self.by_label[label] = self.ray_nodes.add_node(**args)
        self.ray_nodes.wait_for_nodes()

    def node_id(self, label: str) -> str:
        return str(self.by_label[label].node_id)

    def label_of(self, node_id: str) -> str:
        return next(lab for lab, node in self.by_label.items() if node.node_id == node_id)

    def index(self, label: str) -> int:
        return next(n.index for n in Cluster().nodes() if n.node_id == self.node_id(label))

    def remove(self, label: str) -> str:
        """Remove the node and wait until Ray has it as dead; its id."""
        gone = self.node_id(label)
        self.ray_nodes.remove_node(self.by_label.pop(label))
        until(lambda: all(n["NodeID"] != gone or not n["Alive"] for n in ray.nodes()), "node death")
        return gone


def until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll ``check`` until it is truthy (for state in other processes, where nothing signals)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    require(HAVE_RAY, "Ray (pip install 'rollfleet[cluster]')")
    from rollfleet.cluster.cluster import _share_import_path

    _share_import_path()  # the nodes' workers import this module (they inherit PYTHONPATH)
    head = {**NODE_ARGS, **LABELS["head"], "resources": {"head": 1}, "include_dashboard": False}
    ray_nodes = RayNodes(initialize_head=True, head_node_args=head)
    found = Nodes(ray_nodes, {"head": ray_nodes.head_node})
    for label in ("spare", "gpu"):
        found.add(label)
    ray.init(address=ray_nodes.address, log_to_driver=False)
    yield found
    ray.shutdown()
    ray_nodes.shutdown()


async def test_runners_spread_and_a_removed_node_loses_no_rollout(
    nodes: Nodes, tmp_path: Path
) -> None:
    from rollfleet.client import HttpStore
    from rollfleet.model import AttemptStatus, RolloutSpec, RolloutStatus
    from rollfleet.runner.ray_fleet import STATE_PREFIX, RayFleet

    server = ServeProcess(f"sqlite:///{tmp_path}/multinode.db").start()
    store = HttpStore(server.url)
    fleet = RayFleet(
        server.url, "rollfleet.agents.sleep", n=2, concurrency=4, cpus_per_runner=1, grace_s=5
    )
    run = asyncio.create_task(fleet.run())
    try:
        specs = [
            RolloutSpec(
                input={"duration": 0.2},
                rollout_id=f"mn-{i}",
                config={"heartbeat_s": 1, "max_attempts": 10},
            )
            for i in range(120)
        ]
        await store.enqueue_many(specs)

        async def started() -> bool:
            return len(fleet.actors) == 2 and all(
                ray.get([a.ready.remote() for a in fleet.actors.values()])
            )

        await eventually(started, WAIT_S, interval=0.2, what="both runner actors")
        where = {w: ray.get(a.node_id.remote(), timeout=WAIT_S) for w, a in fleet.actors.items()}
        assert len(set(where.values())) == 2, f"both runners on one node: {where}"
        victim = next(w for w, n in where.items() if nodes.label_of(n) != "head")

        async def victim_working() -> list[str]:
            w = {w.worker_id: w for w in (await store.query_workers()).items}.get(victim)
            return (
                list(w.current_attempts)
                if w and w.rollouts_succeeded and w.current_attempts
                else []
            )

        held = await eventually(
            victim_working, WAIT_S, interval=0.02, what=f"{victim} to finish and hold"
        )
        dead = await asyncio.to_thread(nodes.remove, nodes.label_of(where[victim]))

        done = await store.wait_for_rollouts([s.rollout_id for s in specs], 180)
        assert Counter(r.status for r in done) == {RolloutStatus.SUCCEEDED: len(specs)}
        succeeded = (await store.query_attempts(status=[AttemptStatus.SUCCEEDED], limit=1000)).items
        assert Counter(a.rollout_id for a in succeeded) == {
            s.rollout_id: 1 for s in specs
        }  # exactly once
        lost = {
            a.attempt_id
            for a in (await store.query_attempts(status=[AttemptStatus.LOST], limit=1000)).items
        }
        assert set(held) <= lost, "the removed node's attempts must have been lost, then run again"
        moved = ray.get(fleet.actors[victim].node_id.remote(), timeout=WAIT_S)
        assert moved != dead, "Ray restarted the runner on another node"
        restarted = await store.get_state(STATE_PREFIX + victim)
        assert (
            restarted["last"]["delay_s"] == 0.0 and "made progress" in restarted["last"]["reason"]
        )
    finally:
        fleet.stop()
        await asyncio.wait_for(run, 120)
        await store.close()
        server.kill()
        for label in set(LABELS) - set(nodes.by_label):
            nodes.add(label)


def test_group_names_a_dead_ranks_node_and_restarts_it_elsewhere(nodes: Nodes) -> None:
    group = Where.create_group().launch(Cluster(), CpuPlacement(3), name="spread")
    try:
        placed = group.node().wait(timeout=WAIT_S)
        assert sorted(nodes.label_of(n) for n in placed) == ["gpu", "head", "spare"]
        rank = placed.index(nodes.node_id("spare"))
        dead = nodes.remove("spare")
        until(
            lambda: group.alive() == [r != rank for r in range(3)], "the rank to be reported dead"
        )
        with pytest.raises(
            ClusterError,
            match=rf"spread:{rank} died during spread\.node \(it ran on node .*{dead[:12]}",
        ):
            group.node().wait(timeout=WAIT_S)
        group.restart(rank, timeout=WAIT_S)
        assert group.alive() == [True, True, True]
        now = group.node().wait(timeout=WAIT_S)
        assert now[rank] != dead and now[rank] in {nodes.node_id("head"), nodes.node_id("gpu")}
        assert group.worker_infos[rank].node_id == now[rank]
    finally:
        group.shutdown()
        nodes.add("spare")


def test_channel_outlives_its_consumers_node(nodes: Nodes) -> None:
    channel = create_channel(
        "multinode", nodes.index("head"), 8
    )  # RLinf's (name, node_id, maxsize)
    consumer = Where.create_group().launch(
        Cluster(), ExplicitPlacement([nodes.index("spare")]), name="eater"
    )
    try:
        channel.put_batch(["a", "b"])
        waiting = consumer.take(channel, 5)  # blocks in the channel: only two items so far
        until(
            lambda: ray.get(channel._actor.waiting.remote())[0] >= 1, "the consumer's get to park"
        )
        nodes.remove("spare")
        until(
            lambda: ray.get(channel._actor.waiting.remote())[0] == 0,
            "the dead consumer's get to end",
        )
        with pytest.raises(ClusterError, match="died"):
            waiting.wait(timeout=WAIT_S)
        channel.put_batch(["c", "d", "e"])
        assert channel.qsize() == 5  # the dead consumer took nothing
        assert channel.get_batch(5, timeout=WAIT_S) == ["a", "b", "c", "d", "e"]
    finally:
        consumer.shutdown()
        channel.destroy()
        nodes.add("spare")


def test_gpu_ranks_reserve_gpus_from_ray_where_they_are(nodes: Nodes) -> None:
    assert ray.cluster_resources().get("GPU") == 2.0
    group = Where.create_group().launch(Cluster(), PackedPlacement(2, gpus_per_rank=1), name="gpus")
    try:
        assert set(group.node().wait(timeout=WAIT_S)) == {
            nodes.node_id("gpu")
        }  # where the GPUs are
        seen = group.gpus().wait(timeout=WAIT_S)
        assert sorted(gpus for gpus, _ in seen) == [(0,), (1,)]  # the GPUs Ray reserved, one each
        assert all(visible == ",".join(map(str, gpus)) for gpus, visible in seen)
        assert [info.available_gpus for info in group.worker_infos] == [gpus for gpus, _ in seen]
        until(
            lambda: ray.available_resources().get("GPU", 0.0) == 0.0, "Ray to count them as taken"
        )
        with pytest.raises(
            ClusterError, match=r"gpu-more: not enough GPUs.*0 of its 2 GPU\(s\) free.*short by 1"
        ):
            Where.create_group().launch(
                Cluster(), PackedPlacement(1, gpus_per_rank=1), name="gpu-more"
            )
    finally:
        group.shutdown()
    with pytest.raises(
        ClusterError, match=r"3 ranks x 1 GPU\(s\).*have 2 GPU\(s\).*short by 1 rank"
    ):
        Where.create_group().launch(Cluster(), PackedPlacement(3, gpus_per_rank=1), name="gpu-many")
    until(lambda: ray.available_resources().get("GPU", 0.0) == 2.0, "the GPUs to be given back")


def test_rlinf_spellings_across_nodes(nodes: Nodes) -> None:
    cluster = Cluster()
    left = Where.create_group().launch(
        cluster, ExplicitPlacement([nodes.index("head"), nodes.index("spare")]), name="left"
    )
    right = Where.create_group().launch(
        cluster, ExplicitPlacement([nodes.index("gpu"), nodes.index("head")]), name="right"
    )
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29511"}
    allocated = cluster.allocate(Where, "allocated:0", nodes.index("spare"), None, env)
    try:
        sending = left.pass_on("right")
        assert right.collect("left").wait(timeout=WAIT_S) == [{"from": 0}, {"from": 1}]
        assert sending.wait(timeout=WAIT_S) == ["sent by left:0", "sent by left:1"]
        assert ray.get(allocated.node.remote(), timeout=WAIT_S) == nodes.node_id("spare")
        info = ray.get(allocated._rf_info_now.remote(), timeout=WAIT_S)
        assert (info.address.get_name(), info.master_port, info.node_id) == (
            "allocated:0",
            29511,
            nodes.node_id("spare"),
        )
        assert (
            ray.get(
                allocated.make_channel.remote("rlinf-made", nodes.node_id("gpu")), timeout=WAIT_S
            )
            == "4"
        )
        with pytest.raises(InvalidInput, match="pass maxsize= by keyword"):
            create_channel(
                "old-order", 64
            )  # a maxsize where RLinf puts the node: refused, not guessed
    finally:
        ray.kill(allocated, no_restart=True)
        left.shutdown()
        right.shutdown()
