"""Trainer tensors (transformers Llama names) into a GGUF file that llama.cpp can load.

llama.cpp reads weights from GGUF files only, so an in-memory weight update becomes a new GGUF:
every metadata key of the GGUF being served (architecture, hyper-parameters, tokenizer, chat
template) is copied as it is, and each tensor is written under llama.cpp's name
(``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``).

One thing is not a renaming: llama.cpp's converter (``convert_hf_to_gguf.py``,
``LlamaModel.permute``) reorders the rows of ``q_proj`` and ``k_proj`` inside each head, because
transformers applies rotary embeddings to the two halves of a head and llama.cpp to adjacent
pairs; transformers' own GGUF loader undoes it when it loads (``LlamaTensorProcessor``).
:func:`permute_rotary` does the same as the converter, so a model loaded from a GGUF by
transformers and exported here gives the same file layout back.

Every tensor of the served model must arrive exactly once with its shape, or nothing is written
and :class:`~rollfleet.errors.EngineError` names the tensor. A delta
(:class:`~rollfleet.engines.base.WeightsDelta`, or ``partial=True``) sends only some: the
others come from the served GGUF, as they are when they already have the type this export writes
(later deltas: no rounding on top of rounding), else decoded and written as the tensors sent
(a Q4_1 original becomes f16, as a full export of the same values would write it).

Output types: ``f16`` (default) or ``q8_0`` (quantized with ``gguf.quants``, as llama.cpp
would); 1-D norms stay f32 as in llama.cpp's own files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rollfleet.engines.base import NamedTensors, WeightSource
from rollfleet.errors import EngineError

log = logging.getLogger("rollfleet.engines")
OUT_TYPES = ("f16", "q8_0")
_FILE_TYPES = {"f16": 1, "q8_0": 7}  # llama_ftype: MOSTLY_F16, MOSTLY_Q8_0
_LAYER = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)")
_BLOCK = re.compile(r"blk\.([0-9]+)\.(.+)")
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_DERIVED = (".rotary_emb.inv_freq",)  # buffers older transformers kept; computed from the config
_NOT_COPIED = ("general.architecture", "general.file_type", "general.alignment")
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar sizes
_STRING, _ARRAY = 8, 9
_BASES: OrderedDict[tuple[str, int, int], BaseGGUF] = OrderedDict()  # a few, most recent last
_LOCK = threading.Lock()


def check_out_type(out_type: str) -> str:
    """``out_type`` when the export writes it; EngineError otherwise."""
    if out_type not in OUT_TYPES:
        raise EngineError(f"GGUF export type {out_type!r} is not one of {', '.join(OUT_TYPES)}")
    return out_type


def gguf_name(name: str) -> str | None:
    """llama.cpp's name for a transformers Llama parameter name, or None when it has none."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def permute_rotary(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Rows of a q_proj/k_proj weight in llama.cpp's rotary layout, as ``LlamaModel.permute`` in
    llama.cpp's convert_hf_to_gguf.py: per head, row ``h*d + p*d/2 + i`` moves to ``h*d + 2*i + p``
    (the halves of a head become interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = weights.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise EngineError(f"cannot split {rows} rows into {n_head} rotary heads")
    half = rows // n_head // 2
    shaped = weights.reshape(n_head, 2, half, *weights.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weights.shape)


@dataclass
class BaseGGUF:
    """What the served GGUF fixes: its metadata and the name, shape and order of every tensor."""

    path: Path
    arch: str
    fields: list[tuple[str, Any, Any, Any]]  # key, value, value type, array element type
    shapes: dict[str, tuple[int, ...]]  # llama.cpp name -> row-major shape, in file order
    n_head: int
    n_head_kv: int
    kept: dict[str, tuple[np.ndarray, Any]]  # tensors no trainer weight maps to (rope_freqs)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise EngineError("tensor updates need the gguf package (rollfleet[llamacpp])") from exc
    return gguf


def _key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def read_base(path: Path) -> BaseGGUF:
    """Metadata and tensor shapes of the GGUF at ``path``, remembered for the next update
    (``gguf.GGUFReader`` takes 2.5 s on the 135M model's 49k-token vocabulary)."""
    try:
        key = _key(path)
    except OSError as exc:
        raise EngineError(f"cannot read GGUF {path}: {exc}") from exc
    with _LOCK:
        if key in _BASES:
            _BASES.move_to_end(key)
            return replace(_BASES[key], path=path)
    base = _read_base(path)
    _remember(key, base)
    return base


def _remember(key: tuple[str, int, int], base: BaseGGUF) -> None:
    with _LOCK:
        _BASES[key] = base
        while len(_BASES) > 4:
            _BASES.popitem(last=False)


def _read_base(path: Path) -> BaseGGUF:
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read GGUF {path}: {exc}") from exc
    values = {name: field.contents() for name, field in reader.fields.items()}
    arch = str(values.get("general.architecture"))
    if arch != "llama":
        raise EngineError(f"{path.name}: tensor updates need a llama GGUF, this one is {arch!r}")
    n_head = values.get(f"{arch}.attention.head_count")
    n_head_kv = values.get(f"{arch}.attention.head_count_kv", n_head)
    if not isinstance(n_head, int) or not isinstance(n_head_kv, int):
        raise EngineError(
            f"{path.name}: no single attention head count ({n_head!r}, {n_head_kv!r})"
        )
    fields = [
        (name, values[name], field.types[0], field.types[-1] if len(field.types) > 1 else None)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and name not in _NOT_COPIED
    ]
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    base = BaseGGUF(path, arch, fields, shapes, n_head, n_head_kv, {})
    sent = set(_hf_names(base).values())
    kept = [t for t in reader.tensors if t.name not in sent]  # copied: the file may be deleted
    base.kept = {t.name: (np.array(t.data), t.tensor_type) for t in kept}
    return base


def _float32(name: str, tensor: Any) -> np.ndarray:
    if hasattr(tensor, "detach"):  # a torch tensor, on any device, in any float dtype
        if not tensor.is_floating_point():
            raise EngineError(f"tensor {name!r} has dtype {tensor.dtype}, not a float type")
        return np.asarray(tensor.detach().cpu().float().numpy())
    array = np.asarray(tensor)
    if array.dtype.kind != "f":
        raise EngineError(f"tensor {name!r} has dtype {array.dtype}, not a float type")
    return array.astype(np.float32, copy=False)


def _encode(name: str, array: np.ndarray, out_type: str) -> tuple[np.ndarray, Any]:
    """The bytes to write for one tensor (a new array, never a view of the caller's) and its
    GGML type (None: the numpy dtype says it)."""
    if not np.isfinite(array).all():
        raise EngineError(f"tensor {name!r} holds NaN or infinite values")
    if array.ndim == 1:
        return np.array(array, dtype=np.float32), None
    if out_type == "q8_0" and array.shape[-1] % 32 == 0:
        gguf = _gguf()
        q8_0 = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(array, q8_0), q8_0
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        half = array.astype(np.float16)
    if not np.isfinite(half).all():
        raise EngineError(f"tensor {name!r} has values beyond float16's range (65504)")
    return half, None


def convert(
    weights: NamedTensors, base: BaseGGUF, out_type: str = "f16", partial: bool = False
) -> dict[str, tuple[np.ndarray, Any]]:
    """Check ``weights`` against ``base`` and encode them under llama.cpp's names; EngineError
    naming the first unknown, repeated, misshaped or (unless ``partial``) missing tensor."""
    out: dict[str, tuple[np.ndarray, Any]] = {}
    tied = "output.weight" not in base.shapes
    lm_head: np.ndarray | None = None
    for name, tensor in weights:
        if name.endswith(_DERIVED):
            continue
        target = gguf_name(name)
        if target is None or (
            target not in base.shapes and not (tied and name == "lm_head.weight")
        ):
            raise EngineError(f"unknown tensor {name!r}: {base.path.name} has no such weight")
        if target in out or (name == "lm_head.weight" and lm_head is not None):
            raise EngineError(f"tensor {name!r} was sent twice")
        array = _float32(name, tensor)
        want = base.shapes["token_embd.weight" if target == "output.weight" and tied else target]
        if tuple(array.shape) != want:
            raise EngineError(
                f"tensor {name!r} has shape {tuple(array.shape)}, {base.path.name} has {want}"
            )
        if name == "lm_head.weight" and tied:
            lm_head = array
            continue
        if target.endswith(("attn_q.weight", "attn_k.weight")):
            kv = base.n_head if target.endswith("attn_q.weight") else base.n_head_kv
            array = permute_rotary(array, base.n_head, kv)
        out[target] = _encode(name, array, out_type)
    if lm_head is not None and partial and "token_embd.weight" not in out:
        out["token_embd.weight"] = _encode("lm_head.weight", lm_head, out_type)  # one tensor
    missing = [hf for hf, gg in _hf_names(base).items() if gg not in out]
    if missing and not partial:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise EngineError(f"missing tensor {missing[0]!r}{more}: every weight must be sent")
    if lm_head is not None:
        data, _ = _encode("lm_head.weight", lm_head, out_type)
        if not np.array_equal(data, out["token_embd.weight"][0]):
            raise EngineError(
                f"tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but"
                f" {base.path.name} ties them (one tensor serves both)"
            )
    return out


def _hf_names(base: BaseGGUF) -> dict[str, str]:
    """transformers name -> llama.cpp name for every tensor of ``base`` that a trainer sends."""
    top = {gg: hf for hf, gg in _TOP_NAMES.items()}
    layer = {gg: hf for hf, gg in _LAYER_NAMES.items()}
    names = {}
    for gg in base.shapes:
        match = _BLOCK.fullmatch(gg)
        if match and match.group(2) in layer:
            names[f"model.layers.{match.group(1)}.{layer[match.group(2)]}"] = gg
        elif gg in top:
            names[top[gg]] = gg
    return names


def _out_kind(shape: tuple[int, ...], out_type: str) -> Any:
    """The GGML type :func:`_encode` writes a tensor of ``shape`` as."""
    kinds = _gguf().GGMLQuantizationType
    if len(shape) == 1:
        return kinds.F32
    return kinds.Q8_0 if out_type == "q8_0" and shape[-1] % 32 == 0 else kinds.F16


def fill_unsent(
    base: BaseGGUF, tensors: dict[str, tuple[np.ndarray, Any]], out_type: str
) -> dict[str, tuple[np.ndarray, Any]]:
    """``tensors`` (a delta, converted) and every weight it does not hold, from ``base``'s file:
    as they are when already of the type an export writes, else decoded and encoded as one."""
    unsent = [gg for gg in _hf_names(base).values() if gg not in tensors]
    if not unsent:
        return tensors
    stored = read_tensors(base.path)
    out = dict(tensors)
    for name in unsent:
        data, kind = stored[name]
        if kind == _out_kind(base.shapes[name], out_type):
            out[name] = data, kind
        else:
            values = _gguf().quants.dequantize(data, kind).reshape(base.shapes[name])
            out[name] = _encode(name, values, out_type)
    return out


def read_tensors(path: Path) -> dict[str, tuple[np.ndarray, Any]]:
    """Every tensor of the GGUF at ``path`` as ``gguf.GGUFReader`` gives them (an array over the
    mapped file, bytes by row for quantized types; its GGML type), without building the metadata
    values: GGUFReader takes 3.6 s over the 135M model's 49k-token vocabulary, this 0.03 s."""
    gguf = _gguf()
    kinds = gguf.GGMLQuantizationType
    out = {}
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        at, alignment, infos = _tensor_infos(memoryview(data))  # type: ignore[arg-type]
        start = -(-at // alignment) * alignment
        for name, dims, number, offset in infos:
            kind = kinds(number)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            shape = tuple(reversed(dims))
            count = int(np.prod(shape)) // block * size
            raw = data[start + offset : start + offset + count]
            if len(raw) != count or shape[-1] % block:
                raise ValueError(f"tensor {name!r} does not fit the file")
            if kind in (kinds.F32, kinds.F16):
                array = raw.view(np.float32 if kind == kinds.F32 else np.float16).reshape(shape)
            else:
                array = raw.reshape(*shape[:-1], shape[-1] // block * size)
            out[name] = array, kind
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise EngineError(f"cannot read the tensors of GGUF {path}: {exc}") from exc
    return out


def _tensor_infos(buf: memoryview) -> tuple[int, int, list[tuple[str, list[int], int, int]]]:
    """Where a GGUF's tensor data starts (before alignment), its alignment, and each tensor's
    name, dimensions (GGML order), type and offset; the metadata values are skipped."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    at, alignment = 24, 32
    for _ in range(n_kv):
        key, at = _string(buf, at)
        (kind,) = struct.unpack_from("<I", buf, at)
        if key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, at + 4)
        at = _skip(buf, at + 4, kind)
    infos = []
    for _ in range(n_tensors):
        name, at = _string(buf, at)
        (n_dims,) = struct.unpack_from("<I", buf, at)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, at + 4))
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        infos.append((name, dims, kind, offset))
        at += 4 + 8 * n_dims + 12
    return at, alignment, infos


def _string(buf: memoryview, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8 : at + 8 + size]).decode("utf-8", "replace"), at + 8 + size


def _skip(buf: memoryview, at: int, kind: int) -> int:
    """Where the metadata value of type ``kind`` at ``at`` ends."""
    if kind in _SCALARS:
        return at + _SCALARS[kind]
    if kind == _STRING:
        (size,) = struct.unpack_from("<Q", buf, at)
        return at + 8 + int(size)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALARS:
        return at + int(count) * _SCALARS[item]
    for _ in range(count):  # strings (a vocabulary) or nested arrays
        at = _skip(buf, at, item)
    return at


def write_gguf(
    base: BaseGGUF, tensors: dict[str, tuple[np.ndarray, Any]], target: Path, out_type: str
) -> None:
    """Write ``base``'s metadata and ``tensors`` (in ``base``'s order) as a GGUF at ``target``."""
    gguf = _gguf()
    writer = gguf.GGUFWriter(target, base.arch)
    for key, value, kind, sub in base.fields:
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.add_file_type(_FILE_TYPES[out_type])
    for name in base.shapes:
        data, raw = tensors[name] if name in tensors else base.kept[name]
        writer.add_tensor(name, data, raw_dtype=raw)
    finish(writer)


def finish(writer: Any) -> None:
    """Write a GGUFWriter's header, metadata and tensors to its file, and close it."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


@dataclass(frozen=True)
class WeightUpdate:
    """Timings of one weight update, in seconds: ``export`` (tensors to GGUF while generation
    goes on), ``drain`` (running requests finish, new ones wait), ``swap`` (nothing generates)."""

    path: Path
    export: float
    drain: float
    swap: float


@dataclass(frozen=True)
class Export:
    """A GGUF written by :func:`export_gguf`."""

    path: Path
    out_type: str
    tensors: int
    seconds: float


def export_gguf(
    base_path: Path,
    weights: NamedTensors,
    directory: Path,
    out_type: str = "f16",
    prefix: str = "weights",
    partial: bool = False,
) -> Export:
    """Write ``weights`` as a new GGUF in ``directory`` with ``base_path``'s metadata; with
    ``partial`` (a delta) the weights not sent are ``base_path``'s (:func:`fill_unsent`).

    The file appears whole or not at all (written as ``*.part``, then renamed). SmolLM2-135M's
    273-tensor ``state_dict`` on 2 shared cores: 1.0 s as f16, 1.2 s as q8_0 (4.0 / 3.7 s for the
    first, which reads the base's metadata); docs/engines/llamacpp.md, "Weights into llama.cpp".
    """
    started = time.perf_counter()
    check_out_type(out_type)
    base = read_base(base_path)
    tensors = convert(weights, base, out_type, partial)
    sent = len(tensors)
    if partial:
        tensors = fill_unsent(base, tensors, out_type)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(
            dir=directory, prefix=f"{prefix}.", suffix=f".{out_type}.gguf.part"
        )
    except OSError as exc:
        raise EngineError(f"cannot write a GGUF in {directory}: {exc}") from exc
    os.close(fd)
    final = Path(part.removesuffix(".part"))
    try:
        write_gguf(base, tensors, Path(part), out_type)
        os.replace(part, final)
        _remember(_key(final), replace(base, path=final))  # the next update's base
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot write GGUF {final}: {exc}") from exc
    finally:
        Path(part).unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    what = f"{len(tensors)} tensors ({sent} sent) exported as {out_type}"
    log.info("llamacpp: %s to %s in %.2fs", what, final, seconds)
    return Export(final, out_type, len(tensors), seconds)


async def weights_gguf(
    weights: WeightSource,
    base: Path,
    directory: Path,
    out_type: str,
    model: str,
    partial: bool | None = None,
) -> tuple[Path, bool]:
    """The GGUF that holds ``weights`` and whether it was exported: a path as it is, named
    tensors written into ``directory`` with ``base``'s metadata (in a thread). ``base`` is the
    GGUF being served: a delta (``partial``; by default, whether ``weights`` is a
    :class:`~rollfleet.engines.base.WeightsDelta`) takes the weights it does not send from it."""
    from rollfleet.engines.base import WeightsDelta

    if partial is None:
        partial = isinstance(weights, WeightsDelta)
    if isinstance(weights, (str, Path)):
        path = Path(weights)
        if not await asyncio.to_thread(path.is_file):
            raise EngineError(f"llamacpp: no GGUF file at {path}")
        return path, False
    try:
        export = await asyncio.to_thread(
            export_gguf, base, weights, directory, out_type, f"{model}.update", partial
        )
    except EngineError as exc:
        raise EngineError(f"llamacpp: update_weights: {exc}") from exc
    return export.path, True
