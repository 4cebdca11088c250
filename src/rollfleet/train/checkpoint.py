"""The trainer's checkpoints: what ``rollfleet train`` resumes from after a kill -9.

``OUTPUT/checkpoints/step-{s}/`` holds the trainable weights (all of them under full fine-tuning,
the LoRA adapter otherwise), the optimizer's state and ``meta.json`` (the step, the run's
fingerprint, the step records so far). ``OUTPUT/checkpoints/latest`` names the newest complete one:
it is replaced atomically after the directory is written and synced, so a kill at any moment
leaves either the old checkpoint or the new one, never half of one. Older directories are removed
once ``latest`` moved past them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.errors import InvalidInput
from rollfleet.taskfile import decode_json

LATEST = "latest"


@dataclass(frozen=True)
class Checkpoint:
    """A finished step as saved: ``step`` is the last step trained on."""

    step: int
    records: list[dict[str, Any]]
    path: Path


def trainable_state(model: Any) -> dict[str, Any]:
    """The tensors a checkpoint keeps: those the optimizer updates, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save(
    root: Path,
    step: int,
    model: Any,
    optimizer: Any,
    records: list[dict[str, Any]],
    fingerprint: dict[str, Any],
) -> Path:
    """Write the checkpoint of ``step`` under ``root`` and make it the latest; returns its path."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    work = root / f".step-{step}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    torch.save(trainable_state(model), work / "policy.pt")
    torch.save(optimizer.state_dict(), work / "optimizer.pt")
    meta = {"step": step, "fingerprint": fingerprint, "records": records}
    (work / "meta.json").write_text(json.dumps(meta))
    for name in ("policy.pt", "optimizer.pt", "meta.json"):
        with (work / name).open("rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint's directory, or None when ``root`` holds none at all.

    InvalidInput, never a silent restart, when it holds something else: a ``latest`` that names
    anything but a complete ``step-N`` beside it, or checkpoints without a ``latest``."""
    pointer = root / LATEST
    if not pointer.exists():
        found = sorted(p.name for p in root.glob("step-*"))
        if found:
            raise InvalidInput(
                f"{pointer}: missing, but {root} holds {', '.join(found[:3])}; restore it (its"
                " one line names the checkpoint to resume) or use another --output-dir"
            )
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    except (OSError, UnicodeDecodeError):
        name = None
    if name is None or not _STEP.fullmatch(name):
        raise InvalidInput(
            f"{pointer}: must name a checkpoint as step-N inside {root}, not {name!r}"
        )
    where = root / name
    if not (where / "meta.json").is_file():
        raise InvalidInput(f"{pointer}: names {name}, which is not a complete checkpoint")
    return where


def find(root: Path, fingerprint: dict[str, Any]) -> Path | None:
    """The latest checkpoint under ``root`` when a run with ``fingerprint`` may resume it; None
    when there is none.

    Reads only ``meta.json``, so a run started with other settings is refused before it loads a
    model: InvalidInput naming the settings that differ (resuming would mix two runs), or the
    file when it is corrupt."""
    where = latest(root)
    if where is None:
        return None
    saved = _meta(where / "meta.json")["fingerprint"]
    differ = [
        f"{key} {saved.get(key)!r} (now {fingerprint.get(key)!r})"
        for key in sorted(set(saved) | set(fingerprint))
        if saved.get(key) != fingerprint.get(key)
    ]
    if differ:
        raise InvalidInput(
            f"{where}: a checkpoint of a run with other settings: {'; '.join(differ)}; "
            "use another --output-dir, or the same settings to resume it"
        )
    return where


def load(where: Path, model: Any, optimizer: Any) -> Checkpoint:
    """Restore the checkpoint in ``where`` (from ``find``) into ``model`` and ``optimizer``.

    InvalidInput naming the file when it is corrupt or holds another model's tensors."""
    meta = _meta(where / "meta.json")
    state = _tensors(where / "policy.pt")
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown or not all(_fits(params[n], v) for n, v in state.items()):
        raise InvalidInput(
            f"{where / 'policy.pt'}: tensors that are not this model's"
            f" ({', '.join(unknown[:3]) or 'shapes differ'})"
        )
    import torch

    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    try:
        optimizer.load_state_dict(_tensors(where / "optimizer.pt"))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise InvalidInput(f"{where / 'optimizer.pt'}: not this run's optimizer: {exc}") from None
    return Checkpoint(step=int(meta["step"]), records=list(meta["records"]), path=where)


_STEP = re.compile(r"step-(0|[1-9][0-9]{0,8})")


def _meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json, checked field by field (InvalidInput naming the field)."""
    meta = decode_json(_read(path), str(path))
    if not isinstance(meta, dict):
        raise InvalidInput(f"{path}: must hold a JSON object")
    for field, kind in (("step", int), ("fingerprint", dict), ("records", list)):
        if not isinstance(meta.get(field), kind) or isinstance(meta.get(field), bool):
            raise InvalidInput(f"{path}: field {field!r} must be {kind.__name__}")
    return meta


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read: {exc}") from None


def _tensors(path: Path) -> Any:
    """A checkpoint's torch file, loaded without running code (InvalidInput when corrupt)."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise InvalidInput(f"{path}: not a readable checkpoint file: {str(exc)[:200]}") from None


def _fits(param: Any, value: Any) -> bool:
    return hasattr(value, "shape") and tuple(value.shape) == tuple(param.shape)
