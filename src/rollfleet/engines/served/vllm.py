"""vLLM: launch ``vllm.entrypoints.openai.api_server`` and talk to it over HTTP (GPU only).

Abort: closing the stream makes vLLM abort the request.

Weight updates reload from disk through vLLM's development endpoint ``POST /collective_rpc``,
which the launcher enables with ``VLLM_SERVER_DEV_MODE=1``. The body names a worker method
and its arguments (``{"method", "args", "kwargs", "timeout"}``); vLLM answers
``{"results": [...]}``, one per worker, or an error body ``{"error": {"message", "type",
"code"}}``. The method is the worker's ``reload_weights(weights_path=...,
is_checkpoint_format=True)``, the layerwise in-place reload of
``vllm.model_executor.model_loader.reload`` (docs.vllm.ai, "Layerwise (Re)loading" and the
API reference of that module): it points the model config at ``weights_path``, reads the
safetensors found there and loads them into the running model without re-initialising it
(vLLM's loaders check names and shapes). The shape of the calls follows vLLM 0.28: the dev
RPC router (``vllm/entrypoints/serve/dev/rpc/api_router.py``), the reload module, and the
request vLLM's maintainers use in vllm-project/vllm PR #48284 (``POST /collective_rpc
{"method": "reload_weights", "kwargs": {"weights_path": …, "is_checkpoint_format": true}}``;
issue #48312 runs it on 0.28.1rc1). An older vLLM whose ``reload_weights()`` takes no path
refuses the keyword, and that comes back as an :class:`EngineError`. Then
``POST /reset_prefix_cache`` drops KV blocks computed with the old weights.

Tensors pushed over the wire are written as a safetensors checkpoint in shared memory
first (:meth:`ServedEngine.checkpoint`) and the directory is removed afterwards, also when
vLLM refuses. vLLM's HTTP weight-transfer routes (``/init_weight_transfer_engine``,
``/update_weights``; docs.vllm.ai "Weight Transfer") need an NCCL, CUDA IPC or RDT
transport on the trainer's side, so they do not fit tensors that arrive as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollfleet.engines.base import WeightSource
from rollfleet.engines.served.engine import ServedEngine


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
        """Reload from a checkpoint directory, or from tensors written as one in shared memory."""
        if isinstance(weights, (str, Path)):
            await self.reload(str(weights))
        else:
            async with self.checkpoint(weights) as directory:
                await self.reload(directory)
        return self._next_version(version)

    async def reload(self, directory: str) -> None:
        """Have every vLLM worker reload its weights from ``directory``, then drop the cache."""
        await self.post_update(
            "/collective_rpc",
            {
                "method": "reload_weights",
                "kwargs": {"weights_path": directory, "is_checkpoint_format": True},
            },
        )
        await self.post_update("/reset_prefix_cache", {})
