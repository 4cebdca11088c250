"""vLLM: launch ``vllm.entrypoints.openai.api_server`` and talk to it over HTTP (GPU only).

Abort: closing the stream makes vLLM abort the request. Weight updates load a checkpoint
path through vLLM's development endpoint ``/collective_rpc`` (``reload_weights``), which the
launcher enables with ``VLLM_SERVER_DEV_MODE=1``. In-memory tensors need a same-GPU or
NCCL transport that lives next to the trainer, so they are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollfleet.engines.base import WeightSource
from rollfleet.engines.served import ServedEngine
from rollfleet.errors import EngineError


class VLLMEngine(ServedEngine):
    """A vLLM OpenAI server launched as a child process."""

    name = "vllm"

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
        super().__init__(
            model,
            host=host,
            port=port,
            extra_args=extra_args,
            startup_timeout_s=startup_timeout_s,
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            max_concurrency=max_concurrency,
        )
        self.extra_body = {"return_token_ids": True}

    def argv(self, model: str, host: str, port: int, extra: list[str]) -> list[str]:
        """``python -m vllm.entrypoints.openai.api_server --model … --host … --port …``."""
        return [
            self.python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            host,
            "--port",
            str(port),
            *extra,
        ]

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Reload weights from a checkpoint directory through ``/collective_rpc``."""
        if not isinstance(weights, (str, Path)):
            raise EngineError(
                "vllm: update_weights over HTTP takes a checkpoint path; stream"
                " in-memory tensors with vLLM's weight-transfer API in the trainer"
            )
        await self.post_json(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
        )
        await self.post_json("/reset_prefix_cache", {})
        return self._next_version(version)
