"""Shared benchmark plumbing: results files, machine info, subprocess servers, free ports."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
console = Console()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name: str, figures: dict[str, Any], command: str) -> dict[str, Any]:
    """Write bench/results/<name>.json and return what was written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "command": command, "machine": machine(), **figures}
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return doc


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Wait until ``url`` answers 200, or fail if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def start(argv: list[str], health: str) -> subprocess.Popen[bytes]:
    """Start a server process and wait for its health URL."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(health, proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def peers_available(module: str) -> bool:
    """True when the peers' venv has ``module``."""
    if not PEERS_PY.exists():
        return False
    return (
        subprocess.run([str(PEERS_PY), "-c", f"import {module}"], capture_output=True).returncode
        == 0
    )


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a rich table."""
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[f"{v:,.1f}" if isinstance(v, float) else str(v) for v in r])
    console.print(t)


PY = sys.executable


def median_range(values: list[float]) -> dict[str, float]:
    """A figure over the rounds: its median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
