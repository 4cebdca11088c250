"""Writes the bundled arithmetic split for ``rollfleet train`` (arith.jsonl, arith_eval.jsonl).

Every sum and difference of two numbers from 1 to 20 (differences not negative) and every product
of two from 2 to 9, each once, shuffled with a fixed seed: the first 100 are the held-out eval
split, the rest train. Why arithmetic: the bundled 135M model knows most of these facts but buries
the answer in rambling (10% right at temperature 1, 23% greedy, by the math mode's final-number
rule), which is what a few minutes of RL on a CPU can fix. Run: ``python -m
rollfleet.examples.make_arith``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EVAL_TASKS = 100


def tasks() -> list[dict[str, object]]:
    """Every question once, in a fixed shuffled order."""
    found: list[dict[str, object]] = []
    for a in range(1, 21):
        for b in range(1, 21):
            found.append({"question": f"What is {a} + {b}?", "answer": a + b})
            if a >= b:
                found.append({"question": f"What is {a} - {b}?", "answer": a - b})
    for a in range(2, 10):
        for b in range(2, 10):
            found.append({"question": f"What is {a} times {b}?", "answer": a * b})
    random.Random(18).shuffle(found)
    return found


def main() -> None:
    """Write both files beside this one."""
    here = Path(__file__).parent
    found = tasks()
    splits = {"arith_eval.jsonl": found[:EVAL_TASKS], "arith.jsonl": found[EVAL_TASKS:]}
    for name, part in splits.items():
        (here / name).write_text("".join(json.dumps(t) + "\n" for t in part))


if __name__ == "__main__":
    main()
