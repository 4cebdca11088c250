"""Sampling, stop strings, incremental UTF-8 decoding and chat templates of the CPU engines."""

from __future__ import annotations

import numpy as np
import pytest

from rollfleet.engines.base import (
    FinishReason,
    Generation,
    GenerationRequest,
    SamplingParams,
    message_text,
)
from rollfleet.engines.llamacpp.model import ChatTemplate, TextDecoder, find_stop, sample
from rollfleet.errors import EngineError


def test_engine_sampling_greedy_picks_the_argmax_with_its_logprob() -> None:
    logits = np.log(np.array([0.1, 0.2, 0.7], dtype=np.float32))
    token, logprob = sample(logits, SamplingParams(temperature=0), np.random.default_rng(0))
    assert token == 2 and logprob == pytest.approx(np.log(0.7), abs=1e-5)


def test_engine_sampling_follows_the_distribution() -> None:
    logits = np.log(np.array([0.1, 0.2, 0.7], dtype=np.float32))
    rng = np.random.default_rng(1)
    counts = np.bincount(
        [sample(logits, SamplingParams(), rng)[0] for _ in range(6000)], minlength=3
    )
    assert np.allclose(counts / 6000, [0.1, 0.2, 0.7], atol=0.03)


def test_engine_sampling_top_p_never_picks_the_tail() -> None:
    logits = np.log(np.array([0.05, 0.05, 0.3, 0.6], dtype=np.float32))
    rng = np.random.default_rng(2)
    picks = {sample(logits, SamplingParams(top_p=0.85), rng)[0] for _ in range(500)}
    assert picks == {2, 3}


def test_engine_sampling_same_seed_same_tokens() -> None:
    logits = np.random.default_rng(3).normal(size=500).astype(np.float32)
    a = [sample(logits, SamplingParams(), np.random.default_rng(9))[0] for _ in range(5)]
    b = [sample(logits, SamplingParams(), np.random.default_rng(9))[0] for _ in range(5)]
    assert a == b


def test_engine_sampling_find_stop_returns_earliest_hit() -> None:
    assert find_stop("abc END xyz STOP", ("STOP", "END")) == 4
    assert find_stop("nothing here", ("STOP",)) == -1
    assert find_stop("text", ("",)) == -1


def test_engine_sampling_text_decoder_never_splits_a_character() -> None:
    decoder = TextDecoder()
    raw = "héllo ✓".encode()
    pieces = [decoder.feed(raw[i : i + 1]) for i in range(len(raw))]
    assert "".join(pieces) == decoder.text == "héllo ✓"
    assert "\ufffd" not in decoder.text


def test_engine_sampling_chat_template_renders_messages_and_generation_prompt() -> None:
    template = ChatTemplate(None, "<s>", "</s>")
    text = template.render(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    )
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_engine_sampling_chat_template_errors_are_engine_errors() -> None:
    template = ChatTemplate("{{ raise_exception('no system role') }}", "", "")
    with pytest.raises(EngineError, match="no system role"):
        template.render([{"role": "user", "content": "x"}])


def test_engine_sampling_message_text_flattens_parts() -> None:
    assert message_text(None) == ""
    assert (
        message_text([{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]) == "ab"
    )


def test_engine_request_needs_exactly_one_of_messages_or_prompt() -> None:
    with pytest.raises(EngineError, match="exactly one"):
        GenerationRequest()
    with pytest.raises(EngineError, match="exactly one"):
        GenerationRequest(messages=[{"role": "user", "content": "x"}], prompt="x")
    assert GenerationRequest(prompt=[1, 2]).is_chat is False


def test_engine_generation_usage_counts_tokens_or_reports_the_servers() -> None:
    g = Generation("r", "t", [1, 2, 3], [4, 5], None, FinishReason.ABORT, "e", "m", 0)
    assert g.aborted and g.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    reported = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    assert (
        Generation("r", "t", [], [], None, FinishReason.STOP, "e", "m", 0, reported).usage
        == reported
    )
