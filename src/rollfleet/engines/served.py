"""Engines that launch their own OpenAI-compatible server process (vLLM, SGLang).

The launcher starts the server with :class:`rollfleet.engines.process.ServerProcess`
(health polling, start-up timeout that kills the child), then talks to it exactly like
:class:`rollfleet.engines.openai_engine.OpenAIEngine`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollfleet.engines.openai_engine import OpenAIEngine
from rollfleet.engines.process import ServerProcess


class ServedEngine(OpenAIEngine):
    """An OpenAI engine whose server is a child process this engine owns."""

    health_path = "/health"

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
        max_concurrency: int = 256,
    ) -> None:
        super().__init__(f"http://{host}:{port}", model, max_concurrency=max_concurrency)
        self.host, self.port = host, port
        self.server = ServerProcess(
            self.name,
            self.argv(model, host, port, list(extra_args)),
            f"http://{host}:{port}{self.health_path}",
            startup_timeout_s=startup_timeout_s,
            env=env,
        )

    def argv(self, model: str, host: str, port: int, extra: list[str]) -> list[str]:
        """The server's command line (subclasses implement)."""
        raise NotImplementedError

    @staticmethod
    def python() -> str:
        """The interpreter that runs the server: the one running rollfleet."""
        return sys.executable

    async def start(self) -> None:
        """Launch the server, wait until healthy, then connect."""
        await self.server.start()
        await super().start()

    async def stop(self) -> None:
        """Disconnect and stop the server process."""
        await super().stop()
        await self.server.stop()

    async def health(self) -> bool:
        """True while the server process runs and answers its health check."""
        if not self.server.running:
            return False
        try:
            return (await self.client.get(self.health_path, timeout=5.0)).status_code == 200
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
