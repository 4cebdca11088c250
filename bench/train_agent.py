"""Token-in across turns on agent conversations: ``python -m bench train_agent``.

Three-turn lookup conversations on the real bundled model (SmolLM2 through the llama.cpp engine)
behind a real :class:`~rollfleet.engines.gateway.gateway.Gateway` whose recorder keeps the LLM steps, as
the control plane's store does. A conversation is what the agent loop sends for a task of
``examples/lookup_eval.jsonl``: the lookup mode's system prompt (plus the tools' text protocol)
and the task's question, then three calls; after each reply the loop's assistant message and
the ``lookup`` tool's real observation for the task's key (the text protocol's user message
``Observation from lookup:\\n...``) are appended, whatever the model said, so every conversation
has exactly three calls. CONVERSATIONS conversations a round run concurrently (one engine slot
each), at temperature 1.0, MAX_TOKENS tokens a reply, the same seeds on both sides.

Sides, alternating A B A B A B, each round on a freshly loaded engine (cold prefix cache):

- token-in: the default gateway: a call continues its attempt's previous call with the exact
  tokens the engine saw and sampled, plus the new messages' tokens.
- re-tokenize: ``gateway.priors = Priors(rollouts=0)`` keeps no prior call: every turn the whole
  conversation is rendered by the chat template and tokenized again.

Per side, medians with their [min–max] over the rounds: prompt tokens per rollout (the three
calls' prompts), prompt tokens actually prefilled per rollout (prompts minus what the engine
found in its prefix cache, ``reused_tokens``), training rows per rollout
(:func:`~rollfleet.coordinator.experiences.sequences_from_steps` over the recorded steps), the
share of conversations that train as exactly one row, the tokens of those rows (what the trainer
runs forward and backward: a split conversation repeats its prompt in every row), and wall
seconds a round. Checked: each
conversation's action tokens (mask 1, over its rows) are exactly its calls' completion ids.

With ``TRAIN_AGENT_METRICS`` pointing at the ``metrics.jsonl`` of a real ``rollfleet train``
run, its step records are summarised too (seconds/step, /wait, /train, /sync); otherwise
``step`` is null (the real run is done separately).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from bench._common import ROOT, median_range, table, write_results
from rollfleet.testing import StepRecorder

COMMAND = "python -m bench train_agent"
ROUNDS, CONVERSATIONS, TURNS, MAX_TOKENS, TEMPERATURE = 3, 16, 3, 48, 1.0
SLOTS, CTX_PER_SEQ = 16, 1024
SIDES = ("token_in", "retokenize")
DATA = ROOT / "src" / "rollfleet" / "examples" / "lookup_eval.jsonl"
METRICS_ENV = "TRAIN_AGENT_METRICS"
STEP_KEYS = ("seconds/step", "seconds/wait", "seconds/train", "seconds/sync")
FIGURES = (
    "prompt_tokens_per_rollout",
    "prefilled_tokens_per_rollout",
    "rows_per_rollout",
    "trained_tokens_per_rollout",
    "one_row_share",
    "wall_s",
)


def tasks() -> list[dict[str, Any]]:
    """The lookup eval tasks."""
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


async def conversation(gateway: Any, task: dict[str, Any], attempt: str, seed: int) -> list[Any]:
    """One scripted three-turn conversation; its calls' results."""
    from rollfleet.agents.loop import _assistant, _observation
    from rollfleet.agents.toolcalls import ToolCall, tool_instructions
    from rollfleet.engines.base import GenerationRequest, SamplingParams
    from rollfleet.envs.lookup import LookupMode

    mode = LookupMode()
    session = await mode.open(task, None)
    system = mode.system_prompt(task) + tool_instructions(session.tools)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": mode.user_prompt(task)},
    ]
    call = ToolCall("lookup", {"key": task["key"]})
    results = []
    for turn in range(TURNS):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed + turn)
        request = GenerationRequest(messages=list(messages), params=params)
        result = await gateway.generate(request, f"ro-{attempt}", attempt)
        results.append(result)
        observation = await session.call(call.name, call.args)
        messages += [_assistant(result.text, []), _observation(call, observation)]
    return results


def actions_match(seqs: list[Any], results: list[Any]) -> bool:
    """The rows' action tokens are exactly the calls' completion ids, in order."""
    actions = [t for s in seqs for t, m in zip(s.tokens, s.action_mask, strict=True) if m]
    return actions == [t for g in results for t in g.completion_token_ids]


async def one_round(side: str, r: int, n: int = CONVERSATIONS) -> dict[str, Any]:
    """Round ``r`` of one side on a freshly loaded engine; its figures."""
    from rollfleet.coordinator.experiences import sequences_from_steps, training_calls
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.gateway.priors import Priors
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(slots=SLOTS, ctx_per_seq=CTX_PER_SEQ)
    await engine.start()
    recorded = StepRecorder()
    gateway = Gateway(recorded)
    if side == "retokenize":
        gateway.priors = Priors(rollouts=0)
    gateway.add_replica(engine, "llama-0")
    batch = [tasks()[(r * n + i) % len(tasks())] for i in range(n)]
    try:
        began = time.perf_counter()
        done = await asyncio.gather(
            *(
                conversation(gateway, t, f"r{r}-c{i}", 10_000 * r + 100 * i)
                for i, t in enumerate(batch)
            )
        )
        wall = time.perf_counter() - began
    finally:
        await engine.stop()
    prompts = sum(len(g.prompt_token_ids) for results in done for g in results)
    rows, trained, mismatches, token_in = [], 0, 0, 0
    for i, results in enumerate(done):
        steps = recorded.of(f"r{r}-c{i}")
        token_in += sum(s.payload["token_in"] is True for s in steps)
        seqs = sequences_from_steps(training_calls(steps, f"r{r}-c{i}"))
        rows.append(len(seqs))
        trained += sum(len(s.tokens) for s in seqs)
        mismatches += not actions_match(seqs, results)
    finishes = [g.finish_reason.value for results in done for g in results]
    return {
        "prompt_tokens_per_rollout": prompts / n,
        "prefilled_tokens_per_rollout": (prompts - engine.reused_tokens) / n,
        "rows_per_rollout": sum(rows) / n,
        "trained_tokens_per_rollout": trained / n,
        "one_row_share": sum(k == 1 for k in rows) / n,
        "wall_s": wall,
        "reused_tokens": engine.reused_tokens,
        "action_mismatches": mismatches,
        "token_in_calls": token_in,
        "length_finishes": finishes.count("length"),
        "rows": rows,
        "first_replies": [results[0].completion_token_ids for results in done],
    }


def step_section(path: str | None) -> dict[str, Any] | None:
    """Median [range] of a real training run's step times, from its metrics.jsonl."""
    if not path:
        return None
    lines = Path(path).read_text().splitlines()
    steps = [r for r in map(json.loads, filter(str.strip, lines)) if r.get("kind") == "step"]
    rollouts = sorted(int(s.get("rollouts", 0)) for s in steps)
    out: dict[str, Any] = {
        "metrics": str(path),
        "steps": len(steps),
        "rollouts_per_step": rollouts[len(rollouts) // 2] if rollouts else None,
    }
    for key in STEP_KEYS:
        values = [float(s[key]) for s in steps if isinstance(s.get(key), (int, float))]
        out[key] = median_range(values) if values else None
    return out


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side: medians [range] over the rounds, with each round's raw figures."""
    sides: dict[str, Any] = {}
    for side, found in rounds.items():
        sides[side] = {key: median_range([f[key] for f in found]) for key in FIGURES}
        sides[side]["action_mismatches"] = sum(f["action_mismatches"] for f in found)
        sides[side]["rounds"] = [
            {k: v for k, v in f.items() if k != "first_replies"} for f in found
        ]
    a, b = sides["token_in"], sides["retokenize"]
    key = "prefilled_tokens_per_rollout"
    same = [
        sum(x == y for x, y in zip(fa["first_replies"], fb["first_replies"], strict=True))
        for fa, fb in zip(rounds["token_in"], rounds["retokenize"], strict=True)
    ]
    return {
        "sides": sides,
        "prefilled_ratio": b[key]["median"] / a[key]["median"],
        "rows_ratio": b["rows_per_rollout"]["median"] / a["rows_per_rollout"]["median"],
        "trained_ratio": b["trained_tokens_per_rollout"]["median"]
        / a["trained_tokens_per_rollout"]["median"],
        "same_first_replies": same,  # per round: conversations whose first reply is identical
    }


async def run(rounds: int = ROUNDS, n: int = CONVERSATIONS) -> dict[str, Any]:
    """Alternating rounds, A B A B ..."""
    found: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES:
            f = await one_round(side, r, n)
            found[side].append(f)
            print(
                f"round {r + 1} {side}: prompt {f['prompt_tokens_per_rollout']:.1f}, prefilled "
                f"{f['prefilled_tokens_per_rollout']:.1f} tokens/rollout, rows "
                f"{f['rows_per_rollout']:.2f}, one-row {f['one_row_share']:.0%}, "
                f"wall {f['wall_s']:.1f} s, mismatches {f['action_mismatches']}",
                flush=True,
            )
    return summarise(found)


def main(rounds: int = ROUNDS, n: int = CONVERSATIONS) -> dict[str, Any]:
    """Measure, print, write bench/results/train_agent.json."""
    out = asyncio.run(run(rounds, n))
    out["step"] = step_section(os.environ.get(METRICS_ENV))

    def cell(f: dict[str, float], digits: int = 1) -> str:
        return f"{f['median']:.{digits}f} [{f['min']:.{digits}f}-{f['max']:.{digits}f}]"

    table(
        f"{TURNS}-turn lookup conversations, {n} concurrent, {MAX_TOKENS} tokens, T={TEMPERATURE}",
        ["figure", "token-in", "re-tokenize"],
        [
            [key, cell(out["sides"]["token_in"][key], 2), cell(out["sides"]["retokenize"][key], 2)]
            for key in FIGURES
        ],
    )
    settings = {
        "rounds": rounds,
        "order": "A B (token_in, retokenize) each round",
        "conversations": n,
        "turns": TURNS,
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "slots": SLOTS,
        "ctx_per_seq": CTX_PER_SEQ,
        "data": str(DATA.relative_to(ROOT)),
        "mode": "lookup",
        "engine": "llamacpp, bundled SmolLM2-135M, fresh engine (cold prefix cache) each round",
        "seeds": "10000 * round + 100 * conversation + turn, both sides",
        "nproc": len(os.sched_getaffinity(0)),
    }
    return write_results("train_agent", {"settings": settings, **out}, COMMAND)


if __name__ == "__main__":
    main()
