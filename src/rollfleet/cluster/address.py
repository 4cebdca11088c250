"""Hierarchical worker addresses (``root:rank:rank…``) and the per-rank ``WorkerInfo`` record."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollfleet.errors import InvalidInput

SEPARATOR = ":"


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Where a worker sits: the root group's name plus the rank path down to it.

    ``WorkerAddress("Trainer", (1,))`` is rank 1 of group ``Trainer`` (``"Trainer:1"``); a group
    that rank launched has ranks ``"Trainer:1:0"``, ``"Trainer:1:1"``, …
    """

    root: str
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.root or SEPARATOR in self.root:
            raise InvalidInput(f"group name {self.root!r} must be non-empty and contain no ':'")
        if any(rank < 0 for rank in self.ranks):
            raise InvalidInput(f"ranks in address {self.get_name()!r} must be >= 0")

    @classmethod
    def parse(cls, name: str) -> WorkerAddress:
        """Parse ``"root:0:1"`` back into an address; raises InvalidInput naming the bad part."""
        root, *parts = name.split(SEPARATOR)
        try:
            ranks = tuple(int(part) for part in parts)
        except ValueError as exc:
            raise InvalidInput(f"worker address {name!r}: ranks must be integers") from exc
        return cls(root, ranks)

    @classmethod
    def from_name(cls, name: str) -> WorkerAddress:
        """Alias of :meth:`parse` (RLinf's spelling)."""
        return cls.parse(name)

    def get_name(self) -> str:
        """The address as a string, e.g. ``"Trainer:1:0"``."""
        return SEPARATOR.join((self.root, *map(str, self.ranks)))

    @property
    def rank(self) -> int:
        """This worker's rank inside its own group (the last rank of the path)."""
        if not self.ranks:
            raise InvalidInput(f"address {self.root!r} names a group, not a rank")
        return self.ranks[-1]

    @property
    def group_name(self) -> str:
        """The name of the group this worker belongs to (the address without its last rank)."""
        return self.get_parent_address().get_name()

    def get_parent_rank(self) -> int:
        """The rank of the worker that launched this one's group (-1 for a root group's rank)."""
        return self.ranks[-2] if len(self.ranks) >= 2 else -1

    def get_parent_address(self) -> WorkerAddress:
        """The address one level up (the group for a rank, the launching worker for a child
        group)."""
        if not self.ranks:
            raise InvalidInput(f"address {self.root!r} is a root and has no parent")
        return WorkerAddress(self.root, self.ranks[:-1])

    def get_child_address(self, rank: int) -> WorkerAddress:
        """The address of ``rank`` one level below this one."""
        return WorkerAddress(self.root, (*self.ranks, rank))

    def __str__(self) -> str:
        return self.get_name()


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker knows about itself at run time."""

    address: WorkerAddress
    rank: int
    world_size: int
    node_id: str
    node_ip: str
    local_rank: int = 0
    local_world_size: int = 1
    gpu_id: int | None = None
    available_gpus: tuple[int, ...] = field(default=())
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def env(self) -> dict[str, str]:
        """The torch.distributed-style environment variables for this rank."""
        env = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "ROLLFLEET_WORKER_ADDRESS": self.address.get_name(),
        }
        if self.available_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.available_gpus))
        return env
