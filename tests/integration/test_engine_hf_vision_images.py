"""The HF vision engine on a tiny random VLM built from a config (Idefics3, SmolVLM's
architecture; no VLM weights can be downloaded here): real image tokens through the real
vision encoder, the engine's normal generate/stream path, and image delta (each image encoded
once across a conversation's turns)."""

from __future__ import annotations

import importlib.util
import io

import pytest
from support import require

from rollfleet.engines.base import Delta, Generation, GenerationRequest, SamplingParams
from rollfleet.engines.images import ImageRefused, image_part

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    have = importlib.util.find_spec("transformers") and importlib.util.find_spec("PIL")
    require(bool(have), "transformers, torch and Pillow (rollfleet[hf])")


def screenshot(turn: int) -> bytes:
    """A distinct small 'screenshot' per turn: a PNG with a coloured box where the turn says."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (80, 60), (240, 240, 240))
    ImageDraw.Draw(image).rectangle((8 * turn, 10, 8 * turn + 20, 40), fill=(30 * turn, 90, 200))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def conversation(turns: int) -> list[dict]:
    """An agent's conversation after ``turns`` observations, resent whole each turn."""
    messages: list[dict] = [{"role": "system", "content": "You operate a desktop."}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"click({turn}, {turn})"})
        text = {"type": "text", "text": f"Turn {turn}: what next?"}
        messages.append({"role": "user", "content": [text, image_part(screenshot(turn))]})
    return messages


async def started(cache_bytes: int = 64 * 1024 * 1024, seed: int = 0):
    from rollfleet.engines.hf.vision import HFVisionEngine
    from rollfleet.engines.tiny import tiny_vlm

    engine = HFVisionEngine(*tiny_vlm(seed=seed), image_cache_bytes=cache_bytes)
    await engine.start()
    return engine


def encoder_calls(engine) -> list[int]:
    """Counts every forward pass of the model's vision encoder (a hook on the module itself)."""
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    engine.hf_model.model.vision_model.register_forward_hook(count)
    return calls


async def test_engine_tiny_random_vlm_built_from_a_config_generates_from_an_image_like_transformers() -> (
    None
):
    """Greedy tokens through the engine's stream equal transformers' own generate on the
    processor's inputs; the prompt ids are the processor's, and every token has a log-prob."""
    import torch
    from PIL import Image

    engine = await started()
    try:
        messages = conversation(1)
        items = [item async for item in engine.stream(GenerationRequest(messages, params=GREEDY))]
        result = items[-1]
        assert isinstance(result, Generation) and all(isinstance(i, Delta) for i in items[:-1])
        assert len(result.completion_token_ids) == len(result.logprobs) == 8
        assert all(lp <= 0 for lp in result.logprobs)
        assert [t for d in items[:-1] for t in d.token_ids] == result.completion_token_ids

        processor, model = engine.processor, engine.hf_model
        shaped = [
            {"role": "system", "content": "You operate a desktop."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Turn 0: what next?"}, {"type": "image"}],
            },
        ]
        text = processor.apply_chat_template(shaped, tokenize=False, add_generation_prompt=True)
        image = Image.open(io.BytesIO(screenshot(0))).convert("RGB")
        inputs = processor(text=[text], images=[[image]], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == result.prompt_token_ids
        with torch.inference_mode():
            reference = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert reference[0, inputs["input_ids"].shape[1] :].tolist() == result.completion_token_ids
    finally:
        await engine.stop()


async def test_engine_tiny_random_vlm_image_delta_encodes_each_screenshot_once_over_5_turns() -> (
    None
):
    """5 turns, one new screenshot a turn, the whole conversation resent: 5 encoder calls with
    the cache, 15 without, and the same greedy tokens every turn."""
    outputs: dict[str, list[list[int]]] = {}
    calls: dict[str, int] = {}
    for label, cache_bytes in (("cached", 64 * 1024 * 1024), ("uncached", 0)):
        engine = await started(cache_bytes)
        counted = encoder_calls(engine)
        try:
            outputs[label] = []
            for turns in range(1, 6):
                request = GenerationRequest(conversation(turns), params=GREEDY)
                outputs[label].append((await engine.generate(request)).completion_token_ids)
            calls[label] = counted[0]
            assert engine.encoder_calls == counted[0]
        finally:
            await engine.stop()
    assert calls == {"cached": 5, "uncached": 15}
    assert outputs["cached"] == outputs["uncached"]
    assert len({tuple(o) for o in outputs["cached"]}) > 1  # the turns' images matter


async def test_engine_tiny_random_vlm_new_weights_encode_images_again() -> None:
    """Cached embeddings belong to one weights version: after an update the image is encoded
    again, and the answer is what a fresh engine with those weights gives."""
    engine = await started()
    other = await started(seed=1)
    try:
        request = GenerationRequest(conversation(2), params=GREEDY)
        await engine.generate(request)
        assert engine.encoder_calls == 2
        await engine.update_weights(list(other.hf_model.state_dict().items()), version=1)
        after = await engine.generate(GenerationRequest(conversation(2), params=GREEDY))
        assert engine.encoder_calls == 4
        fresh = await other.generate(GenerationRequest(conversation(2), params=GREEDY))
        assert after.completion_token_ids == fresh.completion_token_ids
    finally:
        await engine.stop()
        await other.stop()


async def test_engine_tiny_random_vlm_a_corrupt_image_is_refused_and_text_still_works() -> None:
    engine = await started()
    try:
        broken = [{"role": "user", "content": [image_part(screenshot(0)[:60])]}]
        with pytest.raises(ImageRefused, match=r"messages\[0\].content\[0\]: the image/png image"):
            await engine.generate(GenerationRequest(broken, params=GREEDY))
        text = [{"role": "user", "content": [{"type": "text", "text": "no image"}]}]
        result = await engine.generate(GenerationRequest(text, params=GREEDY))
        assert len(result.completion_token_ids) == 8 and engine.encoder_calls == 0
    finally:
        await engine.stop()


def test_engine_image_cache_is_an_lru_bounded_in_bytes() -> None:
    import torch

    from rollfleet.engines.hf.vision import EncodedImage, ImageCache

    def entry(name: str, version: int = 0) -> EncodedImage:
        return EncodedImage(name, torch.zeros(4, 8), 1, 1, version)  # 128 bytes

    cache = ImageCache(max_bytes=300)
    cache.put(entry("a"))
    cache.put(entry("b"))
    assert cache.get("a", 0) is not None  # a is now the most recent
    cache.put(entry("c"))  # 384 > 300: the least recently used (b) goes
    assert (cache.get("b", 0), len(cache), cache.bytes) == (None, 2, 256)
    assert cache.get("a", 1) is None and len(cache) == 1  # another weights version: dropped
    ImageCache(max_bytes=100).put(entry("big"))  # over the bound alone: not kept, no error
