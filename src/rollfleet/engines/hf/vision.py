"""Vision-language models on the transformers engine (Idefics3 / SmolVLM), with image delta.

:class:`HFVisionEngine` is :class:`~rollfleet.engines.hf.engine.HFEngine` (the same worker thread,
batching, streaming, log-probabilities, aborts and weight swaps) for a model that also takes
images: a chat request's ``image_url`` parts become the processor's image tokens in the prompt,
and at prefill the vision encoder's output is written over those tokens' embeddings.

Image delta: agents resend the whole conversation every turn, so turn ``n`` holds ``n``
screenshots of which one is new. The encoder's output (after the connector: the image's
embeddings in the language model's space) is kept in :class:`ImageCache`, an LRU keyed by the
image's SHA-256 and bounded in bytes, so each image is encoded once: a 5-turn conversation with
one new screenshot a turn costs 5 encoder calls, not 15. Entries belong to one weights version:
after an update an image is encoded again under the new weights (and a request running across
the swap re-encodes its images when its KV cache is recomputed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rollfleet.engines.base import GenerationRequest, Message
from rollfleet.engines.hf.engine import HFEngine
from rollfleet.engines.images import ImageInput, is_image_part
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class EncodedImage:
    """One image through the vision encoder and connector: its embeddings, tiling and version."""

    sha256: str
    features: Any  # (image tokens, hidden) tensor
    rows: int
    cols: int
    version: int

    @property
    def nbytes(self) -> int:
        """Memory the embeddings hold."""
        return int(self.features.numel() * self.features.element_size())


class ImageCache:
    """Encoded images by SHA-256, least recently used evicted first, at most ``max_bytes``.

    Used on the engine's worker thread only. An entry of another weights version is a miss
    (and is dropped). ``max_bytes=0`` keeps nothing."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, EncodedImage] = OrderedDict()

    def get(self, sha256: str, version: int) -> EncodedImage | None:
        """The entry for ``sha256`` under weights ``version``, or None."""
        entry = self._entries.get(sha256)
        if entry is not None and entry.version != version:
            self._drop(sha256)
            entry = None
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(sha256)
        self.hits += 1
        return entry

    def put(self, entry: EncodedImage) -> None:
        """Keep ``entry`` (unless it alone is over the bound), evicting the oldest to fit."""
        if entry.nbytes > self.max_bytes:
            return
        if entry.sha256 in self._entries:
            self._drop(entry.sha256)
        self._entries[entry.sha256] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, sha256: str) -> None:
        self.bytes -= self._entries.pop(sha256).nbytes

    def __len__(self) -> int:
        return len(self._entries)


def hf_messages(messages: list[Message]) -> list[Message]:
    """OpenAI messages in the shape processors' chat templates take: an image part becomes
    ``{"type": "image"}``, a text part ``{"type": "text", "text": ...}``."""
    shaped = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image"}
                if is_image_part(part)
                else {"type": "text", "text": str(part.get("text", ""))}
                for part in content
                if isinstance(part, dict)
            ]
        shaped.append({**message, "content": "" if content is None else content})
    return shaped


class HFVisionEngine(HFEngine):
    """A transformers vision-language model (Idefics3 / SmolVLM) served like ``HFEngine``,
    with each image's encoder output cached by hash across a conversation's turns."""

    name = "hf-vision"
    vision = True

    def __init__(
        self,
        model: str | Any,
        processor: Any | None = None,
        *,
        image_cache_bytes: int = DEFAULT_CACHE_BYTES,
        **options: Any,
    ) -> None:
        super().__init__(model, None, **options)
        self._processor_source = processor
        self.processor: Any = None
        self.images = ImageCache(image_cache_bytes)
        self.encoder_calls = 0  # images run through the vision encoder (worker thread)

    def _load(self) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        local = self.local_files_only
        try:
            if isinstance(self._source, str):
                self.hf_model = AutoModelForImageTextToText.from_pretrained(
                    self._source, local_files_only=local
                )
            else:
                self.hf_model = self._source
            source = self._processor_source or self._source
            self.processor = (
                AutoProcessor.from_pretrained(source, local_files_only=local)  # type: ignore[no-untyped-call]
                if isinstance(source, str)
                else source
            )
        except (OSError, ValueError) as exc:
            raise EngineError(f"hf-vision: cannot load model {self.model!r}: {exc}") from exc
        if not hasattr(self.processor, "replace_image_token"):
            raise EngineError(
                f"hf-vision: {type(self.processor).__name__} is not an Idefics3/SmolVLM processor"
            )
        self.tokenizer = self.processor.tokenizer
        self.hf_model.to(self.device).eval()

    # -- worker thread -----------------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> tuple[list[int], Any]:
        """The prompt with each image's tokens laid out (its tiles and global view), and the
        images' embeddings (from the cache, or encoded now)."""
        if request.messages is None:
            return self.prompt_ids(request), None
        encoded = [(image, self.encoded(image)) for image in request.images]
        text = self.processor.apply_chat_template(
            hf_messages(request.messages), tokenize=False, add_generation_prompt=True
        )
        pieces = text.split(self.processor.image_token)
        if len(pieces) - 1 != len(encoded):
            raise EngineError(
                f"hf-vision: the prompt has {len(pieces) - 1} image placeholders for"
                f" {len(encoded)} images (a text part may hold the literal image token)"
            )
        laid_out = [pieces[0]]
        for (_, entry), piece in zip(encoded, pieces[1:], strict=True):
            layout = {"rows": [[entry.rows]], "cols": [[entry.cols]]}
            laid_out += [self.processor.replace_image_token(layout, 0), piece]
        ids = self.tokenizer("".join(laid_out), add_special_tokens=False)["input_ids"]
        return list(ids), encoded or None

    def encoded(self, image: ImageInput) -> EncodedImage:
        """``image``'s embeddings under the current weights: cached, or encoded and kept."""
        import torch

        entry = self.images.get(image.sha256, self.version)
        if entry is not None:
            return entry
        pixels = self.processor.image_processor(
            [[image.pil()]], return_tensors="pt", return_row_col_info=True
        )
        with torch.inference_mode():
            output = self.hf_model.get_image_features(
                pixel_values=pixels["pixel_values"].to(self.device),
                pixel_attention_mask=pixels["pixel_attention_mask"].to(self.device),
            )
        self.encoder_calls += 1
        features = output.pooler_output[0]
        rows, cols = pixels["rows"][0][0], pixels["cols"][0][0]
        entry = EncodedImage(image.sha256, features, int(rows), int(cols), self.version)
        self.images.put(entry)
        return entry

    def prefill_inputs(self, model: Any, ids: Any, extras: list[Any]) -> dict[str, Any]:
        """Token embeddings with each row's image embeddings written over its image tokens
        (images encoded under older weights are encoded again first)."""
        import torch

        if all(extra is None for extra in extras):
            return {"input_ids": ids}
        embeds = model.get_input_embeddings()(ids)
        image_token = model.config.image_token_id
        for i, extra in enumerate(extras):
            if extra is None:
                continue
            entries = [e if e.version == self.version else self.encoded(img) for img, e in extra]
            features = torch.cat([e.features for e in entries]).to(embeds.device, embeds.dtype)
            slots = ids[i] == image_token
            if int(slots.sum()) != features.shape[0]:
                raise EngineError(
                    f"hf-vision: {int(slots.sum())} image tokens for {features.shape[0]} image"
                    " embeddings (the processor's image_seq_len does not match the model)"
                )
            embeds[i, slots] = features
        return {"inputs_embeds": embeds}
