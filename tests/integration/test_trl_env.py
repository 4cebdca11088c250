"""A rollfleet mode as TRL's ``environment_factory`` (``rollfleet.run.trl_env``): the environment
shows TRL the mode's tools with the mode's own schemas, plus ``answer``; its reward is the mode's
score of the answer given the calls made; and a real GRPOTrainer step runs with it, calling the
tools through TRL's own parsing and logging the environment's reward under its class name."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.envs.base import Observation, Score, Tool, Transcript
from rollfleet.envs.lookup import LookupSession
from rollfleet.errors import InvalidInput, RollfleetError

ROOT = Path(__file__).parents[2]
ADDER = f"{ROOT / 'examples' / 'adder.py'}:make"
TASK = {
    "question": "What is Quorvane's code?",
    "key": "Quorvane",
    "table": {"Quorvane": "8KX3Q", "Tessily": "2MPL7", "Varn": "Q9Z4T"},
}
NEEDS = ("transformers", "trl", "datasets", "torch", "accelerate")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _transformers() -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers")


def test_the_environment_shows_the_modes_tools_with_the_schema_trl_derives() -> None:
    from transformers.utils.chat_template_utils import get_json_schema

    from rollfleet.run.trl_env import ANSWER, environment_factory

    env = environment_factory("lookup", sample_task=TASK)()
    public = sorted(name for name in dir(env) if not name.startswith("_"))
    assert public == ["answer", "get_reward", "lookup", "reset"]
    for tool in (*LookupSession(TASK).tools, ANSWER):
        assert get_json_schema(getattr(env, tool.name)) == tool.openai()
    assert type(env).__name__ == "LookupEnvironment"  # TRL logs the reward under this name


def test_a_mode_that_needs_a_task_to_list_its_tools_asks_for_sample_task() -> None:
    from rollfleet.run.trl_env import environment_factory

    with pytest.raises(InvalidInput, match="pass sample_task"):
        environment_factory("lookup")
    with pytest.raises(InvalidInput, match="sample_task: field 'key' is missing"):
        environment_factory("lookup", sample_task={"question": "?", "table": {}})
    assert environment_factory(ADDER).__name__ == "AdderEnvironment"  # its tools need no task


async def _lookup_rollout(lookups: list[str], answer: str | None) -> tuple[float, float]:
    """The environment's reward for these calls, and the reward of LookupSession for the same."""
    from rollfleet.run.trl_env import environment_factory

    env: Any = environment_factory("lookup", sample_task=TASK)()
    env.reset(**TASK)
    session = LookupSession(TASK)
    for key in lookups:
        assert await env.lookup(key=key) == await session.call("lookup", {"key": key})
    if answer is not None:
        assert await env.answer(text=answer) == "answer received; the task is over"
    want = 0.0 if answer is None else (await session.score(answer)).reward
    return await env.get_reward(), want


@pytest.mark.parametrize(
    ("lookups", "answer", "reward"),
    [
        (["Quorvane"], "8KX3Q", 1.0),  # the code
        (["Quorvane"], "no idea", 0.25),  # the mode's partial credit: it looked the key up
        (["Varn"], "Q9Z4T", 0.0),  # another key's code
        ([], "8KX3Q", 1.0),  # the mode scores the answer; it does not ask how it was found
        (["Quorvane"], None, 0.0),  # no answer submitted
    ],
)
async def test_the_reward_is_the_modes_score_of_the_answer(
    lookups: list[str], answer: str | None, reward: float
) -> None:
    got, want = await _lookup_rollout(lookups, answer)
    assert got == want == reward


async def test_the_first_answer_stands_and_ends_the_rollout() -> None:
    from rollfleet.run.trl_env import environment_factory

    env: Any = environment_factory("lookup", sample_task=TASK)()
    env.reset(**TASK)
    await env.answer(text="8KX3Q")
    assert (await env.answer(text="wrong")).startswith("error: an answer is already in")
    assert (await env.lookup(key="Quorvane")).startswith("error: the task is over")
    assert await env.get_reward() == 1.0
    env.reset(**{**TASK, "key": "Varn"})  # the instance is reused: a new rollout starts clean
    await env.answer(text="8KX3Q")
    assert await env.get_reward() == 0.0


def test_reset_checks_the_task_with_the_mode() -> None:
    from rollfleet.run.trl_env import environment_factory

    env = environment_factory("lookup", sample_task=TASK)()
    with pytest.raises(InvalidInput, match="trl example: field 'key' 'Nope' is not in the table"):
        env.reset(**{**TASK, "key": "Nope"})
    with pytest.raises(InvalidInput, match="field 'table' is missing"):
        env.reset(prompt=[{"role": "user", "content": "hi"}], question="?", key="Quorvane")


def test_a_rollouts_calls_come_from_one_loop() -> None:
    from rollfleet.run.trl_env import environment_factory

    env: Any = environment_factory("lookup", sample_task=TASK)()
    env.reset(**TASK)
    assert asyncio.run(env.lookup(key="Quorvane")) == "Quorvane: 8KX3Q"
    with pytest.raises(RollfleetError, match="another event loop"):
        asyncio.run(env.lookup(key="Quorvane"))


ECHO_TOOLS = [
    Tool(
        "echo",
        "repeats text n times",
        {"text": "what to say", "n": "how often"},
        schema={"n": {"type": "integer"}},
        optional=frozenset({"n"}),
    ),
    Tool("quit", "ends the episode"),
]


class _EchoSession:
    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools

    async def call(self, name: str, args: dict[str, Any]) -> str | Observation:
        if name == "quit":
            return Observation("bye", done=True)
        return str(args["text"]) * int(args.get("n") or 1)

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        tools = [c["tool"] for c in (transcript.calls if transcript else [])]
        return Score(float(answer == "quit" and tools == ["echo", "quit"]), True)


class _EchoMode:
    name, uses_tools = "echo-twice", True

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools

    def check(self, task: Any, where: str) -> None:
        pass

    def system_prompt(self, task: dict[str, Any]) -> str:
        return "Echo."

    def user_prompt(self, task: dict[str, Any]) -> str:
        return "Say it."

    async def open(self, task: dict[str, Any], env: Any) -> _EchoSession:
        return _EchoSession(self.tools)


def echo_mode() -> _EchoMode:
    """A mode with an optional integer parameter, a long observation and an episode end."""
    return _EchoMode(ECHO_TOOLS)


def bounded_mode() -> _EchoMode:
    """A mode whose tool's schema no Python signature gives (a bound)."""
    return _EchoMode([Tool("move", "moves", {"x": "where"}, schema={"x": {"minimum": 0}})])


async def test_observations_are_capped_and_a_done_call_is_the_answer() -> None:
    from transformers.utils.chat_template_utils import get_json_schema

    from rollfleet.run.trl_env import MAX_OBSERVATION_CHARS, environment_factory

    factory = environment_factory(f"{Path(__file__)}:echo_mode")
    env: Any = factory()
    assert type(env).__name__ == "EchoTwiceEnvironment"
    assert get_json_schema(env.echo) == ECHO_TOOLS[0].openai()  # n: an optional integer
    env.reset()
    said = await env.echo(text="ab", n=MAX_OBSERVATION_CHARS)
    assert said.startswith("ab" * (MAX_OBSERVATION_CHARS // 2) + "\n[cut: ")
    assert said.endswith(f" {MAX_OBSERVATION_CHARS} more characters]")
    assert await env.quit() == "bye"  # done: the episode ends, the tool's name is the answer
    assert await env.get_reward() == 1.0


def test_a_tool_schema_trl_cannot_show_is_refused() -> None:
    from rollfleet.run.trl_env import environment_factory

    with pytest.raises(InvalidInput, match="TRL would show tool move as .* not as the mode's"):
        environment_factory(f"{Path(__file__)}:bounded_mode")


async def test_task_dataset_carries_each_task_whole_to_reset() -> None:
    require(importlib.util.find_spec("datasets") is not None, "datasets")
    from rollfleet.run.trl_env import ANSWER_NOTE, environment_factory, task_dataset

    data = ROOT / "src" / "rollfleet" / "examples" / "lookup.jsonl"
    rows = task_dataset(data, "lookup")
    tasks = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    assert len(rows) == len(tasks)
    env: Any = environment_factory("lookup", sample_task=tasks[0])()
    for row, task in zip(rows, tasks, strict=True):
        system, user = row["prompt"]
        assert system["content"].endswith(ANSWER_NOTE) and task["question"] in user["content"]
        env.reset(**row)  # tables of different keys: as JSON, no column merges them
        await env.answer(text=task["table"][task["key"]])
        assert await env.get_reward() == 1.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`")  # TRL's generation asks it
def test_a_grpo_step_calls_the_modes_tools_and_logs_its_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(all(importlib.util.find_spec(m) for m in NEEDS), " and ".join(NEEDS))
    import torch
    from transformers import TrainerCallback
    from trl.chat_template_utils import qwen2_5_chat_template
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import shutdown_event_loop_in_daemon

    from rollfleet.engines.tiny import tiny_tokenizer
    from rollfleet.run.trl_env import environment_factory, task_dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = qwen2_5_chat_template  # a template TRL parses tool calls from
    logged: list[dict[str, float]] = []

    class Logs(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            logged.append(dict(logs or {}))

    data = tmp_path / "adder.jsonl"
    data.write_text('{"a": 59, "b": 63}\n{"a": 15, "b": 43}\n')
    model = _scripted_model(tokenizer)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=task_dataset(data, ADDER),
        environment_factory=environment_factory(ADDER),  # the reward is the environment's only
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            max_steps=1,
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=400,
            learning_rate=1e-3,
            beta=0.0,
            use_cpu=True,
            bf16=False,
            activation_checkpointing=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        ),
        callbacks=[Logs()],
    )
    before = [p.detach().clone() for p in model.parameters()]
    try:
        trainer.train()
    finally:  # TRL stops the loop thread of async tools only at exit (and never closes it)
        shutdown_event_loop_in_daemon(trainer.async_loop_thread, trainer.async_loop)

    step = next(log for log in logged if "loss" in log)
    # each task: one sample adds and answers the sum (1.0), one answers 0 at once (0.0)
    assert step["rewards/AdderEnvironment/mean"] == pytest.approx(0.5)
    assert step["reward"] == pytest.approx(0.5)
    assert step["tools/call_frequency"] == pytest.approx((2 + 1) / 2)  # add and answer, or answer
    assert step["tools/failure_frequency"] == 0.0
    moved = [
        not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)
    ]
    assert any(moved)  # the rewards differed within each group: the step changed the model


def _scripted_model(tokenizer: Any) -> Any:
    """The tiny random Llama, generating by script what a model that uses the tools would write:
    in each task's first sample, ``add`` then ``answer`` the sum; in its second, ``answer 0``."""
    import torch
    from transformers import LlamaForCausalLM

    from rollfleet.engines.tiny import tiny_hf_model

    class Scripted(LlamaForCausalLM):  # type: ignore[no-untyped-call]
        def generate(self, input_ids: Any, attention_mask: Any = None, **_: Any) -> Any:
            texts = [
                tokenizer.decode(ids[mask.bool()])
                for ids, mask in zip(input_ids, attention_mask, strict=True)
            ]
            replies = [
                tokenizer(_reply(text, row) + "<|im_end|>")["input_ids"]
                for row, text in enumerate(texts)
            ]
            width = max(map(len, replies))
            pad = [r + [tokenizer.pad_token_id] * (width - len(r)) for r in replies]
            return torch.cat([input_ids, torch.tensor(pad, dtype=input_ids.dtype)], dim=1)

    config = tiny_hf_model()[0].config
    config.max_position_embeddings = 4096  # the tools' schemas make a long system prompt
    torch.manual_seed(0)
    return Scripted(config)


def _reply(text: str, row: int) -> str:
    """What the scripted model writes next in the conversation ``text`` (sample ``row``)."""
    seen = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
    if seen and re.fullmatch(r"-?\d+(\.\d+)?", seen[-1]):  # add's result: answer with it
        return _call("answer", text=seen[-1])
    if seen:  # the answer is in
        return "Done."
    found = re.search(r"What is (-?\d+) \+ (-?\d+)\?", text)
    assert found is not None, text
    if row % 2:
        return _call("answer", text="0")
    return _call("add", a=found[1], b=found[2])


def _call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
