"""``rollfleet run``'s engine room: start what is not given, enqueue, follow, write the outputs.

1. Check every task of the data file for the mode (InvalidInput naming file:line and field).
2. The store: the one given by ``--store`` (then only enqueue and follow), else an embedded
   control plane on ``OUTPUT/store.db``, which is what makes a re-run resume.
3. Enqueue with deterministic ids (existing ones are kept; stale attempts of a killed run
   are put back in the queue).
4. If anything is left: the LLM (``--engine URL``, else a llama.cpp engine and gateway here),
   then N runner processes (``LocalFleet``) with ``ctx.llm`` and ``ctx.env``; follow them with
   a progress bar.
5. Write ``trajectories.jsonl`` and ``summary.json`` from what the store holds.

The summary's ``startup_s`` says when each part was ready, in seconds since the command started:
what a user waits for before the first token.
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
from rollfleet.envs import EnvSpec, Mode, check_observation, get_mode, preflight_of, shares_process
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import AgentError, InvalidInput, RollfleetError
from rollfleet.model import ACTIVE_ROLLOUT, TERMINAL_ROLLOUT, Rollout, RolloutStatus
from rollfleet.run.outputs import claim_output_dir, summarize, trajectory, write_outputs
from rollfleet.run.progress import RunProgress
from rollfleet.run.tasks import build_specs, mode_label, run_key
from rollfleet.runner.local import LocalFleet
from rollfleet.server.embedded import ServerThread
from rollfleet.store.base import Store, read_all

log = logging.getLogger("rollfleet.run")
AGENT = "rollfleet.agents.loop:agent"
DEFAULT_ROLLOUTS = 8
POLL_S = 0.25


@dataclass(frozen=True)
class RunOptions:
    """Everything ``rollfleet run`` takes (the seed's flags and a few of rollfleet's own)."""

    mode: str
    data: Path
    num_rollouts: int = DEFAULT_ROLLOUTS
    num_vms: int = 3
    use_vm_pool: bool = False
    model: str | None = None
    engine: str | None = None
    max_turns: int = 100
    max_retries: int = 3
    samples_per_task: int = 1
    output_dir: Path = Path("results")
    max_tokens: int = 256
    temperature: float = 0.7
    limit: int | None = None
    store: str | None = None
    token: str | None = None
    llm_token: str | None = None
    desktop: dict[str, Any] = field(default_factory=dict)
    engine_per_runner: bool = False
    standin: bool = False
    unsafe_sandbox: bool = False
    engine_threads: int | None = None
    keep_quant: bool = False
    observation: str | None = None
    agent: str = AGENT  # module:function or file.py:function: the agent every rollout runs

    def check(self) -> None:
        """Refuse impossible numbers, and an agent that does not load, before anything starts."""
        from rollfleet.runner.agent import load_agent

        load_agent(self.agent)
        for name in ("num_rollouts", "num_vms", "max_turns", "samples_per_task", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInput(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.engine_threads is not None and not 1 <= self.engine_threads <= 1024:
            raise InvalidInput(f"--engine-threads must be 1 to 1024, got {self.engine_threads}")
        if self.mode == "osworld":
            from rollfleet.envs.osworld import desktop_options

            desktop_options(self.desktop)  # InvalidInput naming a bad --provider-name & co.
        check_observation(self.mode, self.observation)
        if self.max_retries < 0:
            raise InvalidInput(f"--max-retries must be 0 or more, got {self.max_retries}")
        if self.engine is None and self.model is not None:
            self._check_local_model(Path(self.model))
        if self.engine is not None and self.store is None and not self.llm_key():
            raise InvalidInput(
                f"--engine {self.engine}: no API key; set OPENAI_API_KEY or pass --llm-token "
                "(a server that checks no key takes any value, e.g. --llm-token none)"
            )

    def _check_local_model(self, path: Path) -> None:
        """A GGUF file for llama.cpp, or a transformers directory served by transformers here
        (not per runner process: those load llama.cpp)."""
        if path.is_dir():
            from rollfleet.train.policy import check_model

            check_model(path, "hf")
            if self.engine_per_runner:
                raise InvalidInput(
                    f"--model {path}: a transformers model directory is served by one engine "
                    "in this process; --engine-per-runner loads a GGUF in each runner"
                )
        elif not path.is_file():
            raise InvalidInput(
                f"--model {path}: neither a GGUF file for the llama.cpp engine nor a "
                "transformers model directory; to use a served model pass --engine URL "
                "(an OpenAI-compatible base URL) too"
            )

    def serves_directory(self) -> bool:
        """Whether the shared engine is transformers serving a ``--model`` directory."""
        return self.engine is None and self.model is not None and Path(self.model).is_dir()

    def llm_key(self) -> str | None:
        """The API key for ``--engine``: ``--llm-token``, else ``OPENAI_API_KEY``."""
        return self.llm_token or os.environ.get("OPENAI_API_KEY") or None

    def settings(self) -> dict[str, Any]:
        """The agent loop's settings, stored with every rollout."""
        model = self.model if self.engine else None
        return {
            "max_turns": self.max_turns,
            "max_retries": self.max_retries,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "model": model,
            **({"observation": self.observation} if self.observation else {}),
        }

    def desktop_settings(self) -> dict[str, Any]:
        """The OSWorld options; the accessibility tree is fetched only when it is shown."""
        if self.mode != "osworld":
            return self.desktop
        shown = "a11y_tree" in (self.observation or "screenshot")
        return {**self.desktop, "require_a11y_tree": shown}

    def load_mode(self) -> Mode:
        """The ``--mode`` (with ``--observation``): InvalidInput naming what is wrong."""
        return get_mode(self.mode, self.observation)

    def env_spec(self) -> EnvSpec:
        """The ``ctx.env`` runners give rollouts."""
        return EnvSpec(
            mode=self.mode,
            use_pool=self.use_vm_pool,
            num_instances=self.num_vms,
            desktop=self.desktop_settings(),
            standin=self.standin,
            sandbox={"isolation": "none"} if self.unsafe_sandbox else {},
        )


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


def preflight(opts: RunOptions) -> None:
    """Fail fast when the mode's environment cannot exist here (osworld without a hypervisor,
    py without bubblewrap, web screenshots without Chromium): the mode's own preflight."""
    preflight_of(opts.load_mode(), opts.env_spec(), local=opts.store is None)


async def run(opts: RunOptions, console: Console) -> dict[str, Any]:
    """Do the whole run; returns the summary (also written to OUTPUT/summary.json)."""
    startup = Startup()
    opts.check()
    tasks = load_tasks(opts.data, opts.load_mode(), opts.limit)
    preflight(opts)
    specs = build_specs(
        tasks,
        path=opts.data,
        mode=opts.mode,
        samples=opts.samples_per_task,
        settings=opts.settings(),
    )
    claim_output_dir(opts.output_dir, "run")
    async with control_plane_url(opts) as url:
        startup.mark("store")
        store = connect(url, token=opts.token)
        try:
            return await _run_on(store, url, opts, specs, console, startup)
        finally:
            await store.close()


@contextlib.asynccontextmanager
async def control_plane_url(
    opts: RunOptions, experience_dir: Path | None = None
) -> AsyncIterator[str]:
    """The store's URL: ``--store``, else an embedded control plane on OUTPUT/store.db."""
    if opts.store is not None:
        yield opts.store
        return
    parts = control_plane_parts(experience_dir=experience_dir)
    server = ServerThread(f"sqlite:///{opts.output_dir.resolve()}/store.db", parts=parts)
    await asyncio.to_thread(server.start)
    try:
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)


async def _run_on(
    store: Store, url: str, opts: RunOptions, specs: list[Any], console: Console, startup: Startup
) -> dict[str, Any]:
    ids = [s.rollout_id for s in specs]
    existing = await store.enqueue_many(specs)
    stale = [r.rollout_id for r in existing if r.status in ACTIVE_ROLLOUT]
    if stale and opts.store is None:  # attempts of a run that was killed: nobody holds them now
        await store.requeue(
            statuses=[RolloutStatus.PREPARING, RolloutStatus.RUNNING], rollout_ids=stale
        )
    kept = [r for r in existing if r.status in TERMINAL_ROLLOUT]
    console.print(
        f"{opts.mode}: {len(ids)} rollouts ({len(kept)} already finished) · store {url}",
        soft_wrap=True,
    )
    started, group = time.perf_counter(), run_key(opts.data, opts.mode)
    with RunProgress(console, len(ids), kept, f"{opts.mode} ×{opts.num_rollouts}") as progress:
        if len(kept) < len(ids):
            if opts.store is None:
                async with shared_llm(opts, store, console, startup) as llm:
                    fleet = runner_fleet(url, opts, llm)
                    await _follow(
                        store, set(ids), group, {r.rollout_id for r in kept}, progress, fleet
                    )
            else:
                await _follow(store, set(ids), group, {r.rollout_id for r in kept}, progress, None)
    wall = time.perf_counter() - started
    return await _write(store, opts, ids, {r.rollout_id for r in kept}, wall, startup)


@dataclass(frozen=True)
class RunnerLlm:
    """How runner processes reach the LLM: their options, and the API key (which travels in
    their environment, never on a command line: /proc/*/cmdline is world-readable)."""

    args: list[str]
    key: str | None = None
    gateway: Any = None  # the shared engine's gateway, in this process (weights go to it)


@contextlib.asynccontextmanager
async def shared_llm(
    opts: RunOptions,
    store: Store,
    console: Console,
    startup: Startup,
    engine: Any | None = None,
) -> AsyncIterator[RunnerLlm]:
    """Runner options giving ctx.llm: a URL given, an engine per runner, or one shared engine
    (``engine`` when given, not started: ``rollfleet train --engine hf``; transformers for a
    ``--model`` directory; else llama.cpp).

    A URL given gets the user's API key; the shared engine's gateway takes a secret made for
    this run, from which runners mint each attempt its capability. It records every call as an
    ``llm`` Step of its attempt (prompt and completion token ids included: what a trainer
    needs)."""
    if opts.engine is not None:
        yield RunnerLlm(["--llm-url", opts.engine], opts.llm_key())
        return
    if opts.engine_per_runner:
        yield RunnerLlm(["--own-engine"] + (["--model-path", opts.model] if opts.model else []))
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
    # a secret of this run's own: runners mint each attempt a capability from it, so an agent's
    # ctx.llm can record only to its own attempt (rollfleet.web.capability)
    secret = secrets.token_urlsafe(32)
    try:
        async with running_gateway(gateway, token=secret) as gateway_url:
            startup.mark("gateway")
            console.print(
                f"engine {_engine_label(engine)} ({engine.max_concurrency} slots) · "
                f"gateway {gateway_url}/v1",
                soft_wrap=True,
            )
            yield RunnerLlm(["--llm-url", gateway_url, "--llm-mint"], secret, gateway)
    finally:
        if getattr(engine, "first_token_at", None) is not None:
            startup.mark("first_token", engine.first_token_at)
        await gateway.close()


def _engine_label(engine: Any) -> str:
    """How the run's first line names the shared engine."""
    found = getattr(engine, "model_file", None)
    return f"llama.cpp {found}" if found else f"{engine.name} {getattr(engine, 'model', '')}"


def _recorder(store: Store) -> Any:
    async def record(rollout_id: str, attempt_id: str, step: Any) -> None:
        try:
            await store.add_steps(attempt_id, [step])
        except RollfleetError as exc:  # a fenced attempt: its steps are refused, as they must be
            log.info("llm step of %s not recorded: %s", rollout_id, exc)

    return record


def runner_fleet(url: str, opts: RunOptions, llm: RunnerLlm) -> LocalFleet:
    """One runner process running N rollouts at once (math, rag, or a shared pool's N rollouts
    over M instances); else N runner processes of one rollout each, so a rollout's environment
    (a sandbox, a desktop) and whatever it does to its process stay apart from the others."""
    mode = opts.load_mode()
    pooled = opts.use_vm_pool and bool(getattr(mode, "pools_instances", False))
    together = pooled or (shares_process(mode) and not opts.engine_per_runner)
    n, concurrency = (1, opts.num_rollouts) if together else (opts.num_rollouts, 1)
    extra = llm.args + ["--env-spec", opts.env_spec().model_dump_json(), "--exit-with-parent"]
    return LocalFleet(
        url,
        opts.agent,
        n=n,
        concurrency=concurrency,
        prefix=f"run-{mode_label(opts.mode)}",
        grace_s=5.0,
        extra_args=extra,
        token=opts.token,
        llm_token=llm.key,
    )


async def _terminal(store: Store, group: str) -> list[Rollout]:
    return await read_all(
        lambda cursor: store.query_rollouts(
            status=list(TERMINAL_ROLLOUT), group_id=group, cursor=cursor, limit=500
        )
    )


async def _follow(
    store: Store,
    ids: set[str],
    group: str,
    seen: set[str],
    progress: RunProgress,
    fleet: LocalFleet | None,
) -> None:
    """Show rollouts as they finish until all of ``ids`` (in ``group``) are terminal."""
    running = asyncio.create_task(fleet.run()) if fleet is not None else None
    seen = set(seen)
    try:
        while len(seen) < len(ids):
            for rollout in await _terminal(store, group):
                if rollout.rollout_id in ids and rollout.rollout_id not in seen:
                    seen.add(rollout.rollout_id)
                    progress.finished(rollout)
            if fleet is not None and fleet.agent_error:
                raise AgentError(f"runners could not start the agent: {fleet.agent_error}")
            if running is not None and running.done():
                raise RollfleetError("the runner processes stopped before the run finished")
            if len(seen) < len(ids):
                await asyncio.sleep(POLL_S)
    finally:
        if fleet is not None and running is not None:
            fleet.stop()
            if len(seen) == len(ids):  # nothing left to claim: end the runners' long-polls now
                fleet.stop()  # (a drain would let each finish: up to 2 s at every run's end)
            await running


async def _steps(store: Store, rollout: Rollout) -> list[Any]:
    attempt = rollout.attempt.attempt_id if rollout.attempt else None
    return await read_all(
        lambda cursor: store.query_steps(
            rollout.rollout_id, attempt_id=attempt, cursor=cursor, limit=500
        )
    )


async def _write(
    store: Store, opts: RunOptions, ids: list[str], kept: set[str], wall: float, startup: Startup
) -> dict[str, Any]:
    records = []
    for rollout_id in ids:
        rollout = await store.get_rollout(rollout_id)
        if rollout.terminal:
            records.append(trajectory(rollout, await _steps(store, rollout)))
    now = [r for r in records if r["rollout_id"] not in kept]
    summary = summarize(
        records,
        samples=opts.samples_per_task,
        wall_s=wall,
        ran_now=len(now),
        completion_tokens_now=sum(r["tokens"]["completion"] for r in now),
        extra={
            "mode": opts.mode,
            "data": str(opts.data),
            "group_id": run_key(opts.data, opts.mode),
            "num_rollouts": opts.num_rollouts,
            "expected": len(ids),
            "startup_s": startup.ready,
        },
    )
    write_outputs(opts.output_dir, records, summary)
    return summary
