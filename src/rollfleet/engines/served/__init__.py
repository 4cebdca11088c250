"""Engines that another process serves, over the OpenAI-compatible HTTP API.

:mod:`~rollfleet.engines.served.openai` is :class:`OpenAIEngine`, for any such server (vLLM,
SGLang, llama.cpp server, Ollama, OpenAI). :mod:`~rollfleet.engines.served.engine` is
:class:`ServedEngine`, an OpenAI engine that launches and owns its server
(:mod:`~rollfleet.engines.served.process`: health polling, start-up timeout, a clean stop) and
writes pushed tensors as a safetensors checkpoint for it to load.
:mod:`~rollfleet.engines.served.vllm` and :mod:`~rollfleet.engines.served.sglang` launch vLLM and
SGLang and drive their weight-update endpoints; neither package is imported to serve, their
servers run as child processes.
"""

from rollfleet.engines.served.engine import ServedEngine
from rollfleet.engines.served.openai import OpenAIEngine

__all__ = ["OpenAIEngine", "ServedEngine"]
