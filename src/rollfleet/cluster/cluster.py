"""``Cluster``: start or join Ray and describe its nodes for placement."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollfleet.cluster.placement import NodeResources
from rollfleet.errors import ClusterError, ClusterTimeout

log = logging.getLogger("rollfleet.cluster")

NAMESPACE = "rollfleet"
DEFAULT_OBJECT_STORE_BYTES = 200 * 1024 * 1024


def free_local_port(host: str = "") -> int:
    """A TCP port that nothing on this machine listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _share_import_path() -> None:
    """Let a local cluster's workers import whatever this driver can (they inherit PYTHONPATH)."""
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    entries += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    seen = dict.fromkeys(p for p in entries if p and os.path.isdir(p))
    os.environ["PYTHONPATH"] = os.pathsep.join(seen)


@ray.remote(num_cpus=0)
def _free_port_on_node() -> int:
    return free_local_port()


class Cluster:
    """A handle on a Ray cluster: starts a local one, or joins ``address`` / the running one.

    A local start runs without the dashboard and with a small object store, so it works on a
    laptop or a sandbox without network (Ray 2.60 refuses a loopback node address and binds to
    the machine's own IP; nothing leaves the machine). Inside a worker, ``Cluster()`` joins the
    cluster the worker runs in.
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
        timeout: float = 120.0,
    ) -> None:
        self.started = False
        if not ray.is_initialized():
            self._start_or_join(address, num_cpus, num_gpus, object_store_memory)
        self._num_nodes = self._wait_for_nodes(num_nodes, timeout)

    def _start_or_join(
        self, address: str | None, num_cpus: int | None, num_gpus: int | None, store: int
    ) -> None:
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
        if address == "local":
            kwargs |= {
                "include_dashboard": False,
                "num_cpus": num_cpus or max(os.cpu_count() or 1, 2),
                "num_gpus": num_gpus,
                "object_store_memory": store,
            }
            _share_import_path()
            self.started = True
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"could not start or join Ray at {address!r}: {exc}") from exc
        log.info("cluster %s Ray at %s", "started" if self.started else "joined", address)

    def _wait_for_nodes(self, num_nodes: int | None, timeout: float) -> int:
        """Wait until ``num_nodes`` nodes are alive (all alive ones when None)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = len(self.nodes())
            if num_nodes is None or alive >= num_nodes:
                return num_nodes or alive
            if time.monotonic() > deadline:
                raise ClusterTimeout(
                    f"cluster: waited {timeout:.0f}s for {num_nodes} nodes, {alive} alive"
                )
            time.sleep(0.5)

    @property
    def num_nodes(self) -> int:
        """How many nodes this cluster handle places on."""
        return self._num_nodes

    def nodes(self) -> list[NodeResources]:
        """Alive nodes, this process's node first, then by IP; indexes are what placement uses."""
        here = ray.get_runtime_context().get_node_id()
        alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
        alive.sort(key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
        return [
            NodeResources(
                index=i,
                node_id=n["NodeID"],
                node_ip=n["NodeManagerAddress"],
                num_cpus=float(n["Resources"].get("CPU", 0.0)),
                num_gpus=int(n["Resources"].get("GPU", 0)),
            )
            for i, n in enumerate(alive)
        ]

    def free_port(self, node: NodeResources) -> int:
        """A free TCP port on ``node`` (asked of the node itself when it is not this one)."""
        if node.node_id == ray.get_runtime_context().get_node_id():
            return free_local_port()
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return int(
            ray.get(_free_port_on_node.options(scheduling_strategy=strategy).remote(), timeout=60)
        )

    def shutdown(self) -> None:
        """Stop Ray if this handle started it (a joined cluster is left running)."""
        if self.started and ray.is_initialized():
            ray.shutdown()
            log.info("cluster stopped")
