"""Token-in across turns (continued_prompt, token_in) with a real renderer: the tiny byte-level
tokenizer and its ChatML chat template, through transformers (no model, no I/O)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import pytest
from support import require

from rollfleet.engines.continuation import PriorCall, continued_prompt, token_in

SYSTEM = {"role": "system", "content": "You look things up."}
TASK = {"role": "user", "content": "What is the code of the blue door?"}
OBSERVATION = {"role": "user", "content": "Observation from lookup:\ncode 4821"}
GAP = f"\n<|im_start|>user\n{OBSERVATION['content']}<|im_end|>\n<|im_start|>assistant\n"
# templates that rewrite earlier turns: a continued prompt would not be what they render
DROPS_OLD_REPLIES = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DROPS_OLD_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ENDS_ON_A_QUESTION = (  # refuses to render a conversation that ends with the assistant
    "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyRenderer:
    """The Renderer an engine offers, built on the tiny tokenizer (as HFEngine builds its own)."""

    def __init__(self, template: str | None = None) -> None:
        have = importlib.util.find_spec("transformers") and importlib.util.find_spec("tokenizers")
        require(bool(have), "transformers and tokenizers (rollfleet[hf])")
        from rollfleet.engines.tiny import tiny_tokenizer

        self.tok = tiny_tokenizer()
        if template is not None:
            self.tok.chat_template = template
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.endoftext = self.tok.convert_tokens_to_ids("<|endoftext|>")

    def render(
        self, messages: Sequence[Any], add_generation_prompt: bool, tools: Any = None
    ) -> str:
        return str(
            self.tok.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def fragment_ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def token_text(self, token: int) -> str:
        return str(self.tok.decode([token], skip_special_tokens=False))

    def is_end(self, token: int) -> bool:
        return token in (self.im_end, self.endoftext)

    def text(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))


@pytest.fixture(scope="module")
def r() -> TinyRenderer:
    return TinyRenderer()


def first_call(
    r: TinyRenderer, reply: str, finish: str = "stop", end: int | None = -1, rid: str = "c1"
) -> PriorCall:
    """The first call of a conversation, as the engine served it: the whole render tokenized,
    the reply sampled (ending with ``end``: -1 for <|im_end|>, None for no end token)."""
    messages = [SYSTEM, TASK]
    prompt = r.fragment_ids(r.render(messages, True))
    completion = r.fragment_ids(reply) + ([] if end is None else [r.im_end if end == -1 else end])
    return PriorCall(rid, "tiny", messages, prompt, completion, finish, reply)


def test_three_turns_continue_the_exact_tokens_with_only_the_template_gap(r) -> None:
    first = first_call(r, "I will call lookup.")
    assert r.is_end(first.completion_ids[-1])
    turn2 = [*first.messages, {"role": "assistant", "content": "I will call lookup."}, OBSERVATION]
    prompt2 = continued_prompt(r, first, turn2)
    assert prompt2 is not None
    gap = r.fragment_ids(GAP)
    assert prompt2 == first.prompt_ids + first.completion_ids + gap  # the EOS sampled is kept
    assert r.text(prompt2[len(first.tokens) :]) == GAP  # the gap is exactly the template's text
    assert token_in(first, prompt2)

    reply2 = r.fragment_ids("lookup(door)") + [r.im_end]
    second = PriorCall("c2", "tiny", turn2, prompt2, reply2, "stop", "lookup(door)")
    turn3 = [*turn2, {"role": "assistant", "content": "lookup(door)"}, OBSERVATION]
    prompt3 = continued_prompt(r, second, turn3)
    assert prompt3 is not None and prompt3 == second.tokens + gap
    assert prompt3[: len(first.tokens)] == first.tokens  # one sequence from the first call on
    # no drift here (byte-level, the replies end with the template's own end of turn): token-in
    # gives exactly the tokens of the whole conversation rendered again, and its text
    assert prompt3 == r.fragment_ids(r.render(turn3, True))
    assert r.text(prompt3) == r.render(turn3, True)


@pytest.mark.parametrize(
    ("finish", "why"), [("length", "cut by max_tokens"), ("stop", "a stop string ended it")]
)
def test_a_reply_without_its_end_token_gets_the_templates_end_of_turn(r, finish, why) -> None:
    first = first_call(r, "I will call loo", finish=finish, end=None)
    assert not r.is_end(first.completion_ids[-1]), why
    messages = [*first.messages, {"role": "assistant", "content": "I will call loo"}, OBSERVATION]
    prompt = continued_prompt(r, first, messages)
    assert prompt is not None and prompt[: len(first.tokens)] == first.tokens
    gap = prompt[len(first.tokens) :]
    assert gap[:2] == r.fragment_ids("<|im_end|>\n") and gap[0] == r.im_end
    assert r.text(gap) == "<|im_end|>" + GAP
    assert prompt == r.fragment_ids(r.render(messages, True))


def test_a_retry_of_the_same_messages_is_prompted_with_the_priors_prompt(r) -> None:
    first = first_call(r, "unparseable {")
    again = continued_prompt(r, first, list(first.messages))
    assert again == first.prompt_ids and again is not first.prompt_ids  # a copy
    assert token_in(first, first.prompt_ids)


def _turn2(prior: PriorCall, reply: str = "I will call lookup.") -> list[dict[str, Any]]:
    return [*prior.messages, {"role": "assistant", "content": reply}, OBSERVATION]


@pytest.mark.parametrize(
    "change",
    [
        "no prior",
        "trimmed history",
        "edited earlier message",
        "reply left out",
        "nothing sampled",
        "another end token",
    ],
)
def test_a_conversation_that_does_not_continue_the_prior_is_rendered_whole(r, change) -> None:
    first = first_call(r, "I will call lookup.")
    prior: PriorCall | None = first
    messages = _turn2(first)
    if change == "no prior":
        prior = None
    elif change == "trimmed history":  # the agent dropped the system message to fit its budget
        messages = messages[1:]
    elif change == "edited earlier message":
        messages[1] = {"role": "user", "content": "What is the code of the red door?"}
    elif change == "reply left out":  # the observation follows the task directly
        messages = [*first.messages, OBSERVATION]
    elif change == "nothing sampled":
        prior = PriorCall("c1", "tiny", first.messages, first.prompt_ids, [], "abort", "")
    elif change == "another end token":  # <|endoftext|> ends generation, the template ends turns
        prior = first_call(r, "I will call lookup.", end=r.endoftext)  # with <|im_end|>
    assert continued_prompt(r, prior, messages) is None


@pytest.mark.parametrize("template", [DROPS_OLD_REPLIES, DROPS_OLD_THINKING, ENDS_ON_A_QUESTION])
def test_a_template_that_rewrites_or_refuses_the_past_is_rendered_whole(template) -> None:
    r = TinyRenderer(template)
    reply = "<think>the blue door</think>I will call lookup."
    first = first_call(r, reply)
    messages = _turn2(first, reply)
    if template == ENDS_ON_A_QUESTION:
        with pytest.raises(Exception, match="no"):
            r.render(messages[:3], False)  # the conversation closed after the reply
    else:  # what the template shows the model of its earlier turn is not what it was shown
        assert reply in r.render(messages[:3], False) and reply not in r.render(messages, True)
    assert continued_prompt(r, first, messages) is None


@pytest.mark.parametrize("sent", ["I will call lookup.", "lookup(door='blue')"])
def test_a_reply_sent_back_otherwise_than_sampled_is_rendered_whole(r, sent) -> None:
    """The module says a reply the agent sent back that is not the one sampled gets no
    continuation: continued, the model would be shown its sampled tokens, not the reply the
    agent's conversation holds (here stripped, or rewritten)."""
    first = first_call(r, "I will call lookup.  ")
    edited = _turn2(first, sent)
    assert continued_prompt(r, first, edited) is None


@pytest.mark.parametrize(
    ("sampled", "why"),
    [
        (list(b"say <|im_end|> twice"), "the special token's text sampled byte by byte"),
        ([0xC3, *b"ok"], "half a UTF-8 character: the text holds U+FFFD"),
    ],
)
def test_sampled_ids_are_kept_verbatim_where_the_text_tokenizes_otherwise(r, sampled, why) -> None:
    byte_ids = {b: r.tok.convert_tokens_to_ids(t) for b, t in _byte_tokens().items()}
    completion = [byte_ids[b] for b in sampled]
    reply = r.text(completion)
    assert r.fragment_ids(reply) != completion, why  # the drift token-in avoids
    first = PriorCall(
        "c1",
        "tiny",
        [SYSTEM, TASK],
        r.fragment_ids(r.render([SYSTEM, TASK], True)),
        [*completion, r.im_end],
        "stop",
        reply,
    )
    messages = _turn2(first, reply)
    prompt = continued_prompt(r, first, messages)
    assert prompt is not None and token_in(first, prompt)
    assert prompt == first.tokens + r.fragment_ids(GAP)  # the sampled ids, not the re-tokenized
    rendered = r.fragment_ids(r.render(messages, True))
    assert rendered != prompt and not token_in(first, rendered)  # re-rendering would split it


def _byte_tokens() -> dict[int, str]:
    """Each byte's token in byte-level BPE (GPT-2's printable stand-ins for bytes)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    shown += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in shown:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def test_token_in_holds_only_for_the_priors_tokens_extended_or_its_prompt_again(r) -> None:
    first = first_call(r, "I will call lookup.")
    assert token_in(first, first.tokens + [5, 6])
    assert token_in(first, first.prompt_ids)  # asked again
    assert not token_in(first, first.prompt_ids + first.completion_ids[:-1] + [5])  # EOS lost
    assert not token_in(first, first.prompt_ids + [5, 6])  # the reply re-rendered otherwise
    assert not token_in(first, first.tokens[1:])
    empty = PriorCall("c1", "tiny", first.messages, first.prompt_ids, [], "abort", "")
    assert not token_in(empty, first.prompt_ids + [5])
