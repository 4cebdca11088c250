"""rollfleet.engines: inference engines, the LLM gateway, weight buckets and ``ctx.llm``.

Engines (one :class:`Engine` protocol): ``llamacpp`` (default, CPU, bundled SmolLM2),
``hf`` (transformers), ``openai`` (any OpenAI-compatible server), ``vllm`` and ``sglang``
(launched child servers). Import an engine from its module; this package exports the
protocol, the records, the gateway and the builders.
"""

from rollfleet.engines.base import (
    Delta,
    Engine,
    EngineInfo,
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
)
from rollfleet.engines.buckets import Bucket, bucket_tensors
from rollfleet.engines.client import llm_client
from rollfleet.engines.factory import EngineKind, build_gateway, make_engine
from rollfleet.engines.gateway import Gateway, Recorder
from rollfleet.engines.gateway_app import (
    gateway_app,
    gateway_router,
    running_gateway,
    serve_gateway,
)

__all__ = [
    "Bucket",
    "Delta",
    "Engine",
    "EngineInfo",
    "EngineKind",
    "FinishReason",
    "Gateway",
    "Generation",
    "GenerationRequest",
    "Recorder",
    "SamplingParams",
    "bucket_tensors",
    "build_gateway",
    "gateway_app",
    "gateway_router",
    "llm_client",
    "make_engine",
    "running_gateway",
    "serve_gateway",
]
