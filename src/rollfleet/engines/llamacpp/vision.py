"""llama.cpp with a multimodal projector (``mmproj``): images through llama-cpp-python's MTMD
chat handler.

The batching :class:`~rollfleet.engines.llamacpp.engine.LlamaCppEngine` drives ``llama_decode``
itself and has no image path; without a projector it is not vision-capable and refuses images
(HTTP 400). Given a projector file (the ``mmproj-*.gguf`` published beside a vision model's
GGUF), :class:`LlamaCppVisionEngine` loads the model as a ``llama_cpp.Llama`` with
``MTMDChatHandler(clip_model_path=...)`` and serves one request at a time on its worker
thread through ``create_chat_completion(stream=True)``, which encodes the images and prefills
them with the text. What this path cannot give, it says: completion token ids are the streamed
text tokenized again (llama-cpp-python's chat stream yields text, not ids), the prompt's ids
are not known (the images are embeddings, not tokens), and log-probabilities are not reported
(they need ``logits_all``: a context-sized copy of the logits). For training on images use the
HF vision engine, which has all three.

No projector file ships with rollfleet and none can be downloaded here: the file checks are
tested; the generation path has not run on this machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from rollfleet.engines.base import Delta, FinishReason, GenerationRequest, WeightSource
from rollfleet.engines.llamacpp.model import bundled_gguf
from rollfleet.engines.threaded import STOP, Pending, ThreadedEngine
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")


def check_projector(path: str | Path) -> Path:
    """``path`` as a projector file that exists and is a GGUF (EngineError naming it if not)."""
    projector = Path(path)
    if not projector.is_file():
        raise EngineError(f"llamacpp: projector (mmproj) file {projector} does not exist")
    with projector.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise EngineError(
            f"llamacpp: {projector} is not a GGUF projector (mmproj) file"
            f" (it starts {magic!r}, a GGUF starts b'GGUF')"
        )
    return projector


class LlamaCppVisionEngine(ThreadedEngine):
    """A llama.cpp vision model and its projector, one request at a time (see the module)."""

    name = "llamacpp-vision"
    vision = True

    def __init__(
        self,
        model_path: str | Path | None,
        mmproj: str | Path,
        *,
        n_ctx: int = 4096,
        threads: int | None = None,
        verbose: bool = False,
    ) -> None:
        self.path = Path(model_path) if model_path else bundled_gguf()
        self.mmproj = check_projector(mmproj)
        super().__init__(self.path.stem)
        self.n_ctx, self.verbose = n_ctx, verbose
        self.threads = threads or max(1, len(os.sched_getaffinity(0)))
        self.llm: Any = None

    async def start(self) -> None:
        """Load the model with its projector and start the worker thread."""
        if self._thread is not None:
            return
        self.llm = await asyncio.to_thread(self._load, self.path)
        self.start_worker()
        log.info("llamacpp-vision: serving %s with projector %s", self.path, self.mmproj)

    def _load(self, path: Path) -> Any:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import MTMDChatHandler

        try:
            handler = MTMDChatHandler(clip_model_path=str(self.mmproj), verbose=self.verbose)
            return Llama(
                str(path),
                chat_handler=handler,
                n_ctx=self.n_ctx,
                n_threads=self.threads,
                verbose=self.verbose,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise EngineError(
                f"llamacpp-vision: cannot load {path} with projector {self.mmproj}: {exc}"
            ) from exc

    async def update_weights(self, weights: WeightSource, version: int | None = None) -> int:
        """Load another GGUF (a path) between two requests; tensors are refused."""
        if not isinstance(weights, (str, Path)):
            raise EngineError("llamacpp-vision: weight updates take a GGUF path, not tensors")
        new = await asyncio.to_thread(self._load, Path(weights))

        def swap() -> int:
            self.llm, self.path = new, Path(weights)
            return self._next_version(version)

        return await self.on_worker(swap)

    # -- worker thread -----------------------------------------------------------------
    def work(self) -> None:
        """The worker thread: run requests one at a time, and control calls between them."""
        while (item := self.inbox.get()) is not STOP:
            if isinstance(item, Pending):
                try:
                    self._run(item)
                except Exception as exc:  # a model error fails its request, never hangs it
                    log.exception("llamacpp-vision: generation failed")
                    item.finish(EngineError(f"llamacpp-vision: generation failed: {exc!r}"))
            elif callable(item):
                item()
        self.llm = None

    def _run(self, pending: Pending) -> None:
        """Stream one chat completion; an abort closes the stream after the current token."""
        request: GenerationRequest = pending.request
        if request.messages is None:
            raise EngineError("llamacpp-vision: only chat requests (images come in messages)")
        p = request.params
        chunks = self.llm.create_chat_completion(
            messages=request.messages,
            stream=True,
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop=list(p.stop) or None,
        )
        text, finish = "", FinishReason.LENGTH
        ids: list[int] = []
        for chunk in chunks:
            if pending.aborted.is_set():
                finish = FinishReason.ABORT
                break
            choice = chunk["choices"][0]
            piece = choice.get("delta", {}).get("content") or ""
            if piece:
                tokens = self.llm.tokenize(piece.encode(), add_bos=False, special=True)
                text, ids = text + piece, ids + list(tokens)
                pending.emit(Delta(piece, tuple(tokens)))
            if choice.get("finish_reason"):
                stopped = choice["finish_reason"] == "stop"
                finish = FinishReason.STOP if stopped else FinishReason.LENGTH
        chunks.close()
        pending.finish(self.result(request, text, [], ids, None, finish))
