"""Turns fleet events into one line per worker start and per rollout, plus a live summary."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.text import Text

from rollfleet.model import Statistics

MAX_LINES_PER_S = 20


class FleetView:
    """Prints fleet events the way seed 000's users expect, throttled when rollouts fly by."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._window_start = time.monotonic()
        self._lines = 0
        self._suppressed = 0

    def _budget(self) -> bool:
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            if self._suppressed:
                self.console.print(
                    f"[dim]… {self._suppressed} more rollout lines in the last second[/]"
                )
            self._window_start, self._lines, self._suppressed = now, 0, 0
        if self._lines >= MAX_LINES_PER_S:
            self._suppressed += 1
            return False
        self._lines += 1
        return True

    def event(self, event: dict[str, Any]) -> None:
        """Print one event line."""
        kind, worker = event.get("event"), event.get("worker_id", "?")
        if kind == "worker_started":
            self.console.print(f"[bold]▶ Starting {worker}[/]")
        elif kind == "worker_stopped":
            self.console.print(f"■ {worker} stopped")
        elif kind == "worker_crashed":
            self.console.print(
                f"[red]✗ {worker} exited with code {event.get('exit_code')}; "
                f"restarting in {event.get('restart_in_s', 0):.1f}s[/] ({event.get('reason', '')})"
            )
        elif kind == "agent_error":
            self.console.print(f"[red]✗ agent cannot start: {event.get('error')}[/]")
        elif kind == "rollout_started" and self._budget():
            self.console.print(
                Text(
                    f"✅ {worker} processing rollout: {event.get('rollout_id')} | "
                    f"Input: {str(event.get('input'))[:80]}"
                )
            )
        elif kind == "rollout_finished" and self._budget():
            status = event.get("status", "?")
            colour = "green" if status == "succeeded" else "red"
            reward = event.get("reward")
            tail = f" reward={reward:.3f}" if isinstance(reward, (int, float)) else ""
            self.console.print(
                f"[{colour}]  {worker} finished {event.get('rollout_id')}: {status}{tail}[/]"
            )


def summary_line(stats: Statistics, started: float) -> str:
    """One line: counts by status, rate and reward."""
    done = stats.rollouts["succeeded"] + stats.rollouts["failed"] + stats.rollouts["cancelled"]
    rate = done / max(1e-9, time.monotonic() - started)
    parts = [f"{k}={v}" for k, v in stats.rollouts.items() if v]
    reward = "" if stats.reward_mean is None else f" · reward {stats.reward_mean:.3f}"
    busy = stats.workers.get("busy", 0)
    return f"{' '.join(parts) or 'no rollouts'} · {rate:.1f}/s · workers busy {busy}{reward}"
