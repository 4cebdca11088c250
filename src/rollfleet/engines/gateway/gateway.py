"""The LLM gateway: routes calls to engine replicas and records each one as a Step.

Routing (:class:`Router`): a rollout sticks to the replica it first used (its KV/prefix
cache is warm there) while that replica has a free slot; when the sticky replica is full
and another replica is less loaded, the rollout is re-pinned there (verl pins a long
conversation to a busy replica forever). New rollouts go to the least-loaded replica
(in-flight requests over capacity), ties broken at random. Replicas can be added and
removed at run time.

Recording: every call made on behalf of a rollout attempt becomes one ``StepIn(kind="llm")``
handed to the ``recorder`` callback the gateway was built with (the control plane wires it
to the store's ``add_steps``). An aborted call is recorded too, with its partial tokens, unless
its attempt no longer owns the rollout (a cancelled rollout: cancelling comes before the abort);
then the refusal is logged and the caller still gets the partial output.

Asked again (:mod:`~rollfleet.engines.gateway.repeats`): a call whose answer is determined (a
seed or greedy, the same weights) that a later attempt of its rollout sends again, after the first
attempt died with the call in flight, is answered with the tokens already generated and recorded
under the asking attempt, ``reuses`` naming the call that generated them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollfleet.engines.base import (
    Delta,
    Engine,
    Generation,
    GenerationRequest,
    StreamItem,
    WeightsDelta,
)
from rollfleet.engines.continuation import token_in
from rollfleet.engines.gateway.priors import Priors
from rollfleet.engines.gateway.repeats import Repeats, call_key
from rollfleet.engines.images import cannot_see
from rollfleet.engines.tool_calls import read_tool_calls
from rollfleet.engines.weights.lora import LoraAdapter
from rollfleet.errors import Conflict, EngineError, InvalidInput, NotFound
from rollfleet.model import LLM_STEP, StepIn

log = logging.getLogger("rollfleet.engines")
Recorder = Callable[[str, str, StepIn], Awaitable[None]]
MAX_STICKY = 100_000


@dataclass
class Replica:
    """One engine behind the gateway, with its live load."""

    replica_id: str
    engine: Engine
    capacity: int
    in_flight: int = 0
    served: int = 0
    draining: bool = False

    @property
    def load(self) -> float:
        """In-flight requests per slot."""
        return self.in_flight / self.capacity

    def describe(self) -> dict[str, Any]:
        """JSON-ready view for the API and dashboard."""
        info = self.engine.info()
        return {
            "replica_id": self.replica_id,
            "engine": info.engine,
            "model": info.model,
            "weights_version": info.weights_version,
            "capacity": self.capacity,
            "in_flight": self.in_flight,
            "served": self.served,
            "draining": self.draining,
        }


class Router:
    """Least-loaded routing with per-rollout stickiness and re-pinning."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.replicas: dict[str, Replica] = {}
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.rng = rng or random.Random()
        self.repins = 0

    def pick(self, rollout_id: str | None, vision: bool = False) -> Replica:
        """The replica that should serve the next call of ``rollout_id`` (with ``vision``, one
        whose engine takes images: ImageRefused when none does)."""
        live = self.live(vision)
        if not live:
            raise EngineError("gateway: no engine replica is available")
        lowest = min(r.load for r in live)
        pinned = self.replicas.get(self.sticky.get(rollout_id, "")) if rollout_id else None
        if pinned is not None and pinned in live:
            if pinned.in_flight < pinned.capacity or pinned.load <= lowest:
                self.sticky.move_to_end(rollout_id)  # type: ignore[arg-type]
                return pinned
            self.repins += 1
        choice = self.rng.choice([r for r in live if r.load == lowest])
        if rollout_id:
            self.sticky[rollout_id] = choice.replica_id
            self.sticky.move_to_end(rollout_id)
            while len(self.sticky) > MAX_STICKY:
                self.sticky.popitem(last=False)
        return choice

    def live(self, vision: bool = False) -> list[Replica]:
        """Replicas taking calls (with ``vision``: those that see; ImageRefused naming the
        engines when replicas are up but none of them sees)."""
        live = [r for r in self.replicas.values() if not r.draining]
        if not vision or not live:
            return live
        seeing = [r for r in live if r.engine.info().vision]
        if not seeing:
            raise cannot_see(", ".join(sorted({r.engine.name for r in live})))
        return seeing


@dataclass
class _Flight:
    """One call in progress."""

    request: GenerationRequest
    replica: Replica
    rollout_id: str | None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Gateway:
    """Routes OpenAI-style calls to engine replicas and records them as Steps."""

    def __init__(
        self,
        recorder: Recorder | None = None,
        *,
        rng: random.Random | None = None,
        abort_wait_s: float = 5.0,
        reuse: bool = True,
    ) -> None:
        self.recorder = recorder
        self.router = Router(rng)
        self.abort_wait_s = abort_wait_s
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count(1)
        self._updating = asyncio.Lock()
        self.receiving = asyncio.Lock()  # held while a push over HTTP is read: one at a time
        self.priors = Priors()
        self.repeats = Repeats()  # calls asked again are answered from here
        self.reuse = reuse  # False: every call is generated (a restart-from-scratch baseline)

    # -- replicas ----------------------------------------------------------------------
    def add_replica(self, engine: Engine, replica_id: str | None = None) -> str:
        """Route to a started ``engine`` from now on; return its replica id."""
        replica_id = replica_id or f"{engine.name}-{next(self._ids)}"
        if replica_id in self.router.replicas:
            raise EngineError(f"gateway: replica {replica_id!r} already exists")
        capacity = max(1, engine.info().max_concurrency)
        self.router.replicas[replica_id] = Replica(replica_id, engine, capacity)
        log.info("gateway: added replica %s (%s, capacity %d)", replica_id, engine.name, capacity)
        return replica_id

    async def remove_replica(
        self, replica_id: str, *, abort: bool = False, stop: bool = True
    ) -> Engine:
        """Stop routing to a replica, let (or make) its calls finish, optionally stop it."""
        replica = self.router.replicas.get(replica_id)
        if replica is None:
            raise NotFound(f"gateway: no replica {replica_id!r}")
        replica.draining = True
        flights = [f for f in self._flights.values() if f.replica is replica]
        if abort:
            await replica.engine.abort([f.request.request_id for f in flights])
        for flight in flights:
            await flight.done.wait()
        del self.router.replicas[replica_id]
        if stop:
            await replica.engine.stop()
        log.info("gateway: removed replica %s", replica_id)
        return replica.engine

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica and its load."""
        return [r.describe() for r in self.router.replicas.values()]

    def models(self) -> list[str]:
        """Distinct model names served by the replicas."""
        return sorted(self.model_versions())

    def model_versions(self) -> dict[str, int]:
        """Each model served and the newest weights version a replica serves it at."""
        versions: dict[str, int] = {}
        for replica in self.router.replicas.values():
            info = replica.engine.info()
            versions[info.model] = max(versions.get(info.model, 0), info.weights_version)
        return versions

    async def close(self) -> None:
        """Abort everything and stop every replica's engine."""
        for replica_id in list(self.router.replicas):
            await self.remove_replica(replica_id, abort=True)

    # -- calls -------------------------------------------------------------------------
    async def stream(
        self,
        request: GenerationRequest,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """Route and run ``request``; yield deltas, record the call, then yield the result.
        A request with images goes to a replica that sees (ImageRefused when none does)."""
        replica = self.router.pick(rollout_id, vision=bool(request.images))
        info = replica.engine.info()
        key = (
            call_key(request, rollout_id, info.model, info.weights_version) if self.reuse else None
        )
        started = time.monotonic()
        answered = await self.repeats.answer(key)
        if answered is not None:  # asked again by a later attempt: the tokens exist
            result = dataclasses.replace(answered, request_id=request.request_id)
            self.priors.remember(request, result, rollout_id)
            latency = time.monotonic() - started
            await self._record(
                rollout_id, attempt_id, request, result, latency, replica, answered.request_id
            )
            yield Delta(
                result.text, tuple(result.completion_token_ids), tuple(result.logprobs or ())
            )
            yield result
            return
        request = self.priors.attach(request, rollout_id, info.model)
        flight = _Flight(request, replica, rollout_id)
        self._flights[request.request_id] = flight
        replica.in_flight += 1
        try:
            with self.repeats.producing(key) as produced:
                async for item in replica.engine.stream(request):
                    if isinstance(item, Generation):
                        item = read_tool_calls(request, item)  # recorded with the calls read
                        produced.set_result(item)
                        replica.served += 1
                        self.priors.remember(request, item, rollout_id)
                        latency = time.monotonic() - started
                        await self._record(rollout_id, attempt_id, request, item, latency, replica)
                    yield item
        finally:
            replica.in_flight -= 1
            self._flights.pop(request.request_id, None)
            flight.done.set()

    async def generate(
        self,
        request: GenerationRequest,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> Generation:
        """Route and run ``request`` to its end."""
        result: Generation | None = None
        async for item in self.stream(request, rollout_id, attempt_id):
            if isinstance(item, Generation):
                result = item
        if result is None:
            raise EngineError(f"gateway: {request.request_id} ended without a result")
        return result

    async def abort(self, rollout_id: str) -> int:
        """Abort a rollout's in-flight calls; return once they ended (partial output kept)."""
        flights = [f for f in self._flights.values() if f.rollout_id == rollout_id]
        by_replica: dict[str, list[str]] = {}
        for flight in flights:
            by_replica.setdefault(flight.replica.replica_id, []).append(flight.request.request_id)
        for replica_id, ids in by_replica.items():
            await self.router.replicas[replica_id].engine.abort(ids)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(f.done.wait() for f in flights)), self.abort_wait_s
            )
        if flights:
            log.info("gateway: aborted %d call(s) of rollout %s", len(flights), rollout_id)
        return len(flights)

    # -- weights -----------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """The newest weights version any replica serves (0 before the first update)."""
        return max((r.engine.version for r in self.router.replicas.values()), default=0)

    async def update_weights(
        self, tensors: list[tuple[str, Any]], version: int, *, base: int | None = None
    ) -> dict[str, Any]:
        """Install named tensors as ``version`` on every replica, one update at a time.

        ``version`` must be newer than every replica's (Conflict otherwise: a duplicate or a
        reordered push). A replica that refuses the tensors (unknown name, wrong shape, a
        missing one in a full update) keeps its weights, and the caller gets InvalidInput naming
        the tensor; replicas updated before it keep the new version (each replica's version is
        in the answer). With ``base``, the tensors are a delta computed against version
        ``base``: every replica must serve exactly that version (Conflict otherwise, before any
        changes: on another base the delta would silently corrupt the model), and the weights
        not sent keep their values (a delta of no tensor changes no weight: the replicas only
        serve the same weights as ``version``). The answer has each replica's update time
        (``update_s``) and, for engines that measure it (``last_pause_s``), how long its
        generation stopped (``pause_s``)."""
        async with self._updating:
            current = self.weights_version
            if version <= current:
                raise Conflict(f"weights version {version} is not newer than {current}")
            if not self.router.replicas:
                raise EngineError("gateway: no engine replica to update")
            if isinstance(tensors, LoraAdapter):
                self._check_adapters(base)
            if base is not None:
                replicas = self.router.replicas.values()
                others = [
                    f"{r.replica_id} serves {r.engine.version}"
                    for r in replicas
                    if r.engine.version != base
                ]
                if others:
                    raise Conflict(
                        f"weights delta computed against version {base}, but {', '.join(others)}"
                    )
                tensors = WeightsDelta(tensors, base)
            totals: dict[str, float] = {}
            pauses: dict[str, float] = {}  # generation stopped, where the engine measures it
            for replica in list(self.router.replicas.values()):
                started = time.monotonic()
                try:
                    if base is not None and not tensors:  # nothing changed: a new label only
                        await replica.engine.relabel(version)
                    else:
                        await replica.engine.update_weights(tensors, version)
                except EngineError as exc:
                    raise InvalidInput(f"{replica.replica_id}: {exc}") from exc
                totals[replica.replica_id] = round(time.monotonic() - started, 6)
                pause = getattr(replica.engine, "last_pause_s", None)
                if pause is not None:
                    pauses[replica.replica_id] = round(pause, 6)
                log.info("gateway: %s now serves weights version %d", replica.replica_id, version)
            delta = {} if base is None else {"base": base}
            return {
                "version": version,
                **delta,
                "tensors": len(tensors),
                "update_s": totals,
                "pause_s": pauses,
                "replicas": self.replicas(),
            }

    @property
    def takes_adapters(self) -> bool:
        """Whether every replica applies LoRA adapters pushed as such (none: merge them)."""
        replicas = self.router.replicas.values()
        return bool(replicas) and all(r.engine.info().adapters for r in replicas)

    def _check_adapters(self, base: int | None) -> None:
        """InvalidInput unless every replica takes an adapter (one replaces the last whole, so
        it has no base)."""
        if base is not None:
            raise InvalidInput("weights: a LoRA adapter replaces the last one whole: no base")
        refusing = [
            r.replica_id for r in self.router.replicas.values() if not r.engine.info().adapters
        ]
        if refusing:
            raise InvalidInput(
                f"weights: {', '.join(refusing)} cannot apply a LoRA adapter; push merged weights"
            )

    @property
    def in_flight(self) -> int:
        """Calls in progress across every replica."""
        return len(self._flights)

    async def _record(
        self,
        rollout_id: str | None,
        attempt_id: str | None,
        request: GenerationRequest,
        result: Generation,
        latency_s: float,
        replica: Replica,
        reuses: str | None = None,
    ) -> None:
        if self.recorder is None or not rollout_id or not attempt_id:
            return
        payload = step_payload(request, result, latency_s, replica.replica_id)
        if reuses is not None:
            payload["reuses"] = reuses  # the call that generated these tokens
        step = StepIn(kind=LLM_STEP, payload=payload, timestamp=time.time())
        try:
            await self.recorder(rollout_id, attempt_id, step)
        except Conflict as exc:
            if not result.aborted:
                raise  # a stale attempt's call: refused, as the fence says
            log.info("gateway: aborted call of %s not recorded: %s", rollout_id, exc.message)


def step_payload(
    request: GenerationRequest, result: Generation, latency_s: float, replica_id: str
) -> dict[str, Any]:
    """The Step payload recorded for one LLM call."""
    params = request.params
    prior = request.prior
    return {
        "request_id": request.request_id,
        "continues": None if prior is None else prior.request_id,
        # token-in held: the prompt is the prior call's exact tokens and the new messages'
        "token_in": None if prior is None else token_in(prior, result.prompt_token_ids),
        "messages": None if request.messages is None else list(request.messages),
        "prompt": request.prompt if isinstance(request.prompt, str) else None,
        "prompt_token_ids": result.prompt_token_ids,
        "completion_token_ids": result.completion_token_ids,
        "logprobs": result.logprobs,
        "text": result.text,
        "finish_reason": result.finish_reason.value,
        "latency_s": round(latency_s, 6),
        "engine": result.engine,
        "model": result.model,
        "replica": replica_id,
        "weights_version": result.weights_version,
        "weights_versions": [list(span) for span in result.versions],
        "usage": result.usage,
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
        },
        **_tool_payload(request, result),
    }


def _tool_payload(request: GenerationRequest, result: Generation) -> dict[str, Any]:
    """What a call that offered tools adds to its Step: the tools and ``tool_choice``, the
    calls read from the text (OpenAI's shape) and, when the text tried one that was not taken,
    why (``tool_parse_error``)."""
    if not request.tools:
        return {}
    parsed = result.tool_parse
    return {
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "tool_calls": [c.wire() for c in parsed.calls] if parsed and parsed.calls else None,
        "tool_parse_error": parsed.error if parsed else None,
    }
