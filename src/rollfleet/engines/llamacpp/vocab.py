"""A llama.cpp model's vocabulary and chat template without its weights: the engine's own
prompt building and token reading, for checking recorded token ids (``rollfleet replay``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollfleet.engines.base import FinishReason, GenerationRequest, SamplingParams
from rollfleet.engines.llamacpp.model import (
    ChatTemplate,
    LlamaCppModel,
    TextDecoder,
    quiet_llama_cpp,
)
from rollfleet.engines.llamacpp.scheduler import prompt_ids, read_token
from rollfleet.errors import InvalidInput


class VocabModel(LlamaCppModel):
    """A GGUF's vocabulary and chat template alone (no weights, no context): the llama.cpp
    engine's own tokenizing and rendering methods, loaded in about a second."""

    def __init__(self, path: Path) -> None:
        """Load ``path`` vocabulary-only (replaces LlamaCppModel's: no weights, no context)."""
        import llama_cpp
        from llama_cpp import _internals as internals

        quiet_llama_cpp(False)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.lib = llama_cpp
        try:
            self.model = internals.LlamaModel(path_model=str(path), params=params, verbose=True)
        except (ValueError, RuntimeError, OSError) as exc:
            raise InvalidInput(f"--model {path}: cannot read its vocabulary: {exc}") from exc
        self.n_vocab = self.model.n_vocab()
        bos = self.model.token_get_text(self.model.token_bos())
        eos = self.model.token_get_text(self.model.token_eos())
        self.template = ChatTemplate(self.model.metadata().get("tokenizer.chat_template"), bos, eos)
        self.cached = {}

    def close(self) -> None:
        """Free the vocabulary."""
        self.model.close()  # type: ignore[no-untyped-call]


class EngineTokens:
    """Token ids as the llama.cpp engine makes them, from a vocabulary-only model."""

    def __init__(self, path: Path) -> None:
        """For the GGUF at ``path``."""
        self.path = path
        self.vocab = VocabModel(path)

    def prompt(self, request: GenerationRequest) -> list[int]:
        """The prompt ids the engine builds for ``request`` (its ``prior`` set as the gateway
        set it): the engine's own prompt builder, run on the vocabulary."""
        return prompt_ids(self.vocab, request)

    def reply(self, ids: Sequence[int], params: SamplingParams) -> tuple[str, str, int]:
        """The text and finish reason the engine makes of the sampled ``ids`` (its own reading
        of each token: end-of-generation tokens, stop strings; then max_tokens), and how many
        of them it took before it finished."""
        decoder = TextDecoder()
        for n, token in enumerate(ids, start=1):
            _, end = read_token(self.vocab, decoder, token, params)
            if end is not None:
                return decoder.text, FinishReason.STOP.value, n
            if n >= params.max_tokens:
                return decoder.text, FinishReason.LENGTH.value, n
        return decoder.text, FinishReason.LENGTH.value, len(ids)  # the context ran out

    def show(self, ids: Sequence[int]) -> str:
        """Token ids with their text, for a diff."""
        texts = [
            self.vocab.piece(t).decode("utf-8", "replace") or self.vocab.token_text(t) for t in ids
        ]
        return " ".join(f"{t}:{text!r}" for t, text in zip(ids, texts, strict=True))

    def close(self) -> None:
        """Free the vocabulary."""
        self.vocab.close()
