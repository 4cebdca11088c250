"""The local stack: a control plane (an embedded one on a SQLite file, or one given by URL), the
shared engine behind a recording gateway, and a fleet of runner processes. ``rollfleet run``,
``rollfleet train``, ``rollfleet demo`` and the tests build it with :func:`local_stack`, and
it stops in the reverse order: runners first, then the engine, then the control plane.

The runners' LLM, by what the options ask: a URL given (the user's API key travels in the runners'
environment), an engine per runner process, or one shared engine here (transformers for a model
directory, else llama.cpp on the bundled model), behind a gateway that takes a secret made for
this stack, from which runners mint each attempt a capability (rollfleet.web.capability), and
that records every call as an ``llm`` Step of its attempt (prompt and completion token ids
included: what a trainer needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rollfleet.client import connect
from rollfleet.compose import control_plane_parts
from rollfleet.envs import Mode, shares_process
from rollfleet.errors import AgentError, RollfleetError
from rollfleet.model import RolloutStatus
from rollfleet.run.options import RunOptions
from rollfleet.runner.local import LocalFleet
from rollfleet.runner.spec import LlmAccess
from rollfleet.server.embedded import ServerThread
from rollfleet.store.base import Store

log = logging.getLogger("rollfleet.run")


def process_age_s() -> float:
    """Seconds since this process started (0.0 where /proc is missing)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Startup:
    """When each part of a run was ready, in seconds since the command started."""

    def __init__(self) -> None:
        """Start the clock at the process's start."""
        self.origin = time.monotonic() - process_age_s()
        self.ready: dict[str, float] = {}

    def mark(self, part: str, at: float | None = None) -> None:
        """``part`` is ready now (or at the monotonic time ``at``)."""
        self.ready[part] = round((time.monotonic() if at is None else at) - self.origin, 3)


def engine_threads(mode: Mode) -> int:
    """llama.cpp threads for the embedded engine: every core when the mode's rollouts share one
    runner process, their environment costing no CPU here (math, rag, lookup: the runners mostly
    wait on the engine), all but one when it runs programs on this machine (py's sandbox, web,
    osworld).

    ggml's threads spin-wait for each other, so a thread per core beside busy processes is many
    times slower (0.6 s → 42 s for one reply on 2 busy cores). On an idle one, the demo (math, 4
    runners, 2 cores) ran 30.6 s with 2 threads against 45.0 s with 1 (bench/run.py).
    """
    cores = len(os.sched_getaffinity(0))
    return cores if shares_process(mode) or cores == 1 else cores - 1


@dataclass(frozen=True)
class RunnerLlm:
    """How runner processes reach the LLM, and its API key (which travels in their environment,
    never on a command line: /proc/*/cmdline is world-readable)."""

    access: LlmAccess
    key: str | None = None
    gateway: Any = None  # the shared engine's gateway, in this process (weights go to it)


@dataclass
class LocalStack:
    """The stack, up: the control plane's URL and a client for it; the shared LLM and the
    runners once started (:meth:`serve_llm`, :meth:`start_runners`)."""

    url: str
    store: Store
    startup: Startup
    _exits: contextlib.AsyncExitStack
    llm: RunnerLlm | None = None
    fleet: LocalFleet | None = None
    runners: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def gateway(self) -> Any:
        """The shared engine's gateway in this process (None without one)."""
        return None if self.llm is None else self.llm.gateway

    async def serve_llm(
        self, opts: RunOptions, console: Console, engine: Any | None = None
    ) -> RunnerLlm:
        """Give runners ``ctx.llm`` as ``opts`` ask (``engine``: one to share, not started);
        it stops with the stack."""
        self.llm = await self._exits.enter_async_context(
            _shared_llm(opts, self.store, console, self.startup, engine)
        )
        return self.llm

    def start_runners(self, fleet: LocalFleet) -> None:
        """Run ``fleet`` until :meth:`stop_runners` or the stack's end."""
        self.fleet = fleet
        self.runners = asyncio.create_task(fleet.run())
        self._exits.push_async_callback(self.stop_runners, False)

    def runners_failed(self) -> RollfleetError | None:
        """Why the runners cannot go on (an agent that does not start, a fleet that ended)."""
        if self.fleet is not None and self.fleet.agent_error:
            return AgentError(f"runners could not start the agent: {self.fleet.agent_error}")
        if self.runners is not None and self.runners.done():
            return RollfleetError("the runner processes stopped before the run finished")
        return None

    async def stop_runners(self, drain: bool = True) -> None:
        """Stop the runners and wait for them: ``drain`` lets running rollouts finish; without
        it they go back to the queue now (and long-polls end at once)."""
        if self.fleet is None or self.runners is None:
            return
        if not self.runners.done():
            self.fleet.stop(drain=drain)
        runners, self.runners = self.runners, None
        await runners


@contextlib.asynccontextmanager
async def local_stack(
    db: Path | None,
    *,
    url: str | None = None,
    token: str | None = None,
    experience_dir: Path | None = None,
    startup: Startup | None = None,
) -> AsyncIterator[LocalStack]:
    """The control plane at ``url``, else an embedded one on the SQLite file ``db`` (whose
    attempts cut short by a killed run go back to the queue: nobody holds them now); yields the
    stack, and stops whatever was started on it."""
    startup = startup or Startup()
    async with contextlib.AsyncExitStack() as exits:
        if url is None:
            if db is None:
                raise ValueError("local_stack needs a store URL or a SQLite file")
            server = await asyncio.to_thread(_embedded_control_plane, db, experience_dir)
            exits.push_async_callback(asyncio.to_thread, server.stop)
            url = server.url
        store = connect(url, token=token)
        exits.push_async_callback(store.close)
        startup.mark("store")
        if db is not None:
            await store.requeue(statuses=[RolloutStatus.PREPARING, RolloutStatus.RUNNING])
        yield LocalStack(url, store, startup, exits)


def _embedded_control_plane(db: Path, experience_dir: Path | None) -> ServerThread:
    """The whole control plane of ``rollfleet serve`` on the SQLite file ``db``, started."""
    parts = control_plane_parts(experience_dir=experience_dir)
    return ServerThread(f"sqlite:///{db.resolve()}", parts=parts).start()


@contextlib.asynccontextmanager
async def _shared_llm(
    opts: RunOptions,
    store: Store,
    console: Console,
    startup: Startup,
    engine: Any | None = None,
) -> AsyncIterator[RunnerLlm]:
    """ctx.llm for the runners: a URL given, an engine per runner, or one shared engine
    (``engine`` when given, not started: ``rollfleet train --engine hf``; transformers for a
    ``--model`` directory; else llama.cpp)."""
    if opts.engine is not None:
        yield RunnerLlm(LlmAccess(url=opts.engine), opts.llm_key())
        return
    if opts.engine_per_runner:
        yield RunnerLlm(LlmAccess(own_engine=True, model_path=opts.model))
        return
    from rollfleet.engines.gateway.app import running_gateway
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    if engine is None and opts.serves_directory():
        from rollfleet.engines.hf.engine import HFEngine

        engine = HFEngine(opts.model, max_batch=min(64, max(2, opts.num_rollouts)))
    if engine is None:
        engine = LlamaCppEngine(
            opts.model,
            slots=max(2, opts.num_rollouts),
            threads=opts.engine_threads or engine_threads(opts.load_mode()),
            batch_quant=not opts.keep_quant,
        )
    await engine.start()
    startup.mark("engine")
    gateway = Gateway(_recorder(store))
    gateway.add_replica(engine)
    secret = secrets.token_urlsafe(32)  # this stack's own: runners mint capabilities from it
    try:
        async with running_gateway(gateway, token=secret) as gateway_url:
            startup.mark("gateway")
            console.print(
                f"engine {_engine_label(engine)} ({engine.max_concurrency} slots) · "
                f"gateway {gateway_url}/v1",
                soft_wrap=True,
            )
            yield RunnerLlm(LlmAccess(url=gateway_url, mint=True), secret, gateway)
    finally:
        if getattr(engine, "first_token_at", None) is not None:
            startup.mark("first_token", engine.first_token_at)
        await gateway.close()


def _engine_label(engine: Any) -> str:
    """How the stack's first line names the shared engine."""
    found = getattr(engine, "model_file", None)
    return f"llama.cpp {found}" if found else f"{engine.name} {getattr(engine, 'model', '')}"


def _recorder(store: Store) -> Any:
    async def record(rollout_id: str, attempt_id: str, step: Any) -> None:
        try:
            await store.add_steps(attempt_id, [step])
        except RollfleetError as exc:  # a fenced attempt: its steps are refused, as they must be
            log.info("llm step of %s not recorded: %s", rollout_id, exc)

    return record
