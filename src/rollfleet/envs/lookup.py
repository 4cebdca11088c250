"""``lookup``: find a made-up key's code with the ``lookup`` tool, then answer with it.

Task: ``{"question": str, "key": str, "table": {key: code, ...}}``. The table (the target key
and a few distractors) is never shown to the model: its only way to the code is
``lookup {"key": ...}``, which returns ``<key>: <code>`` (``no entry for <key>`` otherwise). A
query names a key when it equals it ignoring case and spaces, or when exactly one of the
table's keys is a word of it (``"Zerbin vault"`` finds ``Zerbin``).

Codes are random, so only a lookup can find one. Reward: 1.0 when the final answer holds the
target's code as a whole token and no other table code; else 0.25 when a lookup found the target
key (counted once); else 0. ``correct`` means the code is in the answer. The partial credit is
there because the untrained 135M model rarely gets the code into its answer (on the 64 held-out
tasks, 3 tool calls: 2 of 64 at temperature 1, 1 of 64 greedy), so without it most GRPO groups
would score all zero; 14% of its temperature-1 replies call the tool with the right key.
"""

from __future__ import annotations

import re
from typing import Any

from rollfleet.envs.base import Score, Tool, Transcript, require_fields
from rollfleet.errors import InvalidInput

MAX_ENTRIES = 64
MAX_CHARS = 64
RIGHT_KEY_CREDIT = 0.25
_WORD = re.compile(r"[^\W_]+")

EXAMPLE = (
    "Example:\n"
    'User: What is the access code of the Quorvane vault?\n(key: "Quorvane")\n'
    'Assistant: CALL lookup {"key": "Quorvane"}\n'
    "User: Observation from lookup:\nQuorvane: 8KX3Q\n"
    "Assistant: ANSWER: 8KX3Q"
)
# After the example, not before it: measured on the bundled 135M model, the rule last about
# doubles the chance that a reply at temperature 1 is the right call.
RULE = "Codes are secret: always CALL lookup first, never guess."


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def resolve(query: str, table: dict[str, str]) -> str | None:
    """The table key a lookup query names (exact ignoring case and spaces, else the one key that
    is a word of the query), or None."""
    wanted = _norm(query.strip(" \t\n\"'`.?!"))
    exact = [k for k in table if _norm(k) == wanted]
    if exact:
        return exact[0]
    words = " " + " ".join(_WORD.findall(wanted)) + " "
    inside = [k for k in table if _WORD.fullmatch(_norm(k)) and f" {_norm(k)} " in words]
    return inside[0] if len(inside) == 1 else None


def has_code(answer: str, code: str) -> bool:
    """Whether ``code`` appears in ``answer`` as a whole token (not inside a longer one)."""
    return re.search(rf"(?<![^\W_]){re.escape(code)}(?![^\W_])", answer) is not None


def lookup_reward(answer: str, key: str, table: dict[str, str], called_right_key: bool) -> Score:
    """1.0 for the target's code (alone among the table's codes) in the answer; else 0.25 when a
    lookup found the target key; else 0."""
    code = table[key]
    others = sorted({c for k, c in table.items() if k != key and c != code and has_code(answer, c)})
    correct = has_code(answer, code) and not others
    reward = 1.0 if correct else RIGHT_KEY_CREDIT if called_right_key else 0.0
    return Score(
        reward=reward,
        correct=correct,
        details={
            "called_right_key": called_right_key,
            "code_in_answer": correct,
            "other_codes_in_answer": others,
            "expected": code,
        },
    )


class LookupSession:
    """One tool, ``lookup``, over the task's private table."""

    def __init__(self, task: dict[str, Any]) -> None:
        """Answer lookups from ``task['table']``; score against ``task['key']``'s code."""
        self.tools = [
            Tool(
                "lookup",
                "returns the access code stored under a key",
                {"key": "the name to look up, e.g. Quorvane"},
            )
        ]
        self.key: str = task["key"]
        self.table: dict[str, str] = dict(task["table"])
        self.called_right_key = False

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Run ``lookup``: ``<key>: <code>``, or ``no entry for <key>``."""
        if name != "lookup":
            return f"error: unknown tool {name!r}; the only tool is lookup"
        query = args.get("key")
        if not isinstance(query, str) or not query.strip():
            return 'error: lookup needs a key, e.g. CALL lookup {"key": "Quorvane"}'
        found = resolve(query, self.table)
        if found is None:
            return f"no entry for {query.strip()[:MAX_CHARS]}"
        self.called_right_key = self.called_right_key or found == self.key
        return f"{found}: {self.table[found]}"

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """The code in the answer, else partial credit for having looked up the right key."""
        return lookup_reward(answer, self.key, self.table, self.called_right_key)


class LookupMode:
    """Look a key's code up with a tool; the code cannot be guessed."""

    name = "lookup"
    uses_tools = True
    resume = "replay"  # its tools are deterministic: a crashed rollout goes on from its last turn

    def check(self, task: Any, where: str) -> None:
        """``question``, ``key``, and a ``table`` of at most 64 string keys and codes holding the
        key."""
        require_fields(task, where, {"question": str, "key": str, "table": dict})
        table = task["table"]
        if len(table) > MAX_ENTRIES:
            raise InvalidInput(
                f"{where}: field 'table' has {len(table)} entries; at most {MAX_ENTRIES}"
            )
        if len(task["key"]) > MAX_CHARS:
            raise InvalidInput(f"{where}: field 'key' is longer than {MAX_CHARS} characters")
        for name, code in table.items():
            if not isinstance(name, str):
                raise InvalidInput(f"{where}: field 'table' keys must be str, got {name!r}")
            field = f"table.{name[:MAX_CHARS]}"
            if not name.strip() or len(name) > MAX_CHARS:
                raise InvalidInput(f"{where}: field {field!r}: a key must be 1 to 64 characters")
            if not isinstance(code, str):
                raise InvalidInput(
                    f"{where}: field {field!r} must be str, got {type(code).__name__}"
                )
            if not code.strip() or len(code) > MAX_CHARS:
                raise InvalidInput(f"{where}: field {field!r}: a code must be 1 to 64 characters")
        if task["key"] not in table:
            raise InvalidInput(f"{where}: field 'key' {task['key']!r} is not in the table")
        codes = list(table.values())
        if codes.count(table[task["key"]]) > 1:
            raise InvalidInput(f"{where}: field 'table': the key's code is not unique in the table")

    def system_prompt(self, task: dict[str, Any]) -> str:
        """One worked exchange with another key, then the rule (the loop adds the tool)."""
        return f"{EXAMPLE}\n{RULE}"

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The question, and the key to look up on a line of its own, as in the example."""
        return f'{task["question"]}\n(key: "{task["key"]}")'

    async def open(self, task: dict[str, Any], env: Any) -> LookupSession:
        """A session over the task's table (no environment needed)."""
        return LookupSession(task)
