"""``rollfleet run``'s engine room: start what is not given, enqueue, follow, write the outputs.

1. Check every task of the data file for the mode (InvalidInput naming file:line and field).
2. The store: the one given by ``--store`` (then only enqueue and follow), else an embedded
   control plane on ``OUTPUT/store.db``, which is what makes a re-run resume.
   (:func:`rollfleet.run.stack.local_stack`; stale attempts of a killed run go back to the queue).
3. Enqueue with deterministic ids (existing ones are kept).
4. If anything is left: the LLM (``--engine URL``, else a llama.cpp engine and gateway here),
   then N runner processes (``LocalFleet``) with ``ctx.llm`` and ``ctx.env``, both on the
   stack; follow them with a progress bar.
5. Write ``trajectories.jsonl`` and ``summary.json`` from what the store holds.

The summary's ``startup_s`` says when each part was ready, in seconds since the command started:
what a user waits for before the first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rich.console import Console

from rollfleet.envs import preflight_of, shares_process
from rollfleet.envs.tasks import load_tasks
from rollfleet.model import TERMINAL_ROLLOUT, Rollout
from rollfleet.run.options import RunOptions
from rollfleet.run.outputs import claim_output_dir, summarize, trajectory, write_outputs
from rollfleet.run.progress import RunProgress
from rollfleet.run.stack import LocalStack, RunnerLlm, Startup, local_stack
from rollfleet.run.tasks import build_specs, mode_label, run_key
from rollfleet.runner.local import LocalFleet
from rollfleet.store.base import Store, read_all

log = logging.getLogger("rollfleet.run")
POLL_S = 0.25


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
    db = None if opts.store is not None else opts.output_dir / "store.db"
    async with local_stack(db, url=opts.store, token=opts.token, startup=startup) as stack:
        return await _run_on(stack, opts, specs, console)


async def _run_on(
    stack: LocalStack, opts: RunOptions, specs: list[Any], console: Console
) -> dict[str, Any]:
    store, ids = stack.store, [s.rollout_id for s in specs]
    existing = await store.enqueue_many(specs)
    kept = [r for r in existing if r.status in TERMINAL_ROLLOUT]
    console.print(
        f"{opts.mode}: {len(ids)} rollouts ({len(kept)} already finished) · store {stack.url}",
        soft_wrap=True,
    )
    started, group = time.perf_counter(), run_key(opts.data, opts.mode)
    done = {r.rollout_id for r in kept}
    with RunProgress(console, len(ids), kept, f"{opts.mode} ×{opts.num_rollouts}") as progress:
        if len(kept) < len(ids):
            if opts.store is None:
                llm = await stack.serve_llm(opts, console)
                stack.start_runners(runner_fleet(stack.url, opts, llm))
            try:
                await _follow(stack, set(ids), group, done, progress)
            finally:  # nothing left to claim: the runners' long-polls end now, no drain
                await stack.stop_runners(drain=False)
    wall = time.perf_counter() - started
    return await _write(store, opts, ids, done, wall, stack.startup)


def runner_fleet(url: str, opts: RunOptions, llm: RunnerLlm) -> LocalFleet:
    """One runner process running N rollouts at once (math, rag, or a shared pool's N rollouts
    over M instances); else N runner processes of one rollout each, so a rollout's environment
    (a sandbox, a desktop) and whatever it does to its process stay apart from the others."""
    mode = opts.load_mode()
    pooled = opts.use_vm_pool and bool(getattr(mode, "pools_instances", False))
    together = pooled or (shares_process(mode) and not opts.engine_per_runner)
    n, concurrency = (1, opts.num_rollouts) if together else (opts.num_rollouts, 1)
    return LocalFleet(
        url,
        opts.agent,
        n=n,
        concurrency=concurrency,
        prefix=f"run-{mode_label(opts.mode)}",
        grace_s=5.0,
        llm=llm.access,
        env=opts.env_spec(),
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
    stack: LocalStack, ids: set[str], group: str, seen: set[str], progress: RunProgress
) -> None:
    """Show rollouts as they finish until all of ``ids`` (in ``group``) are terminal."""
    seen = set(seen)
    while len(seen) < len(ids):
        for rollout in await _terminal(stack.store, group):
            if rollout.rollout_id in ids and rollout.rollout_id not in seen:
                seen.add(rollout.rollout_id)
                progress.finished(rollout)
        failed = stack.runners_failed()
        if failed is not None:
            raise failed
        if len(seen) < len(ids):
            await asyncio.sleep(POLL_S)


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
