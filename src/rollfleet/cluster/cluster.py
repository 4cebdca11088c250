"""``Cluster``: start or join Ray and describe its nodes for placement."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollfleet.cluster.address import WorkerAddress, WorkerInfo
from rollfleet.cluster.placement import NodeResources
from rollfleet.errors import ClusterError, ClusterTimeout, InvalidInput

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


def alive_nodes() -> list[NodeResources]:
    """Alive Ray nodes, this process's node first, then by IP and id."""
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


def find_node(node: int | str) -> NodeResources:
    """The alive node with index ``node`` in :func:`alive_nodes`, or with Ray id ``node``."""
    nodes = alive_nodes()
    if isinstance(node, int):
        if not 0 <= node < len(nodes):
            raise InvalidInput(f"node {node}: the cluster has {len(nodes)} alive node(s)")
        return nodes[node]
    for found in nodes:
        if found.node_id == node:
            return found
    raise ClusterError(f"node {node}: no alive node has that Ray id")


def free_gpus() -> dict[str, float]:
    """GPUs not reserved by any actor or task, per alive Ray node id (empty if Ray cannot say)."""
    try:
        from ray._private.state import available_resources_per_node
    except ImportError:  # pragma: no cover - a Ray without the per-node view
        return {}
    per_node = available_resources_per_node()  # type: ignore[no-untyped-call]
    return {node_id: float(r.get("GPU", 0.0)) for node_id, r in per_node.items()}


def pinned_options(
    name: str, node_id: str, *, num_cpus: float, num_gpus: float, **extra: Any
) -> dict[str, Any]:
    """Ray actor options: the actor ``name`` in rollfleet's namespace, on ``node_id`` only,
    reserving ``num_cpus`` and ``num_gpus`` from Ray."""
    return {
        "name": name,
        "namespace": NAMESPACE,
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        **extra,
    }


def _info_from_env(name: str, node: NodeResources, env: dict[str, str]) -> WorkerInfo:
    """The WorkerInfo of a worker started by ``allocate``: RLinf's environment variables."""
    gpus = tuple(int(g) for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip())
    return WorkerInfo(
        address=WorkerAddress.parse(name),
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        node_id=node.node_id,
        node_ip=node.node_ip,
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        gpu_id=gpus[0] if gpus else None,
        available_gpus=gpus,
        master_addr=env.get("MASTER_ADDR", node.node_ip),
        master_port=int(env.get("MASTER_PORT", 0)),
    )


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
        return alive_nodes()

    def node(self, node: int | str) -> NodeResources:
        """An alive node by index (as ``nodes()`` numbers them, RLinf's node rank) or Ray id."""
        return find_node(node)

    def free_port(self, node: NodeResources) -> int:
        """A free TCP port on ``node`` (asked of the node itself when it is not this one)."""
        if node.node_id == ray.get_runtime_context().get_node_id():
            return free_local_port()
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return int(
            ray.get(_free_port_on_node.options(scheduling_strategy=strategy).remote(), timeout=60)
        )

    def allocate(
        self,
        cls: type[Any],
        worker_name: str,
        node_id: int | str,
        max_concurrency: int | None = None,
        env_vars: dict[str, str] | None = None,
        cls_args: Sequence[Any] = (),
        cls_kwargs: dict[str, Any] | None = None,
        *,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
        max_restarts: int = 0,
    ) -> Any:
        """Start ``cls`` as the named actor ``worker_name`` on node ``node_id`` (RLinf's spelling).

        ``node_id`` is a node index or a Ray node id; ``env_vars`` are set in the actor's process.
        A ``Worker`` subclass gets a WorkerInfo built from its name, the node and ``env_vars``.
        Returns the Ray actor handle.
        """
        from rollfleet.cluster.rank import actor_class, is_worker_class

        node = self.node(node_id)
        env = dict(env_vars or {})
        args: tuple[Any, ...] = tuple(cls_args)
        remote: Any
        if is_worker_class(cls):
            remote = actor_class(cls)  # type: ignore[arg-type]
            args = (_info_from_env(worker_name, node, env), *args)
        else:
            remote = cls if hasattr(cls, "remote") else ray.remote(cls)
        options = pinned_options(
            worker_name,
            node.node_id,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
        )
        if env:
            options["runtime_env"] = {"env_vars": env}
        if max_concurrency is not None:
            options["max_concurrency"] = max_concurrency
        return remote.options(**options).remote(*args, **(cls_kwargs or {}))

    def shutdown(self) -> None:
        """Stop Ray if this handle started it (a joined cluster is left running)."""
        if self.started and ray.is_initialized():
            ray.shutdown()
            log.info("cluster stopped")
