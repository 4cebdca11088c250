"""SGLang: launch ``sglang.launch_server`` and talk to it over HTTP (GPU only).

Requests carry SGLang's ``rid`` (our request id) so an abort also calls
``/abort_request``, besides closing the stream. Weight updates: a checkpoint path goes to
``/update_weights_from_disk``; in-memory tensors go bucket by bucket
(:mod:`rollfleet.engines.buckets`) to ``/update_weights_from_tensor`` with SGLang's own
serializer (same-machine handles), the way verl feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollfleet.engines.base import GenerationRequest, WeightSource
from rollfleet.engines.buckets import DEFAULT_BUCKET_BYTES, bucket_tensors
from rollfleet.engines.served import ServedEngine
from rollfleet.errors import EngineError


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
        """Load a checkpoint path, or stream tensors bucket by bucket."""
        if isinstance(weights, (str, Path)):
            reply = await self.post_json("/update_weights_from_disk", {"model_path": str(weights)})
            _check(reply)
            return self._next_version(version)
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as exc:
            raise EngineError(
                "sglang: tensor updates need the sglang package in this process"
            ) from exc
        buckets = list(bucket_tensors(weights, self.bucket_bytes))
        for index, bucket in enumerate(buckets):
            payload = MultiprocessingSerializer.serialize(bucket.items, output_str=True)
            reply = await self.post_json(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [payload],
                    "load_format": None,
                    "flush_cache": index == len(buckets) - 1,
                },
            )
            _check(reply)
        return self._next_version(version)


def _check(reply: Any) -> None:
    """Raise when SGLang answered ``success: false``."""
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(f"sglang: weight update refused: {reply.get('message')}")
