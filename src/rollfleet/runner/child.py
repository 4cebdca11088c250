"""One runner process: ``python -m rollfleet.runner.child --store URL --agent REF …``.

Prints one JSON line per lifecycle event on stdout (the launcher turns them into output);
SIGTERM/SIGINT drains, a second signal releases everything at once.

Optional: ``--llm-url`` gives every rollout ``ctx.llm`` (an OpenAI client tagged with its
rollout and attempt); ``--own-engine`` instead starts a private llama.cpp engine in this
process (the seed's one-engine-per-process design, for comparisons); ``--env-spec JSON``
(an :class:`rollfleet.envs.EnvSpec`) gives ``ctx.env``; ``--exit-with-parent`` stops the
runner when the process that started it dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollfleet.client import connect
from rollfleet.errors import AgentError, RollfleetError
from rollfleet.model import Rollout
from rollfleet.runner.runner import Runner


def emit(event: str, **fields: Any) -> None:
    """Write one event as a JSON line for the launcher."""
    sys.stdout.write(json.dumps({"event": event, **fields}, default=str) + "\n")
    sys.stdout.flush()


def llm_factory(url: str, token: str | None = None) -> Callable[[Rollout], Any]:
    """``ctx.llm`` for each rollout: an OpenAI client for ``url`` tagged with its ids."""
    from rollfleet.engines.client import llm_client

    def make(rollout: Rollout) -> Any:
        assert rollout.attempt is not None
        return llm_client(url, rollout.rollout_id, rollout.attempt.attempt_id, token=token)

    return make


@contextlib.asynccontextmanager
async def own_engine(model: str | None, slots: int) -> AsyncIterator[str]:
    """A private llama.cpp engine and gateway in this process; yields the gateway URL."""
    from rollfleet.engines.gateway import Gateway
    from rollfleet.engines.gateway_app import running_gateway
    from rollfleet.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(
        model, slots=max(1, slots), threads=max(1, len(os.sched_getaffinity(0)) - 1)
    )
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine)
    try:
        async with running_gateway(gateway) as url:
            yield url
    finally:
        await gateway.close()


async def _watch_parent(parent: int, runner: Runner) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - no event tells a process its parent died
        await asyncio.sleep(1.0)
    runner.stop()
    runner.stop()


async def _serve(args: argparse.Namespace, llm_url: str | None) -> int:
    env = None
    if args.env_spec:
        from rollfleet.envs import EnvSpec, build_env_source

        env = build_env_source(EnvSpec.model_validate_json(args.env_spec), args.concurrency)
    store = connect(args.store, token=args.token)
    try:
        runner = Runner(
            store,
            args.agent,
            worker_id=args.worker_id,
            concurrency=args.concurrency,
            grace_s=args.grace_s,
            on_event=emit,
            env=env,
            llm_factory=llm_factory(llm_url, args.llm_token) if llm_url else None,
        )
    except AgentError as exc:
        emit("agent_error", worker_id=args.worker_id, error=str(exc))
        await store.close()
        return 3
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runner.stop)
    watcher = (
        asyncio.create_task(_watch_parent(os.getppid(), runner)) if args.exit_with_parent else None
    )
    try:
        await runner.run()
    finally:
        if watcher is not None:
            watcher.cancel()
        if env is not None:
            await env.close()
        await store.close()
    return 0


async def main_async(args: argparse.Namespace) -> int:
    """Run one runner until signalled."""
    if not args.own_engine:
        return await _serve(args, args.llm_url)
    try:
        async with own_engine(args.model_path, args.concurrency) as url:
            return await _serve(args, url)
    except RollfleetError as exc:
        emit("agent_error", worker_id=args.worker_id, error=f"own engine: {exc}")
        return 3


def main() -> None:
    """Parse arguments and run."""
    parser = argparse.ArgumentParser(prog="rollfleet-runner")
    parser.add_argument("--store", required=True)
    parser.add_argument("--agent", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument(
        "--token",
        default=os.environ.get("ROLLFLEET_TOKEN"),
        help="bearer token (default: ROLLFLEET_TOKEN; prefer it: a command line is world-readable)",
    )
    parser.add_argument("--llm-url", default=None, help="gateway base URL for ctx.llm")
    parser.add_argument("--llm-token", default=None)
    parser.add_argument(
        "--own-engine", action="store_true", help="start a private llama.cpp engine for ctx.llm"
    )
    parser.add_argument(
        "--model-path", default=None, help="GGUF for --own-engine (default: the bundled model)"
    )
    parser.add_argument("--env-spec", default=None, help="JSON EnvSpec for ctx.env")
    parser.add_argument("--exit-with-parent", action="store_true")
    raise SystemExit(asyncio.run(main_async(parser.parse_args())))


if __name__ == "__main__":
    main()
