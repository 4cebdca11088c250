"""rollfleet.engines: inference engines, the LLM gateway, weight pushes and ``ctx.llm``.

Engines (one :class:`Engine` protocol): ``llamacpp`` (default, CPU, bundled SmolLM2;
:mod:`rollfleet.engines.llamacpp`), ``hf`` (transformers; :mod:`rollfleet.engines.hf`), and in
:mod:`rollfleet.engines.served` ``openai`` (any OpenAI-compatible server), ``vllm`` and ``sglang``
(launched child servers). :mod:`rollfleet.engines.gateway` is the gateway in front of them and
:mod:`rollfleet.engines.weights` how a trainer's weights reach them. The modules at this level
are what those share: the protocol and its records (``base``), images, tool calls and token-in
across turns, the worker-thread engine (``threaded``), the echo engine, tiny offline models, and
the builders (``factory``). Import an engine from its package; this package exports the
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
from rollfleet.engines.factory import EngineKind, build_gateway, make_engine
from rollfleet.engines.gateway.app import (
    gateway_app,
    gateway_router,
    running_gateway,
    serve_gateway,
)
from rollfleet.engines.gateway.client import llm_client
from rollfleet.engines.gateway.gateway import Gateway, Recorder
from rollfleet.engines.weights.buckets import Bucket, bucket_tensors

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
