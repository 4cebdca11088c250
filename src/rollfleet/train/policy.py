"""The policy a trainer updates: a local model (the bundled SmolLM2 by default) as a trainable
transformers model, and one GRPO step over a batch of experiences (micro-batched, token-weighted,
gradient-clipped).

transformers loads a GGUF with its GGUF loader (the ``gguf`` package): the bundled Q4_1 weights
are dequantized to float32, 134.5M parameters, ~25 s on 2 cores. A transformers model directory
(``config.json`` and weights) loads with ``from_pretrained``, in float32, with its own tokenizer.
Nothing is downloaded. The ``state_dict`` carries transformers' names, which is what
:func:`rollfleet.engines.weights.push.push_weights` sends and every engine takes (llama.cpp writes
them back into the GGUF it serves).
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.coordinator.experiences import Experience
from rollfleet.errors import InvalidInput
from rollfleet.train.grpo import (
    DEFAULT_LOSS,
    LossOptions,
    TrainBatch,
    collate,
    drop_uniform_groups,
    grpo_loss,
    padding_fraction,
    token_logprobs,
)

LORA_TARGETS = ("q_proj", "v_proj")
PEFT_PREFIX = "base_model.model."


GGUF, HF = "gguf", "hf"  # what a local model is: a GGUF file, or a transformers directory
HF_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def model_format(path: Path) -> str:
    """What the local model at ``path`` is: :data:`GGUF` (a file starting with GGUF's magic) or
    :data:`HF` (a directory of a transformers causal LM: ``config.json`` and weights). Anything
    else is InvalidInput, one line naming ``--model``; no name is looked up on the Hub."""
    if path.is_dir():
        return _hf_directory(path)
    if not path.is_file():
        raise InvalidInput(
            f"--model {path}: no such local file or directory (train downloads nothing, so a"
            " Hugging Face hub id will not do): pass a transformers model directory or a GGUF file"
        )
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InvalidInput(f"--model {path}: cannot read it: {exc}") from None
    if magic != b"GGUF":
        raise InvalidInput(
            f"--model {path}: not a GGUF file (no GGUF header); pass a GGUF file or a"
            " transformers model directory (config.json and weights)"
        )
    return GGUF


def _hf_directory(path: Path) -> str:
    """:data:`HF` when ``path`` holds a causal LM's ``config.json`` and weights."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = path / "config.json"
    if not config.is_file():
        raise InvalidInput(
            f"--model {path}: a directory without config.json; pass a transformers model"
            " directory (config.json and weights) or a GGUF file"
        )
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        kind = None
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InvalidInput(
            f"--model {path}: config.json names no causal language model transformers knows"
            f" (model_type {kind!r})"
        )
    if not any(next(path.glob(pattern), None) for pattern in HF_WEIGHTS):
        raise InvalidInput(
            f"--model {path}: no weights beside config.json ({' or '.join(HF_WEIGHTS)})"
        )
    return HF


def check_model(path: Path, engine: str) -> None:
    """Refuse a ``--model`` the trainer cannot load or ``engine`` (llamacpp or hf) cannot serve
    and take weights into, before anything is written. llama.cpp serves GGUF files only, and
    the trainer's weights reach it through a GGUF written with the served one's metadata
    (:mod:`rollfleet.engines.weights.gguf_export`: a llama GGUF); transformers renders the
    agents' chat messages with the tokenizer's chat template."""
    found = model_format(path)
    if found == HF and engine == "llamacpp":
        raise InvalidInput(
            f"--model {path}: a transformers model directory; the llama.cpp engine serves GGUF"
            " files only (the trainer's weights reach it through the GGUF it serves): pass"
            " --engine hf"
        )
    if found == HF and not _chat_template(path):
        raise InvalidInput(
            f"--model {path}: its tokenizer has no chat template, and the agents talk to the"
            " model in chat messages; use a chat (instruct) model or add one"
            " (chat_template.jinja)"
        )
    if found == GGUF and engine == "llamacpp":
        from rollfleet.engines.weights.gguf_export import read_base
        from rollfleet.errors import EngineError

        try:
            read_base(path)  # its metadata, remembered for the first weights export
        except EngineError as exc:
            raise InvalidInput(f"--model {path}: {exc}; pass --engine hf to serve it") from None


def _chat_template(directory: Path) -> bool:
    """Whether a transformers directory's tokenizer has a chat template (a file of its own, or
    in tokenizer_config.json)."""
    if any((directory / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def load_policy(path: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``, float32 and trainable, from a local GGUF file (default: the
    bundled SmolLM2) or transformers model directory (:func:`model_format`); nothing is
    downloaded. InvalidInput naming ``--model`` when it does not load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollfleet.engines.llamacpp.model import bundled_gguf

    source = Path(path) if path else bundled_gguf()
    where, more = (
        (source.parent, {"gguf_file": source.name})
        if model_format(source) == GGUF
        else (source, {})
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, local_files_only=True, **more
        )
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **more)
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidInput(f"--model {source}: cannot load it: {reason}") from exc
    return model.train(), tokenizer


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did."""

    loss: float
    ratio_mean: float
    clipped: float
    approx_kl: float
    entropy: float  # mean entropy of the policy's next-token distribution on action tokens
    kl_initial: float | None  # k3 KL(policy || initial) per action token: every row's when the
    # KL is in the loss, else the first micro-batch's (its shortest rows); None without reference
    grad_norm: float
    action_tokens: int
    seconds: float
    rows_dropped: int = 0  # rows dynamic sampling left out (their group all scored alike)
    padding: float = 0.0  # share of the micro-batches' token slots that were padding


def grpo_step(
    model: Any,
    optimizer: Any,
    experiences: Sequence[Experience],
    *,
    micro_batch: int = 4,
    max_grad_norm: float = 1.0,
    pad_id: int = 0,
    reference: Callable[[TrainBatch], Any] | None = None,
    options: LossOptions = DEFAULT_LOSS,
) -> StepStats | None:
    """One optimizer step on GRPO's loss over ``experiences``, ``micro_batch`` rows at a time;
    each micro-batch weighs by its share of the action tokens (the loss is a mean per token).
    ``reference`` (a batch's logprobs under the initial policy) adds the KL to it to the stats,
    and to the loss under ``options.kl_coef``. None, with nothing changed, when ``options`` leave
    no token to train on (dynamic sampling dropped every row, or every action token is of a
    truncated row); InvalidInput when the experiences hold none at all."""
    import torch

    if micro_batch < 1:
        raise InvalidInput(f"grpo_step: micro_batch must be at least 1, got {micro_batch}")
    if options.kl_coef and reference is None:
        raise InvalidInput("grpo_step: kl_coef needs the reference policy (the initial one)")
    started = time.perf_counter()
    kept = drop_uniform_groups(experiences) if options.dynamic_sampling else list(experiences)
    kept = micro_batch_order(kept)
    chunks = [
        collate(kept[i : i + micro_batch], pad_id, mask_truncated=options.mask_truncated)
        for i in range(0, len(kept), micro_batch)
    ]
    total = sum(c.action_tokens for c in chunks)
    if total == 0:
        if not any(any(e.action_mask[1:]) for e in experiences):
            raise InvalidInput("grpo_step: the experiences hold no action token to train on")
        return None
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(("loss", "ratio_mean", "clipped", "approx_kl", "entropy"), 0.0)
    kl = 0.0
    measured = 0  # action tokens the KL to the initial policy was measured on
    for batch in [c for c in chunks if c.action_tokens]:
        share = batch.action_tokens / total
        # Off the loss, the KL to the initial policy is a figure: the first micro-batch's will do
        # (otherwise the initial policy runs a forward pass over every row for a figure).
        with torch.no_grad():
            initial = (
                reference(batch)
                if reference is not None and (options.kl_coef or not measured)
                else None
            )
        new, spread = token_logprobs(
            model, batch, entropy=True, entropy_grad=bool(options.entropy_coef)
        )
        loss, stats = grpo_loss(new, batch, options, reference=initial, entropies=spread)
        (loss * share).backward()
        for key in sums:
            sums[key] += (getattr(stats, key) or 0.0) * share
        if stats.kl_initial is not None:
            kl += stats.kl_initial * batch.action_tokens
            measured += batch.action_tokens
    norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], max_grad_norm
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(
        **sums,
        kl_initial=kl / measured if measured else None,
        grad_norm=float(norm),
        action_tokens=total,
        seconds=time.perf_counter() - started,
        rows_dropped=len(experiences) - len(kept),
        padding=padding_fraction(chunks),
    )


def micro_batch_order(rows: Sequence[Experience]) -> list[Experience]:
    """``rows`` in the order a step micro-batches them: rows with the same prompt (the tokens
    before a row's first action token) side by side, so a micro-batch computes the prompt they
    share once; the shorter first among rows alike (rows of like length share a micro-batch:
    less padding), and rows whose prompt no other row has by length alone."""

    def prompt(e: Experience) -> tuple[int, ...]:
        first = next((i for i, m in enumerate(e.action_mask) if m), len(e.tokens))
        return tuple(e.tokens[:first])

    prompts = [prompt(e) for e in rows]
    seen = Counter(prompts)
    order = sorted(
        range(len(rows)),
        key=lambda i: (prompts[i] if seen[prompts[i]] > 1 else (), len(rows[i].tokens)),
    )
    return [rows[i] for i in order]


class Policy:
    """What a trainer holds: the model (LoRA adapters on it, or every weight trainable), its
    optimizer, and the initial policy the KL is measured against."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float,
        lora_rank: int | None = 16,
        loss: LossOptions = DEFAULT_LOSS,
    ) -> None:
        """Wrap ``model``: LoRA of ``lora_rank`` on q_proj and v_proj, or full fine-tuning when
        ``lora_rank`` is None (then a frozen copy is kept as the initial policy); every step
        takes the ``loss`` options."""
        import torch

        if lora_rank is not None and not 1 <= lora_rank <= 1024:
            raise InvalidInput(f"--lora-rank must be 1 to 1024, got {lora_rank}")
        self.lora = lora_rank is not None
        self._initial = None
        if lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            named = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            if not named & set(LORA_TARGETS):
                raise InvalidInput(
                    f"--model: LoRA goes on {' and '.join(LORA_TARGETS)}, which this"
                    f" {type(model).__name__} does not have; pass --lora-rank 0 (full fine-tuning)"
                )

            config = LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank,
                lora_dropout=0.0,
                target_modules=list(LORA_TARGETS),
            )
            with warnings.catch_warnings():  # peft asks transformers 5 for a renamed property
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is dep")
                model = get_peft_model(model, config)
        else:
            self._initial = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = model
        self.loss = loss
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trainable, lr=lr)

    @property
    def trainable_params(self) -> int:
        """How many parameters the optimizer updates."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _initial_logprobs(self, batch: TrainBatch) -> Any:
        """A batch's logprobs under the initial policy (the adapters off, or the frozen copy)."""
        off: AbstractContextManager[Any] = (
            self.model.disable_adapter() if self.lora else nullcontext()
        )
        with off:
            return token_logprobs(self.model if self.lora else self._initial, batch)

    def step(self, experiences: Sequence[Experience]) -> StepStats | None:
        """One GRPO optimizer step, with the KL to the initial policy (None: the loss options
        left nothing to train on, see :func:`grpo_step`)."""
        return grpo_step(
            self.model,
            self.optimizer,
            experiences,
            reference=self._initial_logprobs,
            options=self.loss,
        )


def push_tensors(model: Any) -> tuple[dict[str, Any], bool]:
    """``(tensors, lora)``, by transformers' names: a peft model's LoRA matrices merged into
    their base weights (``W + scale * B @ A``: only these change, a delta push), else every
    weight."""
    import torch
    from peft.tuners.lora import LoraLayer

    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                layer: Any = module
                weight = layer.get_base_layer().weight
                merged = weight.clone()
                for adapter in layer.active_adapters:
                    merged += layer.get_delta_weight(adapter).to(weight.dtype)
                out[name.removeprefix(PEFT_PREFIX) + ".weight"] = merged
    return (out, True) if out else (dict(model.state_dict()), False)


async def publish(
    model: Any,
    gateway: Any,
    coordinator: Any,
    version: int,
    *,
    base: int,
    token: str | None = None,
    changed: bool = True,
) -> None:
    """Push ``model``'s weights to the engines behind ``gateway`` as ``version`` and tell
    ``coordinator`` they serve it. Under LoRA: the adapter itself when every engine behind a
    gateway in this process applies adapters (llama.cpp: a few MB, no model written), else the
    merged q/v matrices as a delta against ``base``, the version they serve. A step that
    changed nothing (``changed`` False) sends no tensor: the engines serve the same weights as
    ``version``."""
    from rollfleet.engines.gateway.gateway import Gateway
    from rollfleet.engines.weights.lora import peft_adapter
    from rollfleet.engines.weights.push import push_weights

    if not changed:
        await push_weights(gateway, [], version=version, token=token, delta=True, base=base)
        await coordinator.set_policy_version(version)
        return

    adapter = (
        peft_adapter(model) if isinstance(gateway, Gateway) and gateway.takes_adapters else None
    )
    if adapter is not None:
        await push_weights(gateway, adapter, version=version, lora_alpha=adapter.alpha)
        await coordinator.set_policy_version(version)
        return
    tensors, lora = push_tensors(model)
    await push_weights(
        gateway,
        tensors.items(),
        version=version,
        token=token,
        delta=lora,
        base=base if lora else None,
    )
    await coordinator.set_policy_version(version)
