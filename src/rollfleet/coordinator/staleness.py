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

:func:`admissible` and :func:`due` are pure; the coordinator applies them.
"""

from __future__ import annotations

from rollfleet.errors import InvalidInput

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


def admissible(k: int | None, trained: int, served: int, ahead: int) -> bool:
    """True when a train batch bounded by ``k`` may start now (``ahead`` batches before it)."""
    return k is None or trained + ahead - served <= k


def due(k: int | None, admitted_at: int | None, index: int) -> bool:
    """True when work admitted at version ``admitted_at`` must be consumed by finalize ``index``
    (the next one would make it staler than ``k``)."""
    return k is not None and admitted_at is not None and index + 1 - admitted_at > k


def staleness(index: int, admitted_at: int | None, fallback: int) -> int:
    """Staleness of work admitted at ``admitted_at`` consumed by finalize ``index``."""
    return fallback if admitted_at is None else max(0, index - admitted_at)
