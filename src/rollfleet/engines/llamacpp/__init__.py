"""llama.cpp engines (llama-cpp-python, CPU): the default engine and its relatives.

:mod:`~rollfleet.engines.llamacpp.engine` is :class:`LlamaCppEngine`, continuous batching over one
model and one context, its loop and prefix cache in :mod:`~rollfleet.engines.llamacpp.scheduler`.
:mod:`~rollfleet.engines.llamacpp.model` is what every llama.cpp engine
shares: the bundled GGUF, chat templates, sampling, and the model with its multi-sequence context.
:mod:`~rollfleet.engines.llamacpp.slots` is the several-instances design kept for measurement,
:mod:`~rollfleet.engines.llamacpp.vision` a vision GGUF with its projector, and
:mod:`~rollfleet.engines.llamacpp.vocab` the vocabulary and chat template without the weights, for
checking recorded token ids. Pushed tensors reach llama.cpp as a GGUF file written by
:mod:`rollfleet.engines.weights.gguf_export`. ``llama_cpp`` itself is imported inside the
functions that use it, never when these modules are.
"""

from rollfleet.engines.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]
