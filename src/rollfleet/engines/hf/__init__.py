"""Hugging Face transformers engines (CPU or GPU).

:mod:`~rollfleet.engines.hf.engine` is :class:`HFEngine`: one worker thread owns the model and
decodes the requests in one batch they join and leave; pushed weights (whole, a delta, or a LoRA
adapter merged on the base weights) go into a standby copy of the model (by default) that is
swapped in between two decode steps. :mod:`~rollfleet.engines.hf.batch` is that decoding
(sampling and stop strings as the llama.cpp engines do them, from
:mod:`rollfleet.engines.llamacpp.model`), and
:mod:`~rollfleet.engines.hf.vision` the vision-language variant with its image-embedding cache.
``torch`` and ``transformers`` are imported inside the functions that use them, never when these
modules are.
"""

from rollfleet.engines.hf.engine import HFEngine

__all__ = ["HFEngine"]
