"""Small random-weight models built offline from a config, with a byte-level tokenizer (tests,
benches, ``rollfleet gateway --engine hf`` without ``--model``): nothing is downloaded.

:func:`tiny_hf_model` is a Llama; :func:`tiny_vlm` an Idefics3 (SmolVLM's architecture) with a
small SigLIP vision encoder and its processor, so images run through the real model code.
"""

from __future__ import annotations

from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_PARTS = (  # content parts: an image part becomes the processor's <image> placeholder
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_SPECIALS = [
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]


def tiny_tokenizer(extra_specials: list[str] | None = None) -> Any:
    """A byte-level BPE tokenizer with ChatML's special tokens (and ``extra_specials``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS + list(extra_specials or [])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def _llama_config(tokenizer: Any, hidden: int, layers: int) -> dict[str, Any]:
    """A small Llama's settings for ``tokenizer``'s vocabulary."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": 0,
        "bos_token_id": 0,
    }


def tiny_hf_model(seed: int = 0, hidden: int = 64, layers: int = 2) -> tuple[Any, Any]:
    """A small random-weight Llama and a byte-level tokenizer, built offline (tests, benches)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(**_llama_config(tokenizer, hidden, layers))
    return LlamaForCausalLM(config).eval(), tokenizer  # type: ignore[no-untyped-call]


def tiny_vlm(
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    tile: int = 32,
    patch: int = 8,
    vision_hidden: int = 32,
    vision_layers: int = 2,
) -> tuple[Any, Any]:
    """A small random-weight Idefics3 (SmolVLM's architecture) and its processor, built offline.

    The vision encoder sees ``tile``-pixel tiles in ``patch``-pixel patches; an image is
    resized to at most two tiles a side, split into its tiles plus one global view, and each
    becomes ``(tile / patch) ** 2 / 4`` image tokens (4 with the defaults).
    """
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tokenizer = tiny_tokenizer(IMAGE_SPECIALS)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * tile},
        max_image_size={"longest_edge": tile},
        do_image_splitting=True,
    )
    seq_len = (tile // patch) ** 2 // 4
    processor = Idefics3Processor(
        images, tokenizer, image_seq_len=seq_len, chat_template=CHATML_PARTS
    )
    torch.manual_seed(seed)
    config = Idefics3Config(
        vision_config={
            "hidden_size": vision_hidden,
            "intermediate_size": vision_hidden * 2,
            "num_hidden_layers": vision_layers,
            "num_attention_heads": 2,
            "image_size": tile,
            "patch_size": patch,
        },
        text_config={"model_type": "llama", **_llama_config(tokenizer, hidden, layers)},
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config).eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, processor
