"""What an attempt capability costs a gateway call, against the operator token it replaced.

Two pairs, alternating A B A B over ROUNDS rounds, medians with their range:
- the check alone: the gateway's caller check (:func:`rollfleet.web.capability.caller_check`) on
  the same request with the operator token (a constant-time compare) and with a capability (an
  HMAC-SHA256, a base64 and a JSON decode), µs per check;
- a whole call: ``GET /v1/models`` over HTTP on a local gateway, with either key, ms per call.
Target (issue 29): a capability check at most 0.1 ms. Run: ``python -m bench capability``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from starlette.requests import Request

from bench._common import median_range, table, write_results
from rollfleet.engines.gateway.app import running_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.web.capability import caller_check, mint

ROUNDS, CHECKS, CALLS = 7, 20_000, 300
TOKEN = "bench-operator-token"


def _request(key: str) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


async def checks(key: str) -> float:
    """µs per caller check of a request carrying ``key``."""
    check, request = caller_check(TOKEN), _request(key)
    started = time.perf_counter()
    for _ in range(CHECKS):
        await check(request)
    return (time.perf_counter() - started) / CHECKS * 1e6


async def calls(client: httpx.AsyncClient, key: str) -> float:
    """ms per ``GET /v1/models`` with ``key``."""
    headers = {"authorization": f"Bearer {key}"}
    started = time.perf_counter()
    for _ in range(CALLS):
        (await client.get("/v1/models", headers=headers)).raise_for_status()
    return (time.perf_counter() - started) / CALLS * 1e3


async def measure() -> dict[str, dict[str, list[float]]]:
    """Both pairs, rounds alternating token and capability."""
    capability = mint(TOKEN, "ro-" + "0" * 32, "at-" + "0" * 32)
    keys = {"token": TOKEN, "capability": capability}
    runs: dict[str, dict[str, list[float]]] = {
        "check_us": {k: [] for k in keys},
        "call_ms": {k: [] for k in keys},
    }
    gateway = Gateway()
    async with running_gateway(gateway, token=TOKEN) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            await calls(client, TOKEN)  # warm the connection and the routes
            for _ in range(ROUNDS):
                for name, key in keys.items():
                    runs["check_us"][name].append(await checks(key))
                    runs["call_ms"][name].append(await calls(client, key))
    await gateway.close()
    return runs


def main() -> dict[str, Any]:
    """Run both pairs and write bench/results/capability.json."""
    runs = asyncio.run(measure())
    figures: dict[str, Any] = {"rounds": ROUNDS, "checks": CHECKS, "calls": CALLS}
    rows = []
    for what, unit in (("check_us", "µs per check"), ("call_ms", "ms per GET /v1/models")):
        token, cap = (median_range(runs[what][k]) for k in ("token", "capability"))
        figures[what] = {
            "token": token,
            "capability": cap,
            "added": cap["median"] - token["median"],
        }
        rows.append(
            [
                unit,
                f"{token['median']:.3f} [{token['min']:.3f}-{token['max']:.3f}]",
                f"{cap['median']:.3f} [{cap['min']:.3f}-{cap['max']:.3f}]",
                f"{cap['median'] - token['median']:+.3f}",
            ]
        )
    table("attempt capability vs operator token", ["", "token", "capability", "added"], rows)
    return write_results("capability", figures, "python -m bench capability")


if __name__ == "__main__":
    main()
