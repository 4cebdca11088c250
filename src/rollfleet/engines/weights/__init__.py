"""Weights from a trainer to the engines.

:mod:`~rollfleet.engines.weights.push` is the trainer's side: :func:`push_weights` sends named
tensors to a gateway (an object in this process, or a URL), whole or as a delta that
:func:`snapshot` and :func:`changed` find. :mod:`~rollfleet.engines.weights.wire` is the push
format (framed, checksummed buckets over HTTP, or a sealed memfd on the same host) and
:mod:`~rollfleet.engines.weights.buckets` packs named tensors into bounded buckets.
:mod:`~rollfleet.engines.weights.lora` holds LoRA adapters sent as weights, and
:mod:`~rollfleet.engines.weights.gguf_export` writes trainer tensors and adapters as the GGUF files
llama.cpp loads. The engines use these pieces; only :mod:`~rollfleet.engines.weights.push` sits
above the gateway (it can push to a :class:`~rollfleet.engines.gateway.gateway.Gateway` in this
process), and it imports the gateway only when it pushes.
"""

from rollfleet.engines.weights.push import changed, push_weights, snapshot

__all__ = ["changed", "push_weights", "snapshot"]
