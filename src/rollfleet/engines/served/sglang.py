"""SGLang: launch ``sglang.launch_server`` and talk to it over HTTP (GPU only).

Requests carry SGLang's ``rid`` (our request id) so an abort also calls
``/abort_request``, besides closing the stream.

Weight updates use SGLang's native refit endpoints (docs.sglang.io, "SGLang for RL Systems";
the shapes follow SGLang v0.5's ``srt/entrypoints/http_server.py`` and the request records
in ``srt/managers/io_struct.py``). Both answer ``{"success": bool, "message": str, ...}``,
HTTP 200 on success and 400 on failure.

* A checkpoint path goes to ``POST /update_weights_from_disk`` with ``model_path``.
* Tensors, when ``sglang`` imports in this process, go bucket by bucket
  (:mod:`rollfleet.engines.weights.buckets`) to ``POST /update_weights_from_tensor``
  (``serialized_named_tensors`` made by SGLang's own serializer, ``load_format``,
  ``flush_cache`` on the last bucket), the way verl feeds it.
* Otherwise (the usual case: the gateway has no sglang) they are written as a safetensors
  checkpoint in shared memory (:meth:`ServedEngine.checkpoint`) and loaded with
  ``/update_weights_from_disk`` (``model_path``, ``load_format: "safetensors"``,
  ``weight_version``); the directory is removed afterwards, also when SGLang refuses. SGLang
  checks names and shapes, rolls back to the old weights on a failed load, and flushes its
  cache after a good one. It also records ``model_path`` as the served model name.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollfleet.engines.base import GenerationRequest, NamedTensors, WeightSource
from rollfleet.engines.served.engine import ServedEngine
from rollfleet.engines.weights.buckets import DEFAULT_BUCKET_BYTES, bucket_tensors


class SGLangEngine(ServedEngine):
    """An SGLang server launched as a child process."""

    name = "sglang"
    bucket_bytes = DEFAULT_BUCKET_BYTES

    def argv(self, model: str, host: str, port: int, extra: list[str]) -> list[str]:
        """``python -m sglang.launch_server --model-path … --host … --port …``."""
        return [
            self.python(),
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--host",
            host,
            "--port",
            str(port),
            *extra,
        ]

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        """The OpenAI body plus SGLang's request id, so the request can be aborted by id."""
        return {**super().body(request), "rid": request.request_id}

    async def abort(self, request_ids: Iterable[str] | None = None) -> int:
        """Abort on the server by id, then stop reading."""
        ids = list(self._tasks) if request_ids is None else list(request_ids)
        for request_id in ids:
            if request_id in self._tasks:
                await self.post_json("/abort_request", {"rid": request_id})
        return await super().abort(ids)

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Load a checkpoint path, or tensors (serialized if sglang imports, else via disk)."""
        if isinstance(weights, (str, Path)):
            await self.post_update("/update_weights_from_disk", {"model_path": str(weights)})
        elif (serializer := sglang_serializer()) is not None:
            await self.send_tensors(weights, serializer)
        else:
            async with self.checkpoint(weights) as directory:
                await self.post_update("/update_weights_from_disk", _disk_body(directory, version))
        return self._next_version(version)

    async def send_tensors(self, weights: NamedTensors, serializer: Any) -> None:
        """Stream tensors bucket by bucket to ``/update_weights_from_tensor``."""
        buckets = list(bucket_tensors(weights, self.bucket_bytes))
        for index, bucket in enumerate(buckets):
            payload = serializer.serialize(bucket.items, output_str=True)
            await self.post_update(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [payload],
                    "load_format": None,
                    "flush_cache": index == len(buckets) - 1,
                },
            )


def _disk_body(directory: str, version: int | None) -> dict[str, Any]:
    """The ``/update_weights_from_disk`` body for a checkpoint this engine wrote."""
    body: dict[str, Any] = {"model_path": directory, "load_format": "safetensors"}
    if version is not None:
        body["weight_version"] = str(version)
    return body


def sglang_serializer() -> Any | None:
    """SGLang's ``MultiprocessingSerializer`` when sglang imports in this process, else None."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return None
    return MultiprocessingSerializer
