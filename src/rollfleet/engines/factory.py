"""Build engines and a gateway from names (for the CLI and ``rollfleet serve``)."""

from __future__ import annotations

import enum
import json
import logging
from pathlib import Path

from rollfleet.engines.base import Engine
from rollfleet.engines.gateway.gateway import Gateway, Recorder
from rollfleet.errors import InvalidInput

log = logging.getLogger("rollfleet.engines")


class EngineKind(str, enum.Enum):
    """The engines rollfleet ships."""

    LLAMACPP = "llamacpp"
    HF = "hf"
    OPENAI = "openai"
    VLLM = "vllm"
    SGLANG = "sglang"


def make_engine(
    kind: EngineKind | str,
    *,
    model: str | None = None,
    url: str | None = None,
    port: int = 8000,
    index: int = 0,
    mmproj: str | None = None,
) -> Engine:
    """An engine of ``kind`` (not started); ``index`` offsets ports for several replicas; a
    llama.cpp engine given a projector file (``mmproj``) takes images."""
    kind = EngineKind(kind)
    if mmproj and kind is not EngineKind.LLAMACPP:
        raise InvalidInput(f"--mmproj is a llama.cpp projector; engine {kind.value!r} takes none")
    if kind is EngineKind.LLAMACPP and mmproj:
        from rollfleet.engines.llamacpp.vision import LlamaCppVisionEngine

        return LlamaCppVisionEngine(model, mmproj)
    if kind is EngineKind.LLAMACPP:
        from rollfleet.engines.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine(model)
    if kind is EngineKind.HF:
        return _hf_engine(model)
    if kind is EngineKind.OPENAI:
        from rollfleet.engines.served.openai import OpenAIEngine

        if not url:
            raise InvalidInput("engine 'openai' needs --engine-url (the server's base URL)")
        return OpenAIEngine(url, model)
    if not model:
        raise InvalidInput(f"engine {kind.value!r} needs --model (a model name or path)")
    if kind is EngineKind.VLLM:
        from rollfleet.engines.served.vllm import VLLMEngine

        return VLLMEngine(model, port=port + index)
    from rollfleet.engines.served.sglang import SGLangEngine

    return SGLangEngine(model, port=port + index)


def _hf_engine(model: str | None) -> Engine:
    """The HF engine for ``model``: a vision-language model (``tiny-vlm``, or a checkpoint whose
    config has a ``vision_config``) gets the engine that takes images."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    if not model or model == "tiny":
        return HFEngine(*tiny_hf_model())
    if model == "tiny-vlm" or _is_vision_checkpoint(model):
        from rollfleet.engines.hf.vision import HFVisionEngine
        from rollfleet.engines.tiny import tiny_vlm

        return HFVisionEngine(*tiny_vlm()) if model == "tiny-vlm" else HFVisionEngine(model)
    return HFEngine(model)


def _is_vision_checkpoint(model: str) -> bool:
    """Whether a local checkpoint directory holds a vision-language model."""
    config = Path(model) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


async def build_gateway(
    kind: EngineKind | str = EngineKind.LLAMACPP,
    *,
    replicas: int = 1,
    model: str | None = None,
    url: str | None = None,
    recorder: Recorder | None = None,
    engine_port: int = 8000,
    mmproj: str | None = None,
) -> Gateway:
    """Start ``replicas`` engines of ``kind`` and a gateway routing to them."""
    if replicas < 1:
        raise InvalidInput(f"--replicas must be at least 1, got {replicas}")
    gateway = Gateway(recorder)
    try:
        for index in range(replicas):
            engine = make_engine(
                kind, model=model, url=url, port=engine_port, index=index, mmproj=mmproj
            )
            await engine.start()
            gateway.add_replica(engine)
    except BaseException:
        await gateway.close()
        raise
    return gateway
