"""``rollfleet run --engine URL --model gpt-…``: a hosted OpenAI-compatible model gets the user's API key.

OpenAI itself cannot be reached from the test machines, so a stand-in plays it: a small
OpenAI-compatible HTTP server on 127.0.0.1, started inside the test, that records each request's
``Authorization`` header and model and answers every chat completion with the same final answer.
At each request it also reads every process's command line, to check that the key never appears
on a runner's (``/proc/*/cmdline`` is world-readable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(150)
KEYS = ("sk-test-123", "sk-flag-456", "sk-env-789")


@dataclass
class StandinOpenAI:
    """What the stand-in server saw."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def cmdlines_with(words: tuple[str, ...]) -> list[str]:
    """Command lines of the processes on this machine that contain any of ``words``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process exited meanwhile
            continue
        if any(w in line for w in words):
            found.append(line)
    return found


@pytest.fixture
def standin() -> Iterator[StandinOpenAI]:
    seen = StandinOpenAI("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(
                self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"
            )
            with seen.lock:
                seen.requests.append(
                    {
                        "path": self.path,
                        "authorization": self.headers.get("Authorization"),
                        "model": body.get("model"),
                        "cmdlines": cmdlines_with(KEYS),
                    }
                )
            if not self.path.endswith("/v1/chat/completions"):
                self.answer(
                    404, {"error": {"message": f"no route {self.path}", "type": "not_found"}}
                )
                return
            self.answer(
                200,
                {
                    "id": "chatcmpl-standin",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "The answer is #### 2"},
                        }
                    ],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
                },
            )

        def answer(self, status: int, payload: dict[str, Any]) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    seen.url = f"http://127.0.0.1:{server.server_port}/v1"
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def two_tasks(tmp_path: Path) -> Path:
    data = tmp_path / "two.jsonl"
    data.write_text(
        '{"question": "What is 1 + 1?", "answer": 2}\n{"question": "What is 4 - 2?", "answer": 2}\n'
    )
    return data


def run_hosted(
    tmp_path: Path, url: str, env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "ROLLFLEET_LLM_TOKEN")
    }
    argv = [
        sys.executable,
        "-m",
        "rollfleet.cli",
        "run",
        "--mode",
        "math",
        "--data",
        str(two_tasks(tmp_path)),
        "--engine",
        url,
        "--model",
        "gpt-test",
        "--limit",
        "2",
        "--max-turns",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        *extra,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, env={**clean, **env}
    )


@pytest.mark.parametrize(
    ("env", "extra", "key"),
    [
        ({"OPENAI_API_KEY": "sk-test-123"}, (), "sk-test-123"),
        ({"OPENAI_API_KEY": "sk-test-123"}, ("--llm-token", "sk-flag-456"), "sk-flag-456"),
        ({"OPENAI_API_KEY": "sk-test-123", "ROLLFLEET_LLM_TOKEN": "sk-env-789"}, (), "sk-env-789"),
    ],
    ids=["openai-api-key", "llm-token-flag-overrides", "rollfleet-llm-token-env-overrides"],
)
def test_hosted_model_gets_the_users_key_against_a_standin_openai_server(
    standin: StandinOpenAI, tmp_path: Path, env: dict[str, str], extra: tuple[str, ...], key: str
) -> None:
    done = run_hosted(tmp_path, standin.url, env, *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (
        summary["counts"] == {"succeeded": 2} and summary["reward"]["mean"] == 1.0
    )  # the replies were scored
    assert len(standin.requests) == 2  # one turn per rollout, no retries
    for request in standin.requests:
        assert request["path"] == "/v1/chat/completions" and request["model"] == "gpt-test"
        assert request["authorization"] == f"Bearer {key}"
        # the key reached the runner process through its environment: no runner's argv holds it
        assert not [c for c in request["cmdlines"] if "rollfleet.runner.child" in c]
        if not extra:  # and given in the environment, it is on no command line at all
            assert request["cmdlines"] == []


def test_hosted_model_without_any_key_refuses_before_starting_against_a_standin_openai_server(
    standin: StandinOpenAI, tmp_path: Path
) -> None:
    done = run_hosted(tmp_path, standin.url, {})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no API key; set OPENAI_API_KEY or pass --llm-token" in done.stderr
    assert (
        standin.requests == [] and not (tmp_path / "out").exists()
    )  # no placeholder key was ever sent
