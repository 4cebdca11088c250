"""Engines that launch their own OpenAI-compatible server process (vLLM, SGLang).

The launcher starts the server with :class:`rollfleet.engines.served.process.ServerProcess`
(health polling, start-up timeout that kills the child), then talks to it exactly like
:class:`rollfleet.engines.served.openai.OpenAIEngine`.

Weight updates share two pieces here. :meth:`ServedEngine.checkpoint` writes named tensors
that came over the wire as a one-file safetensors checkpoint in a new directory in shared
memory (``/dev/shm`` where there is one), for the server to load from disk, and removes it
afterwards whatever happened. :meth:`ServedEngine.post_update` sends one update call and
turns a refusal (an HTTP error, or ``success: false``) into :class:`EngineError` carrying the
server's own message. The file is written here without the safetensors package: an 8-byte
little-endian header length, the JSON header (each tensor's dtype, shape and byte range),
then the tensors' bytes, one tensor at a time, so no second copy of the model is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from rollfleet.engines.base import NamedTensors
from rollfleet.engines.served.openai import OpenAIEngine
from rollfleet.engines.served.process import ServerProcess
from rollfleet.engines.weights.memfd import push_dir
from rollfleet.errors import EngineError

CHECKPOINT_FILE = "model.safetensors"
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class ServedEngine(OpenAIEngine):
    """An OpenAI engine whose server is a child process this engine owns."""

    health_path = "/health"
    weights_dir: str | None = None
    """Where pushed tensors are written as a checkpoint; None means shared memory."""

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

    @contextlib.asynccontextmanager
    async def checkpoint(self, tensors: NamedTensors) -> AsyncIterator[str]:
        """A new directory holding ``tensors`` as one safetensors file, removed on exit."""
        if self._client is None:  # refuse before writing gigabytes
            raise EngineError(f"{self.name}: engine is not started")
        try:
            directory = tempfile.mkdtemp(
                prefix=f"rollfleet-{self.name}-weights-", dir=self.weights_dir or push_dir()
            )
        except OSError as exc:
            raise EngineError(f"{self.name}: cannot make a checkpoint directory: {exc}") from exc
        try:
            path = os.path.join(directory, CHECKPOINT_FILE)
            try:
                await asyncio.to_thread(write_safetensors, path, list(tensors))
            except (ValueError, OSError) as exc:
                raise EngineError(f"{self.name}: cannot write the checkpoint: {exc}") from exc
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def post_update(self, path: str, body: dict[str, Any]) -> Any:
        """POST one weight-update call; EngineError with the server's message if refused."""
        try:
            response = await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.name}: POST {path} failed: {exc}") from exc
        try:
            reply = response.json() if response.content else None
        except ValueError:
            reply = None
        refused = isinstance(reply, dict) and reply.get("success") is False
        if response.status_code >= 400 or refused:
            raise EngineError(
                f"{self.name}: the server refused the weight update ({path}, HTTP"
                f" {response.status_code}): {server_message(reply, response.text)}"
            )
        return reply


def server_message(reply: Any, text: str) -> str:
    """The message in a server's error answer (vLLM, SGLang or FastAPI shapes)."""
    if isinstance(reply, dict):
        error = reply.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if reply.get(key):
                return str(reply[key])
    return text[:500] or "(no message)"


def write_safetensors(path: str, tensors: list[tuple[str, Any]]) -> None:
    """Write named torch tensors or numpy arrays to a new safetensors file at ``path``."""
    header = _header(tensors)
    with open(path, "xb") as out:
        out.write(header)
        for _, tensor in tensors:
            out.write(_raw(tensor))


def _header(tensors: list[tuple[str, Any]]) -> bytes:
    """The length-prefixed JSON header, padded to 8 bytes; ValueError for a bad entry."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        if name in entries:
            raise ValueError(f"tensor {name!r} is named twice")
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: {type(tensor).__name__} of dtype {dtype!r}")
        size = int(tensor.nbytes)
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [int(d) for d in tensor.shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _raw(tensor: Any) -> memoryview:
    """A tensor's bytes, row-major, without a copy when it is contiguous on the CPU."""
    if hasattr(tensor, "detach"):  # torch: bfloat16 has no numpy dtype, so go through uint8
        import torch

        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        view: memoryview = flat.numpy().data
        return view
    import numpy as np

    array = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
    return array.data
