"""Trainer tensors to GGUF (rollfleet.engines.weights.gguf_export) on a tiny Llama made here: names,
the rotary permutation, every kind of bad update, and a file written and read back."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import require

from rollfleet.engines.weights.gguf_export import (
    BaseGGUF,
    convert,
    export_gguf,
    gguf_name,
    permute_rotary,
)
from rollfleet.errors import EngineError

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
HIDDEN, FFN, VOCAB, HEADS, KV_HEADS, LAYERS = 32, 64, 40, 2, 1, 2
HEAD_DIM = HIDDEN // HEADS


def tiny_shapes(tied: bool = True) -> dict[str, tuple[int, ...]]:
    """llama.cpp names and row-major shapes of a 2-layer Llama, in a GGUF's usual order."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    shapes["output_norm.weight"] = (HIDDEN,)
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    return shapes


def tiny_base(tied: bool = True) -> BaseGGUF:
    return BaseGGUF(Path("tiny.gguf"), "llama", [], tiny_shapes(tied), HEADS, KV_HEADS, {})


def tiny_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """The transformers state_dict of the tiny model (lm_head the same array when tied)."""
    rng = np.random.default_rng(seed)
    hf = {gg: hf for hf, gg in _hf_names(tied).items()}
    weights = {
        hf[gg]: rng.normal(0, 0.1, shape).astype(np.float32)
        for gg, shape in tiny_shapes(tied).items()
    }
    if tied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def _hf_names(tied: bool) -> dict[str, str]:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(LAYERS):
        for hf, gg in [
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ]:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    return names


def test_gguf_name_maps_every_llama_weight_and_nothing_else() -> None:
    for hf, gg in _hf_names(tied=False).items():
        assert gguf_name(hf) == gg
    assert gguf_name("model.layers.12.mlp.down_proj.weight") == "blk.12.ffn_down.weight"
    for other in [
        "model.layers.01.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.bias",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "transformer.wte.weight",
        "w",
    ]:
        assert gguf_name(other) is None, other


def test_permute_rotary_interleaves_the_halves_of_each_head() -> None:
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of 4 rows: halves [0,1] [2,3]
    assert permute_rotary(rows, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    kv = np.arange(4, dtype=np.float32).reshape(4, 1)  # k: the kv head count decides the split
    assert permute_rotary(kv, 2, 1).ravel().tolist() == [0, 2, 1, 3]
    with pytest.raises(EngineError, match="cannot split 6 rows into 2 rotary heads"):
        permute_rotary(np.zeros((6, 2)), 2)


def test_permute_rotary_is_undone_by_transformers_gguf_loader() -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    undo = LlamaTensorProcessor()._reverse_permute_weights
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(576, 8)), rng.normal(size=(192, 8))  # SmolLM2-135M: 9 heads, 3 kv heads
    assert np.array_equal(undo(permute_rotary(q, 9, 9), 9, 9), q)
    assert np.array_equal(undo(permute_rotary(k, 9, 3), 9, 3), k)
    assert not np.array_equal(permute_rotary(q, 9, 9), q)


def test_convert_names_permutes_and_encodes_every_tensor() -> None:
    weights = tiny_weights()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(HEAD_DIM // 2, np.float32)
    out = convert(weights.items(), tiny_base())
    assert list(out) != [] and set(out) == set(tiny_shapes())  # tied: no output.weight
    q, _ = out["blk.1.attn_q.weight"]
    assert q.dtype == np.float16
    assert np.array_equal(
        q,
        permute_rotary(weights["model.layers.1.self_attn.q_proj.weight"], HEADS).astype(np.float16),
    )
    k, _ = out["blk.0.attn_k.weight"]
    assert np.array_equal(
        k,
        permute_rotary(weights["model.layers.0.self_attn.k_proj.weight"], HEADS, KV_HEADS).astype(
            np.float16
        ),
    )
    v, _ = out["blk.0.attn_v.weight"]
    assert np.array_equal(v, weights["model.layers.0.self_attn.v_proj.weight"].astype(np.float16))
    norm, _ = out["output_norm.weight"]
    assert norm.dtype == np.float32 and np.array_equal(norm, weights["model.norm.weight"])
    weights["model.norm.weight"][0] = (
        7.0  # the export is a snapshot, not a view of the caller's arrays
    )
    assert norm[0] != 7.0


def test_convert_takes_torch_tensors_in_any_float_dtype() -> None:
    require(importlib.util.find_spec("torch") is not None, "torch")
    import torch

    weights = {
        name: torch.from_numpy(array).to(torch.bfloat16) for name, array in tiny_weights().items()
    }
    out = convert(weights.items(), tiny_base())
    embd, _ = out["token_embd.weight"]
    assert np.array_equal(
        embd, weights["model.embed_tokens.weight"].float().numpy().astype(np.float16)
    )


def _drop(name: str) -> Any:
    def edit(w: dict[str, Any]) -> None:
        del w[name]

    return edit


def _set(name: str, value: Any) -> Any:
    def edit(w: dict[str, Any]) -> None:
        w[name] = value

    return edit


def _poke(name: str, value: float) -> Any:
    def edit(w: dict[str, Any]) -> None:
        w[name] = w[name].copy()
        w[name].flat[3] = value

    return edit


BAD = {
    "missing": (_drop("model.norm.weight"), r"missing tensor 'model\.norm\.weight'"),
    "missing several": (
        lambda w: [w.pop(n) for n in [n for n in w if ".layers.1." in n]],
        r"missing tensor 'model\.layers\.1\.input_layernorm\.weight' \(and 8 more\)",
    ),
    "unknown": (
        _set("model.layers.0.mlp.gate.weight", np.zeros(3, np.float32)),
        r"unknown tensor 'model\.layers\.0\.mlp\.gate\.weight'",
    ),
    "a layer the model lacks": (
        _set("model.layers.2.mlp.up_proj.weight", np.zeros((FFN, HIDDEN), np.float32)),
        r"unknown tensor 'model\.layers\.2\.mlp\.up_proj\.weight'",
    ),
    "wrong shape": (
        _set("model.layers.1.self_attn.k_proj.weight", np.zeros((HIDDEN, HIDDEN), np.float32)),
        r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(32, 32\), tiny\.gguf has \(16, 32\)",
    ),
    "transposed": (
        lambda w: w.__setitem__(
            "model.layers.0.mlp.down_proj.weight", w["model.layers.0.mlp.down_proj.weight"].T
        ),
        r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(64, 32\)",
    ),
    "not float": (
        _set("model.norm.weight", np.ones(HIDDEN, np.int64)),
        r"tensor 'model\.norm\.weight' has dtype int64",
    ),
    "nan": (
        _poke("model.layers.0.mlp.up_proj.weight", float("nan")),
        r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' holds NaN",
    ),
    "past float16": (
        _poke("model.layers.1.mlp.up_proj.weight", 1e6),
        r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has values beyond float16",
    ),
    "untied lm_head": (
        _set("lm_head.weight", np.zeros((VOCAB, HIDDEN), np.float32)),
        r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight', but tiny\.gguf ties them",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_convert_refuses_a_bad_update_naming_the_tensor(case: str) -> None:
    edit, message = BAD[case]
    weights = tiny_weights()
    edit(weights)
    with pytest.raises(EngineError, match=message):
        convert(weights.items(), tiny_base())


def test_convert_refuses_a_tensor_sent_twice() -> None:
    items = list(tiny_weights().items())
    with pytest.raises(EngineError, match=r"tensor 'model\.norm\.weight' was sent twice"):
        convert([*items, ("model.norm.weight", np.ones(HIDDEN, np.float32))], tiny_base())


def test_convert_needs_lm_head_when_the_gguf_has_its_own_output() -> None:
    weights = tiny_weights(tied=False)
    assert set(convert(weights.items(), tiny_base(tied=False))) == set(tiny_shapes(tied=False))
    del weights["lm_head.weight"]
    with pytest.raises(EngineError, match=r"missing tensor 'lm_head\.weight'"):
        convert(weights.items(), tiny_base(tied=False))


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A tiny llama GGUF (f32, with a rope_freqs tensor no trainer sends); its HF weights."""
    import gguf

    weights = tiny_weights(seed=3)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    writer.add_file_type(0)
    for hf, gg in _hf_names(tied=True).items():
        array = weights[hf]
        if gg.endswith(("attn_q.weight", "attn_k.weight")):
            array = permute_rotary(array, HEADS, HEADS if "attn_q" in gg else KV_HEADS)
        writer.add_tensor(gg, np.ascontiguousarray(array))
    writer.add_tensor("rope_freqs.weight", np.linspace(1, 2, HEAD_DIM // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_export_gguf_writes_a_file_llama_cpp_reads_back(tmp_path: Path, out_type: str) -> None:
    require(HAVE_GGUF, "gguf (rollfleet[llamacpp])")
    import gguf
    from gguf import quants

    base = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(base)
    export = export_gguf(base, weights.items(), tmp_path / "out", out_type)
    assert export.path.parent == tmp_path / "out" and export.path.name.endswith(f".{out_type}.gguf")
    assert [p.name for p in (tmp_path / "out").iterdir()] == [export.path.name]  # no .part left
    source, written = gguf.GGUFReader(base), gguf.GGUFReader(export.path)
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        assert written.fields[key].contents() == field.contents(), key
    assert written.fields["general.file_type"].contents() == {"f16": 1, "q8_0": 7}[out_type]
    assert [t.name for t in written.tensors] == [t.name for t in source.tensors]  # same order
    kinds = {t.name: t.tensor_type.name for t in written.tensors}
    assert kinds["blk.0.attn_q.weight"] == out_type.upper() and kinds["output_norm.weight"] == "F32"
    assert kinds["rope_freqs.weight"] == "F32"  # no trainer weight: kept from the base file
    tolerance = {"f16": 1e-3, "q8_0": 2e-2}[out_type]
    for old, new in zip(source.tensors, written.tensors, strict=True):
        a = quants.dequantize(old.data, old.tensor_type).reshape(-1)
        b = quants.dequantize(new.data, new.tensor_type).reshape(-1)
        assert np.abs(a - b).max() <= tolerance * np.abs(a).max(), old.name


def test_export_gguf_writes_nothing_for_a_bad_update(tmp_path: Path) -> None:
    require(HAVE_GGUF, "gguf (rollfleet[llamacpp])")
    base = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(base)
    del weights["model.layers.1.mlp.gate_proj.weight"]
    with pytest.raises(
        EngineError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate_proj\.weight'"
    ):
        export_gguf(base, weights.items(), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    with pytest.raises(EngineError, match="export type 'q4_0' is not one of f16, q8_0"):
        export_gguf(base, weights.items(), tmp_path / "out", "q4_0")


def test_an_unknown_export_type_is_refused_when_the_engine_is_made() -> None:
    from rollfleet.engines.llamacpp.engine import LlamaCppEngine  # llama_cpp is imported at start

    with pytest.raises(EngineError, match="export type 'bf16' is not one of f16, q8_0"):
        LlamaCppEngine("unused.gguf", export_type="bf16")
