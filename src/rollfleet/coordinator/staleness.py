"""Staleness control: how far ahead of the trainer the fleet may generate (``max_staleness`` k).

Versions are counted in train finalizes: the finalize with index ``c`` hands its samples to the
trainer step that starts from policy version ``c``. A sample's staleness is ``c`` minus the
version of the weights that made its oldest token. Engines lag the trainer: they serve version
``served`` <= ``trained`` (the number of train finalizes so far) until the trainer pushes. The
trainer reports ``served`` (``set_policy_version``) before its first bounded batch and after each
push: a bound on a guess would be no bound, so a bounded batch without a report is refused.

The rules below keep every consumed sample within k and throw no finished sample away:

- **Admission.** A train batch admitted now starts no token before version ``served``; it is
  consumed at ``trained + ahead``, where ``ahead`` counts the train batches admitted and not yet
  finalized (finalized in admission order). So it is admitted only while
  ``trained + ahead - served <= k``; otherwise it is held, its rollouts not enqueued, until a
  finalize or a weights push makes room (the fleet waits; nothing it made is discarded).
- **Order.** A finalize that would leave a bounded batch due (see below) unconsumed is refused:
  finalize that batch first. Finalizing in admission order never hits this.
- **Stragglers.** A group left running by one finalize (``carry_over``) joins a later one; it is
  *due* at the last finalize that keeps it within k, and that finalize waits for it.

:func:`admissible`, :func:`due` and the helpers below are pure; the coordinator applies them
(admission in :mod:`.admission`, the commit in :mod:`.commit`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from rollfleet.coordinator.state import BatchLifecycleState, BatchState, BatchType, Carried
from rollfleet.errors import Conflict, InvalidInput

S = BatchLifecycleState

MAX_STALENESS_BOUND = 1000  # train steps: a larger bound is no bound


def check_max_staleness(value: int | None) -> int | None:
    """``value`` if it is a valid bound (None: unbounded); InvalidInput naming it otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"max_staleness must be an integer, got {value!r}")
    if not 0 <= value <= MAX_STALENESS_BOUND:
        raise InvalidInput(
            f"max_staleness must be between 0 and {MAX_STALENESS_BOUND}, got {value}"
        )
    return value


def batch_bound(
    batch_type: BatchType, given: int | None, default: int | None, served: int | None
) -> int | None:
    """The max_staleness a new batch runs under: ``given``, else the coordinator's ``default``,
    for a train batch; None for an eval one. InvalidInput for an eval batch given a bound or a
    bad bound; Conflict for a bound while the trainer has reported no policy version (``served``
    None): a bound on a guess would be no bound."""
    if batch_type == "eval" and given is not None:
        raise InvalidInput("submit_batch: max_staleness bounds train batches, not eval ones")
    bound = default if given is None else given
    bound = check_max_staleness(bound) if batch_type == "train" else None
    if bound is not None and served is None:
        raise Conflict(
            "submit_batch: max_staleness needs the policy version the engines serve: call "
            "set_policy_version(v) before the first batch, and after each weights push"
        )
    return bound


def admissible(k: int | None, trained: int, served: int, ahead: int) -> bool:
    """True when a train batch bounded by ``k`` may start now (``ahead`` batches before it)."""
    return k is None or trained + ahead - served <= k


def due(k: int | None, admitted_at: int | None, index: int) -> bool:
    """True when work admitted at version ``admitted_at`` must be consumed by finalize ``index``
    (the next one would make it staler than ``k``)."""
    return k is not None and admitted_at is not None and index + 1 - admitted_at > k


def due_rollouts(pool: Iterable[Carried], index: int) -> list[str]:
    """The rollouts of the carried groups that finalize ``index`` must consume."""
    return [r for c in pool if due(c.max_staleness, c.admitted_at, index) for r in c.rollout_ids]


def staleness(index: int, admitted_at: int | None, fallback: int) -> int:
    """Staleness of work admitted at ``admitted_at`` consumed by finalize ``index``."""
    return fallback if admitted_at is None else max(0, index - admitted_at)


def consumed(
    batch: BatchState, stragglers: Collection[str], ready: Iterable[Carried], index: int
) -> dict[str, int]:
    """What finalize ``index`` consumes, rollout id → staleness: the groups of ``batch`` but its
    ``stragglers``, then the carried groups ``ready`` (wholly finished now)."""
    own = staleness(index, batch.admitted_at, 0)
    included = {r: own for g, ids in batch.groups().items() if g not in stragglers for r in ids}
    for c in ready:
        late = staleness(index, c.admitted_at, index - c.origin_index)
        included.update({r: late for r in c.rollout_ids})
    return included


def in_flight(batches: Iterable[BatchState]) -> list[BatchState]:
    """Train batches admitted and not finalized yet, in admission order."""
    live = (S.RUNNING, S.FINALIZING)
    found = [b for b in batches if b.batch_type == "train" and b.state in live]
    return sorted(found, key=lambda b: b.created_at)


def held_back(batches: Iterable[BatchState]) -> list[BatchState]:
    """Batches held back by max_staleness, oldest first."""
    found = [b for b in batches if b.state is S.PENDING and b.held]
    return sorted(found, key=lambda b: b.created_at)


def check_order(batch: BatchState, batches: Iterable[BatchState], index: int) -> None:
    """Conflict for finalize ``index`` going to ``batch`` when it is held back, or when another
    batch would then be consumed staler than its max_staleness."""
    if batch.state is S.PENDING and batch.held:
        raise Conflict(
            f"batch {batch.batch_id} is held back by max_staleness {batch.max_staleness}: "
            "finalize the train batches before it (or push weights and set the policy "
            "version) first"
        )
    if batch.batch_type != "train" or batch.state is not S.RUNNING:
        return
    for other in in_flight(batches):
        if other is not batch and due(other.max_staleness, other.admitted_at, index):
            raise Conflict(
                f"finalize batch {other.batch_id} first: it must be consumed now to stay "
                f"within its max_staleness {other.max_staleness}"
            )
