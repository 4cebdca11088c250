"""Property-based fuzzing (schemathesis) of every documented operation of the three servers.

The control plane (store API, batches, dashboard extras), the engines gateway (echo engine) and the
pool service each run for real on 127.0.0.1; schemathesis generates requests from their
``/openapi.json`` and checks every answer: no server error, a status the schema documents, the
documented content type and body shape. Bounded: a fixed number of examples per operation,
derandomized (the same requests on every run), long polls clamped to a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from rollfleet.compose import control_plane_parts  # noqa: E402
from rollfleet.server.embedded import ServerThread  # noqa: E402

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 30  # per operation
WAITS = ("wait_s", "timeout", "wait_after_min")  # seconds a caller may make the server wait


def clamp_waits(case: Any) -> None:
    """A long poll of up to 300 s is legal; the fuzzer need not sit through it."""
    if isinstance(case.body, dict):
        for key in WAITS:
            if isinstance(case.body.get(key), (int, float)) and case.body[key] > 0.05:
                case.body[key] = 0.05


def fuzz(url: str) -> list[str]:
    """Run every operation of the server at ``url``; the failures, as text."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            clamp_waits(case)
            case.call_and_validate(base_url=url, checks=CHECKS, timeout=30)

        try:
            run()
        except Exception as exc:  # collect all, so one run shows every broken operation
            failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:1500]}")
    return failures


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[str]:
    with ServerThread(f"sqlite:///{tmp_path}/fuzz.db", parts=control_plane_parts()) as srv:
        yield srv.url


@pytest.mark.timeout(600)
def test_fuzz_the_control_plane(control_plane: str) -> None:
    failures = fuzz(control_plane)
    assert not failures, "\n\n".join(failures)


@pytest.mark.timeout(600)
def test_fuzz_the_gateway() -> None:
    import asyncio
    import threading

    from rollfleet.engines.echo import EchoEngine
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway

    ready: dict[str, Any] = {}
    done = threading.Event()

    async def serve() -> None:
        gateway = Gateway()
        gateway.add_replica(EchoEngine())
        async with running_gateway(gateway) as url:
            ready["url"] = url
            started.set()
            await asyncio.to_thread(done.wait)
        await gateway.close()

    started = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(60)
    try:
        failures = fuzz(ready["url"])
    finally:
        done.set()
        thread.join(60)
    assert not failures, "\n\n".join(failures)


@pytest.mark.timeout(600)
def test_fuzz_the_pool_service(tmp_path: Path) -> None:
    import uvicorn
    from support import free_port

    from rollfleet.pool import load_registry, pool_app

    config = tmp_path / "pools.toml"
    config.write_text(
        '[pools.mem]\nprovider = "command"\nsize = 2\n[pools.mem.options]\nstart = "true"\nreset = "true"\n'
    )
    app = pool_app(load_registry(config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    import threading

    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        import time

        import httpx

        deadline = time.monotonic() + 60
        while True:  # observing another thread's server start: polling, bounded
            try:
                if httpx.get(f"http://127.0.0.1:{port}/pools", timeout=2).status_code < 500:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the pool service did not start"
            time.sleep(0.05)
        failures = fuzz(f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(60)
    assert not failures, "\n\n".join(failures)
