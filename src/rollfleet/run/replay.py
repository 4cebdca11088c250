"""Replaying a finished rollout of the loop agent against its recording (``rollfleet replay``).

The rollout's agent (:func:`rollfleet.agents.loop.agent`, with the rollout's mode, input and
``metadata["run"]`` settings, as its rollout id) runs again; what it gets and what it produces is
checked against what the store recorded, and the first difference stops it:

- the model is not asked: ``ctx.llm`` is :class:`RecordedLLM`, the OpenAI client's shape, which
  answers call *n* with the *n*-th recorded call (:func:`served_calls`: those the training rows
  come from, :func:`~rollfleet.coordinator.experiences.training_calls`, plus the replies the
  agent threw away, which it must throw away again). Each request goes through the gateway's own
  wire code (``parse_request``), and its messages, tools and sampling must equal the recorded
  ones; each answer is built by the gateway's own code (tool calls read from the recorded text,
  the response shaped as the gateway shapes it);
- tools run live in a fresh session of the mode (with an environment from the mode's own
  ``env_source`` where it has one): each observation must equal the recorded one (the
  ``tool_result`` steps, else the ``turn`` steps), and so must each turn record, each discard,
  each per-call reward, each snapshot of a mode that snapshots;
- token ids (llama.cpp, the default engine): the GGUF's vocabulary and chat template only are
  loaded (:mod:`~rollfleet.engines.llamacpp.vocab`, about a second, no weights) and each call's
  prompt is built by the engine's own code (a token-in continuation of the call the recording
  says it continued, else the whole conversation rendered and tokenized), which must equal the
  recorded ``prompt_token_ids`` byte for byte; the recorded ``completion_token_ids`` must make
  the recorded reply the way the engine reads sampled tokens (end-of-generation tokens, stop
  strings), with the recorded finish reason; and the training rows built from the rebuilt
  prompts must equal those built from the recorded ones;
- the reward: the session scores the final answer again; the ``reward`` step, the rollout's
  reward and its final transcript must equal the recorded ones.

Not checked: what the model would sample now (no model weights are loaded: the completions are
the recorded ones, checked for consistency, not regenerated); token ids for other engines than
llama.cpp, or for calls with images (their prompts are built by a vision projector); a call the
engine failed outright (it left no record to serve).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, cast

from rollfleet.coordinator.experiences import sequences_from_steps, training_calls
from rollfleet.engines.base import FinishReason, Generation, GenerationRequest
from rollfleet.engines.continuation import PriorCall
from rollfleet.engines.llamacpp.vocab import EngineTokens
from rollfleet.errors import InvalidInput, RollfleetError
from rollfleet.model import (
    CALL_REWARD_STEP,
    DISCARD_STEP,
)
from rollfleet.run.recording import (
    RecordedLLM,
    Recording,
    ReplayContext,
    token_checker,
)
from rollfleet.run.replay_report import (
    Check,
    Diverged,
    ReplayReport,
    diff,
    first_difference,
    short,
)
from rollfleet.store.base import Store
from rollfleet.store.blobs import extract_images

TURN_FIELDS = ("request_id", "content", "tool_calls", "reward")  # of a turn step, compared
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed")
TOKEN_WINDOW = 6  # token ids shown either side of the first differing one


class Replayer:
    """Drives one replay: answers the agent's model calls, checks every step it emits."""

    def __init__(
        self,
        rec: Recording,
        tokens: EngineTokens | None,
        report: ReplayReport,
        on_check: Callable[[Check], None],
        on_call: Callable[[int, int], None],
    ) -> None:
        """Replay ``rec`` into ``report``; ``on_check`` sees each check, ``on_call(done,
        total)`` each model call answered."""
        self.rec, self.tokens, self.report = rec, tokens, report
        self._on_check, self._on_call = on_check, on_call
        self.asked = 0
        self.turns_done = 0
        self.prompts: dict[str, list[int]] = {}  # request id -> the prompt ids rebuilt
        self.seen: dict[str, int] = {}  # step kinds emitted

    # -- checks -------------------------------------------------------------------------------
    def ok(self, where: str, detail: str) -> None:
        """Record a check that held."""
        check = Check(where, True, detail)
        self.report.checks.append(check)
        self._on_check(check)

    def fail(self, where: str, detail: str, lines: list[str] | None = None) -> NoReturn:
        """Record a check that failed, and stop the replay (Diverged)."""
        check = Check(where, False, detail, lines or [])
        self.report.checks.append(check)
        self._on_check(check)
        raise Diverged(check)

    def same(self, where: str, what: str, recorded: Any, replayed: Any) -> None:
        """Fail unless ``replayed`` equals ``recorded``."""
        if recorded != replayed:
            self.fail(
                where,
                f"{what} differs: recorded {short(recorded)}, replayed {short(replayed)}",
                diff(recorded, replayed),
            )

    # -- the model ----------------------------------------------------------------------------
    def call_label(self, index: int, request_id: str | None = None) -> str:
        """How a check names call ``index`` (0-based)."""
        rid = f", {request_id}" if request_id else ""
        return f"call {index + 1}/{len(self.rec.calls)} (turn {self.turns_done}{rid})"

    async def answer(self, kwargs: dict[str, Any]) -> Any:
        """The agent's next model call, answered with the next recorded one once its request
        equals the recorded request."""
        from openai.types.chat import ChatCompletion

        from rollfleet.engines.gateway.wire import Shaper, parse_request
        from rollfleet.engines.tool_calls import read_tool_calls

        index = self.asked
        self.asked += 1
        if index >= len(self.rec.calls):
            self.fail(
                self.call_label(index),
                f"the agent asks the model again, the recording has {len(self.rec.calls)} calls",
            )
        step = self.rec.calls[index]
        p = step.payload
        rid = str(p.get("request_id"))
        where = self.call_label(index, rid)
        try:  # what the OpenAI client sends, read by the gateway's own code
            raw = json.dumps(kwargs).encode()
            body, request, _ = await parse_request(raw, True, None)
        except (RollfleetError, TypeError, ValueError) as exc:
            self.fail(where, f"the gateway would refuse the call: {exc}")
        request = dataclasses.replace(request, request_id=rid)
        self.check_request(where, request, p)
        if self.tokens is not None:
            self.check_tokens(where, request, p)
        result = Generation(
            request_id=rid,
            text=str(p.get("text") or ""),
            prompt_token_ids=list(p.get("prompt_token_ids") or []),
            completion_token_ids=list(p.get("completion_token_ids") or []),
            logprobs=None,
            finish_reason=FinishReason(p.get("finish_reason") or "stop"),
            engine=str(p.get("engine") or ""),
            model=str(p.get("model") or ""),
            weights_version=int(p.get("weights_version") or 0),
            reported_usage=cast(dict[str, int] | None, p.get("usage")),
        )
        result = read_tool_calls(request, result)
        if request.tools:
            parsed = result.tool_parse
            calls = [c.wire() for c in parsed.calls] if parsed and parsed.calls else None
            self.same(where, "the tool calls read from the reply", p.get("tool_calls"), calls)
        self._on_call(self.asked, len(self.rec.calls))
        return ChatCompletion.model_validate(Shaper(request, body, False).full(result))

    def check_request(self, where: str, request: GenerationRequest, p: dict[str, Any]) -> None:
        """The messages, tools and sampling of a call, against the recorded ones."""
        sent = extract_images(list(request.messages or []), {})
        recorded = p.get("messages")
        if sent != recorded:
            rec_msgs = recorded if isinstance(recorded, list) else []
            i = first_difference(rec_msgs, sent)
            if i < len(rec_msgs) and i < len(sent):
                a, b = rec_msgs[i], sent[i]
                role = b.get("role") if isinstance(b, dict) else "?"
                both = isinstance(a, dict) and isinstance(b, dict)
                if both and a.get("role") == b.get("role") and a.keys() == b.keys():
                    a, b = a.get("content"), b.get("content")
                self.fail(
                    where,
                    f"message {i} ({role}) differs from the recorded one: recorded {short(a)},"
                    f" replayed {short(b)}",
                    diff(a, b),
                )
            self.fail(
                where,
                f"the agent sent {len(sent)} messages, the recording has {len(rec_msgs)}",
                diff(rec_msgs, sent),
            )
        self.same(where, "the tools offered", p.get("tools"), request.tools)
        params = request.params
        sampling = {k: getattr(params, k) for k in SAMPLING_FIELDS}
        recorded_sampling = p.get("sampling") or {}
        self.same(
            where, "sampling", {k: recorded_sampling.get(k) for k in SAMPLING_FIELDS}, sampling
        )
        self.ok(
            where,
            f"messages as recorded ({len(sent)} messages; temperature {params.temperature},"
            f" max_tokens {params.max_tokens}, seed {params.seed})",
        )

    def prior_of(self, p: dict[str, Any]) -> PriorCall | None:
        """The earlier call this one continued, as the gateway handed it to the engine."""
        rid = p.get("continues")
        if not rid:
            return None
        step = self.rec.llm.get(str(rid))
        if step is None:
            return None
        q = step.payload
        tools = q.get("tools")
        return PriorCall(
            str(rid),
            str(q.get("model") or ""),
            list(cast(list[Any], q.get("messages") or [])),
            list(cast(list[int], q.get("prompt_token_ids") or [])),
            list(cast(list[int], q.get("completion_token_ids") or [])),
            str(q.get("finish_reason") or ""),
            str(q.get("text") or ""),
            cast(list[dict[str, Any]] | None, tools),
        )

    def check_tokens(self, where: str, request: GenerationRequest, p: dict[str, Any]) -> None:
        """The prompt the engine builds, and the reply the recorded completion ids make."""
        assert self.tokens is not None
        prior = self.prior_of(p)
        if p.get("continues") and prior is None:
            self.fail(where, f"it continued call {p.get('continues')}, which is not recorded")
        recorded_request = dataclasses.replace(
            request, messages=cast(list[Any], p.get("messages")), prior=prior
        )
        try:
            rebuilt = self.tokens.prompt(recorded_request)
        except RollfleetError as exc:
            self.fail(where, f"the engine cannot build the prompt: {exc.message}")
        self.prompts[str(p.get("request_id"))] = rebuilt
        recorded = list(cast(list[int], p.get("prompt_token_ids") or []))
        if rebuilt != recorded:
            i = first_difference(recorded, rebuilt)
            lo, hi = max(0, i - TOKEN_WINDOW), i + TOKEN_WINDOW
            how = f"continuing {prior.request_id}" if prior else "rendered whole"
            self.fail(
                where,
                f"prompt token ids differ at position {i} (recorded {len(recorded)} tokens,"
                f" rebuilt {len(rebuilt)}, {how})",
                [
                    f"recorded [{lo}:]: {self.tokens.show(recorded[lo:hi])}",
                    f"rebuilt  [{lo}:]: {self.tokens.show(rebuilt[lo:hi])}",
                ],
            )
        completion = list(cast(list[int], p.get("completion_token_ids") or []))
        text, finish, used = self.tokens.reply(completion, request.params)
        recorded_text, recorded_finish = p.get("text"), p.get("finish_reason")
        if (text, finish, used) != (recorded_text, recorded_finish, len(completion)):
            self.fail(
                where,
                f"the {len(completion)} recorded completion ids make {short(text)} ({finish},"
                f" after {used} ids), recorded {short(recorded_text)} ({recorded_finish})",
                diff(recorded_text, text),
            )
        how = f"token-in after {prior.request_id}" if prior else "rendered whole"
        self.ok(
            where,
            f"token ids byte-identical: prompt {len(rebuilt)} ({how}), completion"
            f" {len(completion)} making the recorded reply ({finish})",
        )

    # -- the agent's steps --------------------------------------------------------------------
    def on_step(self, kind: str, p: dict[str, Any]) -> None:
        """Check one step the agent emits against the recording."""
        self.seen[kind] = self.seen.get(kind, 0) + 1
        from rollfleet.agents.resume import REPLY_STEP, SNAPSHOT_STEP, TOOL_RESULT_STEP

        if kind == REPLY_STEP:
            self.check_reply(p)
        elif kind == TOOL_RESULT_STEP:
            self.check_result(p)
        elif kind == "turn":
            self.check_turn(p)
        elif kind == DISCARD_STEP:
            self.check_discard(p)
        elif kind == CALL_REWARD_STEP:
            rid = str(p.get("request_id"))
            self.same(
                f"turn {p.get('turn')}",
                "the call's reward",
                self.rec.call_rewards.get(rid),
                [float(p.get("reward") or 0.0)],
            )
        elif kind == SNAPSHOT_STEP and p.get("turn") in self.rec.snapshots:
            where = f"turn {p.get('turn')}"
            self.same(where, "the environment snapshot", self.rec.snapshots[p["turn"]], p["state"])
            self.ok(where, "environment snapshot as recorded")
        elif kind == "reward":
            self.same("reward step", "the reward step", self.rec.reward, p)
            self.ok(
                "reward step",
                f"rescored as recorded: reward {p.get('reward')}, correct {p.get('correct')},"
                f" answer {short(p.get('answer'))}",
            )

    def check_reply(self, p: dict[str, Any]) -> None:
        """The reply the agent acts on, and the calls it read from it."""
        rid = str(p.get("request_id"))
        where = f"turn {p.get('turn')}"
        recorded = self.rec.replies.get(rid)
        if recorded is None:
            if self.rec.replies:  # a mode that records replies recorded this one elsewhere
                self.fail(where, f"the agent acts on reply {rid}, which the recording has not")
            return
        self.same(where, "the reply acted on", recorded, p)

    def check_result(self, p: dict[str, Any]) -> None:
        """One tool observation, against the recorded ``tool_result``."""
        turn, index = int(p.get("turn") or 0), int(p.get("index") or 0)
        where = f"turn {turn} tool call {index} ({p.get('tool')})"
        recorded = self.rec.results.get((turn, index))
        if recorded is None:
            if self.rec.durable:
                self.fail(where, "the tool ran, the recording has no result for this call")
            return  # checked with the turn
        self.observation(where, recorded, p)

    def observation(self, where: str, recorded: dict[str, Any], p: dict[str, Any]) -> None:
        """An observation (and whether it ended the episode) against the recorded one."""
        self.report.observations += 1
        self.same(where, "the tool", recorded.get("tool"), p.get("tool"))
        if "args" in recorded:
            self.same(where, "the tool's arguments", recorded.get("args"), p.get("args"))
        self.same(where, "the observation", recorded.get("observation"), p.get("observation"))
        for name in ("done", "images"):
            if name in recorded:
                self.same(where, f"the observation's {name}", recorded.get(name), p.get(name))
        self.ok(where, f"observation as recorded: {short(p.get('observation'))}")

    def check_turn(self, p: dict[str, Any]) -> None:
        """A turn's record: its reply, its calls with their observations, its reward."""
        turn = int(p.get("turn") or 0)
        where = f"turn {turn}"
        recorded = self.rec.turns.get(turn)
        if recorded is None:
            last = max(self.rec.turns, default=-1)
            self.fail(where, f"the replay runs turn {turn}; the recording ended after turn {last}")
        assert recorded is not None
        if not self.rec.durable:  # no tool_result steps: the observations are checked here
            calls = recorded.get("tool_calls") or []
            for index, call in enumerate(p.get("tool_calls") or []):
                there = calls[index] if index < len(calls) else {}
                self.observation(f"{where} tool call {index} ({call.get('tool')})", there, call)
        for name in TURN_FIELDS:
            self.same(where, f"the turn's {name}", recorded.get(name), p.get(name))
        self.turns_done = turn + 1
        names = [c.get("tool") for c in p.get("tool_calls") or []]
        self.ok(
            where,
            f"turn as recorded: reply {short(p.get('content'))}"
            + (f", calls {', '.join(map(str, names))}" if names else ", no call (the answer)"),
        )

    def check_discard(self, p: dict[str, Any]) -> None:
        """A reply the agent threw away must be one it threw away in the recording."""
        rid = str(p.get("request_id"))
        where = f"turn {self.turns_done}"
        if rid not in self.rec.discards:
            self.fail(where, f"the agent discards reply {rid}, which the recording kept")
        self.ok(where, f"reply {rid} discarded as recorded: {short(p.get('reason'))}")

    # -- after the agent ----------------------------------------------------------------------
    def finish(self, result: Any) -> None:
        """What is left once the agent returned: unused calls and turns, the reward, the final
        transcript, the training rows."""
        rec = self.rec
        if self.asked < len(rec.calls):
            self.fail(
                f"call {self.asked + 1}/{len(rec.calls)}",
                f"the replay ended after {self.asked} model calls; the recording has"
                f" {len(rec.calls)}",
            )
        if self.turns_done < len(rec.turns):
            self.fail(
                f"turn {self.turns_done}",
                f"the replay ended after {self.turns_done} turns; the recording has"
                f" {len(rec.turns)}",
            )
        if not self.seen.get("reward"):
            self.fail("reward step", "the replay recorded no reward step")
        recorded = rec.rollout.result
        assert recorded is not None
        reward = getattr(result, "reward", None)
        self.same("reward", "the rollout's reward", recorded.reward, reward)
        self.report.reward = reward
        self.ok("reward", f"the rollout's reward {reward} as recorded")
        sent = extract_images((getattr(result, "output", None) or {}).get("messages"), {})
        kept = extract_images((recorded.output or {}).get("messages"), {})
        self.same("final transcript", "the final messages", kept, sent)
        self.ok("final transcript", f"{len(sent or [])} messages as recorded")
        if self.tokens is not None:
            self.check_rows()

    def check_rows(self) -> None:
        """The training rows from the rebuilt prompts against those from the recorded ones."""
        trained = training_calls(self.rec.steps, self.rec.attempt_id)
        rebuilt = [
            s.model_copy(
                update={
                    "payload": {
                        **s.payload,
                        "prompt_token_ids": self.prompts.get(str(s.payload.get("request_id"))),
                    }
                }
            )
            for s in trained
        ]
        rows, again = sequences_from_steps(trained), sequences_from_steps(rebuilt)
        shape = [(r.tokens, r.action_mask, r.prompt_length) for r in rows]
        if shape != [(r.tokens, r.action_mask, r.prompt_length) for r in again]:
            self.fail("training rows", "the rows from the rebuilt prompts differ")
        self.ok(
            "training rows",
            f"{len(rows)} row(s) from {len(trained)} calls ({max(len(rows) - 1, 0)} merge"
            " breaks): tokens and action masks byte-identical",
        )


async def replay(
    store: Store,
    rollout_id: str,
    *,
    model: Path | None = None,
    on_check: Callable[[Check], None] = lambda check: None,
    on_call: Callable[[int, int], None] = lambda done, total: None,
    on_start: Callable[[Recording, str | None], None] = lambda rec, why: None,
) -> ReplayReport:
    """Replay ``rollout_id`` from ``store`` (see the module's docstring); InvalidInput for a
    rollout that cannot be replayed. ``on_start(recording, why token ids are not checked)`` runs
    before the agent, ``on_check`` for each check, ``on_call(done, total)`` per model call."""
    from rollfleet.agents.loop import LoopSettings, agent
    from rollfleet.envs import EnvSpec, get_mode
    from rollfleet.envs.base import env_source_of

    rec = await Recording.load(store, rollout_id)
    settings = LoopSettings.of(rec.rollout.metadata)
    mode = get_mode(rec.rollout.mode, settings.observation)
    try:
        source = env_source_of(mode, EnvSpec(mode=str(rec.rollout.mode)), 1)
    except Exception as exc:  # a mode whose environment cannot exist here
        raise InvalidInput(
            f"mode {rec.rollout.mode}: cannot open its environment here: {exc}"
        ) from None
    tokens, why = token_checker(rec, model)
    report = ReplayReport(rollout_id, not_checked=[f"token ids: {why}"] if why else [])
    on_start(rec, why)
    replayer = Replayer(rec, tokens, report, on_check, on_call)
    ctx = ReplayContext(rec, RecordedLLM(replayer.answer), replayer.on_step)
    try:
        if source is None:
            result = await agent(rec.rollout.input, cast(Any, ctx))
        else:
            async with source.lease(attempt_id=rec.attempt_id) as instance:
                ctx.env = instance
                result = await agent(rec.rollout.input, cast(Any, ctx))
    except Diverged:
        pass
    except Exception as exc:  # the recording completed: an error now is a difference
        where = f"turn {replayer.turns_done}"
        check = Check(where, False, f"the agent raised {type(exc).__name__}: {exc}")
        report.checks.append(check)
        on_check(check)
    else:
        try:
            replayer.finish(result)
        except Diverged:
            pass
    finally:
        report.calls = replayer.asked
        if tokens is not None:
            tokens.close()
        if source is not None:
            await source.close()
    return report
