"""What a rank of a group is, below the ``Worker`` class: this process's current worker, the Ray
actor class built for a worker class, and the methods a group exposes.

It imports nothing of the cluster package's higher modules, so ``waiting`` (which names the caller
in its errors) and ``group`` (which builds the actors) need not import ``worker``, which imports
them: the package has no import cycle.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any

from rollfleet.cluster.address import WorkerInfo

_current: Any = None


def current_worker() -> Any:
    """The worker running in this process, or None in a driver."""
    return _current


def install(worker: Any, info: WorkerInfo) -> None:
    """Make ``worker`` this process's current worker and export its torch.distributed env."""
    global _current
    info = with_reserved_gpus(info)
    os.environ.update(info.env())
    worker._rf_info = info
    _current = worker


def with_reserved_gpus(info: WorkerInfo) -> WorkerInfo:
    """``info`` with the GPUs Ray reserved for this actor, when it reserved any.

    Ray picks which of a node's GPUs an actor that asks for ``num_gpus`` gets (and sets
    CUDA_VISIBLE_DEVICES to them); the plan only decides the node and how many.
    """
    import ray

    if not ray.is_initialized():
        return info
    reserved = tuple(int(g) for g in ray.get_gpu_ids())
    if not reserved:
        return info
    return replace(info, gpu_id=reserved[0], available_gpus=reserved)


@functools.cache
def actor_class(user_cls: type[Any]) -> Any:
    """The Ray actor class for ``user_cls``: installs the rank's info before the user's __init__."""
    import ray

    def __init__(self: Any, rf_info: WorkerInfo, *args: Any, **kwargs: Any) -> None:
        install(self, rf_info)
        try:
            user_cls.__init__(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - kept for _rf_ping, which the launcher awaits
            self._rf_init_error = exc

    rank_cls = type(user_cls.__name__, (user_cls,), {"__init__": __init__})
    rank_cls.__qualname__ = f"{user_cls.__qualname__}[rank]"
    return ray.remote(rank_cls)


def is_worker_class(cls: Any) -> bool:
    """Whether ``cls`` is a ``Worker`` subclass (the base marks itself with ``_rf_base``)."""
    return isinstance(cls, type) and any(vars(k).get("_rf_base") for k in cls.__mro__)


def group_methods(user_cls: type[Any]) -> frozenset[str]:
    """The public methods a group of ``user_cls`` exposes (the subclass's, not the base's)."""
    names: set[str] = set()
    for klass in user_cls.__mro__:
        if klass is object or vars(klass).get("_rf_base"):
            continue
        names.update(
            n
            for n, v in vars(klass).items()
            if not n.startswith("_")
            and callable(v)
            and not isinstance(v, (classmethod, staticmethod, property))
        )
    return frozenset(names)
