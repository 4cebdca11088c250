"""``rag``: answer questions from a local corpus; tools ``search`` (SQLite FTS5, BM25) and ``read``.

Corpus: a JSONL file of ``{"doc_id", "title", "text"}`` (the bundled one is
``rollfleet/examples/rag_corpus.jsonl``). Task: ``{"question": str, "answers": [str, ...]}``.
Reward: the best token F1 of the final answer against the gold answers (1.0 on an exact
match after normalisation); ``correct`` means an exact match.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rollfleet.envs.base import (
    EnvSpec,
    Score,
    StaticEnv,
    Tool,
    Transcript,
    handle_of,
    normalize_answer,
    require_fields,
    token_f1,
)
from rollfleet.errors import InvalidInput, PoolError

_WORD = re.compile(r"\w+")


def bundled_corpus() -> Path:
    """Path of the corpus shipped with rollfleet."""
    return Path(str(resources.files("rollfleet.examples").joinpath("rag_corpus.jsonl")))


@dataclass(frozen=True)
class Hit:
    """One search result."""

    doc_id: str
    title: str
    snippet: str
    score: float


class RagIndex:
    """An in-memory SQLite FTS5 index over a corpus file, ranked by BM25."""

    def __init__(self, path: str | Path | None = None) -> None:
        """Load and index ``path`` (the bundled corpus by default)."""
        self.path = Path(path) if path else bundled_corpus()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(doc_id UNINDEXED, title, text)")
        self._db.executemany("INSERT INTO docs VALUES (?, ?, ?)", list(self._documents()))

    def _documents(self) -> list[tuple[str, str, str]]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InvalidInput(f"{self.path}: cannot read the corpus: {exc}") from None
        docs = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"{self.path}:{lineno}: not valid JSON: {exc.msg}") from None
            require_fields(doc, f"{self.path}:{lineno}", {"doc_id": str, "title": str, "text": str})
            docs.append((doc["doc_id"], doc["title"], doc["text"]))
        return docs

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The ``k`` best documents for the words of ``query`` (any word may match)."""
        words = _WORD.findall(query.lower())
        if not words:
            return []
        match = " OR ".join(f'"{w}"' for w in words)
        with self._lock:
            rows = self._db.execute(
                "SELECT doc_id, title, snippet(docs, 2, '', '', '…', 16), bm25(docs) FROM docs "
                "WHERE docs MATCH ? ORDER BY bm25(docs) LIMIT ?",
                (match, k),
            ).fetchall()
        return [Hit(doc_id=r[0], title=r[1], snippet=r[2], score=-float(r[3])) for r in rows]

    def read(self, doc_id: str) -> str | None:
        """A document's full text, or None when there is no such document."""
        with self._lock:
            row = self._db.execute(
                "SELECT title, text FROM docs WHERE doc_id = ?", (doc_id.strip(),)
            ).fetchone()
        return None if row is None else f"{row[0]}\n{row[1]}"

    def close(self) -> None:
        """Free the index."""
        self._db.close()


def rag_reward(answer: str, gold: list[str]) -> Score:
    """Best F1 against the gold answers; exact match gives 1.0."""
    exact = any(normalize_answer(answer) == normalize_answer(g) for g in gold)
    f1 = max(token_f1(answer, g) for g in gold)
    return Score(reward=1.0 if exact else f1, correct=exact, details={"f1": f1, "exact": exact})


class RagSession:
    """Search and read over one shared index."""

    def __init__(self, task: dict[str, Any], index: RagIndex) -> None:
        """Score against ``task['answers']``."""
        self.tools = [
            Tool(
                "search",
                "full-text search over the documents; returns ids, titles and snippets",
                {"query": "words to look for"},
            ),
            Tool("read", "read one document in full", {"doc_id": "a document id from search"}),
        ]
        self.task, self.index = task, index

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Run ``search`` or ``read``."""
        if name == "search":
            hits = self.index.search(str(args.get("query", "")))
            return "\n".join(f"[{h.doc_id}] {h.title}: {h.snippet}" for h in hits) or "no results"
        if name == "read":
            text = self.index.read(str(args.get("doc_id", "")))
            return text if text is not None else f"error: no document {args.get('doc_id')!r}"
        return f"error: unknown tool {name!r}; the tools are search and read"

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """Exact match / F1 against the gold answers."""
        return rag_reward(answer, list(self.task["answers"]))


class RagMode:
    """Retrieval-augmented question answering."""

    name = "rag"
    uses_tools = True
    resume = "replay"  # its tools are deterministic: a crashed rollout goes on from its last turn

    def check(self, task: Any, where: str) -> None:
        """``question`` and a non-empty list of string ``answers``."""
        require_fields(task, where, {"question": str, "answers": list})
        for i, answer in enumerate(task["answers"]):
            if not isinstance(answer, str) or not answer.strip():
                raise InvalidInput(f"{where}: field 'answers.{i}' must be a non-empty string")

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Explain the tools' purpose."""
        return (
            "You answer questions about a document collection. Search it, read what you need, "
            "then give only the short answer."
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The question."""
        return str(task["question"])

    async def open(self, task: dict[str, Any], env: Any) -> RagSession:
        """A session on the runner's index."""
        index = handle_of(env)
        if not isinstance(index, RagIndex):
            raise PoolError("rag mode needs the corpus index as ctx.env")
        return RagSession(task, index)

    def env_source(self, spec: EnvSpec, concurrency: int) -> StaticEnv:
        """The corpus index, shared by every rollout of the runner process."""
        index = RagIndex(spec.corpus)
        return StaticEnv(index, "rag", on_close=index.close)
