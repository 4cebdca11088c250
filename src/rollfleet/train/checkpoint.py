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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.errors import InvalidInput

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
    """The newest complete checkpoint's directory, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    found = root / pointer.read_text().strip()
    return found if (found / "meta.json").is_file() else None


def load(root: Path, model: Any, optimizer: Any, fingerprint: dict[str, Any]) -> Checkpoint | None:
    """Restore the latest checkpoint into ``model`` and ``optimizer``; None when there is none.

    InvalidInput when it was written by a run with other settings (named): resuming it would mix
    two runs."""
    import torch

    where = latest(root)
    if where is None:
        return None
    meta = json.loads((where / "meta.json").read_text())
    differ = [
        f"{key} {meta['fingerprint'].get(key)!r} (now {value!r})"
        for key, value in fingerprint.items()
        if meta["fingerprint"].get(key) != value
    ]
    if differ:
        raise InvalidInput(
            f"{where}: a checkpoint of a run with other settings: {'; '.join(differ)}; "
            "use another --output-dir, or the same settings to resume it"
        )
    state = torch.load(where / "policy.pt", weights_only=True)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    optimizer.load_state_dict(torch.load(where / "optimizer.pt", weights_only=True))
    return Checkpoint(step=int(meta["step"]), records=list(meta["records"]), path=where)
