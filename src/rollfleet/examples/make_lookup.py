"""Writes the bundled ``lookup`` splits (lookup.jsonl, lookup_eval.jsonl).

Each task asks for the access code of a made-up key; its private table holds that key and 3 to
5 distractors, each with a random code of 4 to 6 letters and digits. Every key and every code is
drawn once across both files, so the 64 held-out tasks share none with the 400 training ones,
and none is the system prompt's worked example. Why: a code cannot be guessed, so a right answer
proves the model called the tool. Untrained, the bundled 135M model calls it with the right key in
14% of replies at temperature 1 (95% greedy) but gets the code into its answer in 3% (2%
greedy): it repeats the call instead of answering, which RL can fix. Seeded: run
``python -m rollfleet.examples.make_lookup`` to write the same files again.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from rollfleet.envs.lookup import EXAMPLE

EVAL_TASKS = 64
TRAIN_TASKS = 400
_ONSETS = "b d f g k l m n p r s t v z br dr gl gr kl pr sk st tr vr".split()
_VOWELS = "a e i o u ai ei ou".split()
_CODAS = ["", "", "n", "r", "l", "s", "x", "m", "k", "th"]
_CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O or 1/I
_QUESTIONS = (
    "What is the access code of the {} vault?",
    "What is the access code for {}?",
    "Find the access code of the {} gate.",
    "What access code opens the {} locker?",
    "I need the access code of {}. What is it?",
)


def _word(rng: random.Random) -> str:
    syllables = rng.choice((2, 2, 3))
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    ).capitalize()


def _code(rng: random.Random) -> str:
    while True:
        code = "".join(rng.choice(_CODE_CHARS) for _ in range(rng.randint(4, 6)))
        if any(c.isdigit() for c in code) and any(c.isalpha() for c in code):
            return code


def tasks() -> list[dict[str, object]]:
    """EVAL_TASKS + TRAIN_TASKS tasks, no key or code used twice, in a fixed order."""
    rng = random.Random(27)
    used = set(re.findall(r"\w+", EXAMPLE))  # the worked example's key and code among them

    def fresh(make: Callable[[random.Random], str]) -> str:
        while True:
            value = make(rng)
            if value not in used and len(value) <= 10:
                used.add(value)
                return value

    found: list[dict[str, object]] = []
    for _ in range(EVAL_TASKS + TRAIN_TASKS):
        table = {fresh(_word): fresh(_code) for _ in range(rng.randint(4, 6))}
        key = rng.choice(list(table))
        question = rng.choice(_QUESTIONS).format(key)
        found.append({"question": question, "key": key, "table": table})
    return found


def main() -> None:
    """Write both files beside this one."""
    here = Path(__file__).parent
    found = tasks()
    splits = {"lookup_eval.jsonl": found[:EVAL_TASKS], "lookup.jsonl": found[EVAL_TASKS:]}
    for name, part in splits.items():
        (here / name).write_text("".join(json.dumps(t) + "\n" for t in part))


if __name__ == "__main__":
    main()
