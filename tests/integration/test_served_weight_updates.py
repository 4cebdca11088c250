"""Weight updates of the vLLM and SGLang engines against a stand-in for their server.

Real vLLM and SGLang need a GPU, so the engines launch ``tests/served_standin.py`` instead
(through their own launcher: only the command line differs). The stand-in implements the
documented update endpoints with the request fields and answers of the real servers, checks
names and shapes like their loaders, and keeps a copy of each checkpoint it loaded, so the
tests can read back exactly what the engine wrote before it deleted its own copy.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from support import free_port, require

from rollfleet.engines.served.engine import ServedEngine
from rollfleet.engines.served.sglang import SGLangEngine
from rollfleet.engines.served.vllm import VLLMEngine
from rollfleet.engines.weights.memfd import push_dir
from rollfleet.errors import EngineError

STANDIN = str(Path(__file__).resolve().parent.parent / "served_standin.py")
HAVE = bool(importlib.util.find_spec("torch") and importlib.util.find_spec("safetensors"))
Launch = Callable[..., Awaitable[ServedEngine]]


def standin_argv(
    python: str, kind: str, model: str, host: str, port: int, extra: list[str]
) -> list[str]:
    """The command line that starts the stand-in as a ``kind`` server."""
    return [
        python,
        STANDIN,
        "--kind",
        kind,
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


class StandInVLLM(VLLMEngine):
    """The vLLM engine, launching the stand-in instead of vLLM."""

    def argv(self, model: str, host: str, port: int, extra: list[str]) -> list[str]:
        """The stand-in's command line."""
        return standin_argv(self.python(), "vllm", model, host, port, extra)


class StandInSGLang(SGLangEngine):
    """The SGLang engine, launching the stand-in instead of SGLang."""

    def argv(self, model: str, host: str, port: int, extra: list[str]) -> list[str]:
        """The stand-in's command line."""
        return standin_argv(self.python(), "sglang", model, host, port, extra)


def tensors() -> list[tuple[str, Any]]:
    """A small model's worth of tensors: several dtypes, a transposed view, a numpy array."""
    import numpy as np
    import torch

    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 4, generator=generator).to(torch.bfloat16)),
        ("model.norm.weight", torch.rand(4, generator=generator)),
        ("lm_head.weight", torch.randn(4, 8, generator=generator).t()),  # not contiguous
        ("model.rotary.inv_freq", np.linspace(0, 1, 3, dtype=np.float16)),
        ("model.mask", torch.tensor([True, False, True])),
        ("model.steps", torch.tensor(3, dtype=torch.int64)),
    ]


def shapes(named: list[tuple[str, Any]]) -> dict[str, list[int]]:
    """The stand-in's model: each parameter's name and shape."""
    return {name: [int(d) for d in t.shape] for name, t in named}


@pytest.fixture
async def launch(tmp_path: Path) -> AsyncIterator[Launch]:
    """Start stand-in engines (scratch checkpoints in tmp_path/shm); stop them afterwards."""
    require(HAVE, "torch and safetensors (rollfleet[hf,test])")
    params = tmp_path / "params.json"
    params.write_text(json.dumps(shapes(tensors())))
    (tmp_path / "shm").mkdir()
    started: list[ServedEngine] = []

    async def start(kind: type[ServedEngine], *extra: str) -> ServedEngine:
        engine = kind(
            "org/model",
            port=free_port(),
            startup_timeout_s=60,
            extra_args=["--keep", str(tmp_path / "kept"), "--params", str(params), *extra],
        )
        engine.weights_dir = str(tmp_path / "shm")
        await engine.start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.stop()


async def calls(engine: ServedEngine) -> list[dict[str, Any]]:
    """The calls the stand-in received, in order."""
    return list((await engine.client.get("/_calls")).json())


def assert_removed(directory: str, parent: Path) -> None:
    """The engine's checkpoint ``directory`` was made in ``parent`` and is gone now."""
    assert Path(directory).parent == parent and not Path(directory).exists()


def assert_holds_exactly(kept: str, named: list[tuple[str, Any]]) -> None:
    """The checkpoint in ``kept`` holds exactly ``named``: names, dtypes, shapes, values."""
    import torch
    from safetensors.torch import load_file

    files = list(Path(kept).iterdir())
    assert [f.name for f in files] == ["model.safetensors"]
    loaded = load_file(str(files[0]))
    assert sorted(loaded) == sorted(name for name, _ in named)
    for name, tensor in named:
        expected = tensor if isinstance(tensor, torch.Tensor) else torch.from_numpy(tensor)
        assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), name


async def test_vllm_fake_server_reloads_pushed_tensors_from_a_removed_checkpoint(
    launch: Launch, tmp_path: Path
) -> None:
    engine = await launch(StandInVLLM)
    named = tensors()
    assert await engine.update_weights(named, version=7) == 7 and engine.version == 7
    rpc, reset = await calls(engine)
    directory = rpc["body"]["kwargs"]["weights_path"]
    assert rpc["path"] == "/collective_rpc" and rpc["body"] == {
        "method": "reload_weights",
        "kwargs": {"weights_path": directory, "is_checkpoint_format": True},
    }
    assert reset == {"path": "/reset_prefix_cache", "body": {}}
    assert_removed(directory, tmp_path / "shm")
    assert_holds_exactly(rpc["kept"], named)
    assert list((tmp_path / "shm").iterdir()) == []


async def test_vllm_fake_server_refusal_raises_its_message_and_keeps_the_version(
    launch: Launch, tmp_path: Path
) -> None:
    import torch

    engine = await launch(StandInVLLM)
    await engine.update_weights(tensors(), version=3)
    misshaped = [(n, torch.zeros(2) if n == "model.norm.weight" else t) for n, t in tensors()]
    with pytest.raises(EngineError, match=r"^vllm: .*HTTP 500.*model\.norm\.weight of shape \[2\]"):
        await engine.update_weights(misshaped, version=4)
    assert engine.version == 3
    assert [c["path"] for c in await calls(engine)][2:] == ["/collective_rpc"]  # no cache reset
    assert list((tmp_path / "shm").iterdir()) == []


async def test_vllm_fake_server_reloads_a_checkpoint_path_as_given_and_leaves_it(
    launch: Launch, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    step = tmp_path / "step-9"
    step.mkdir()
    named = [(n, t) for n, t in tensors() if hasattr(t, "detach")]
    save_file({n: t.contiguous() for n, t in named}, str(step / "model.safetensors"))
    engine = await launch(StandInVLLM)
    assert await engine.update_weights(step) == 1 and engine.version == 1
    rpc, _ = await calls(engine)
    assert rpc["body"]["kwargs"] == {"weights_path": str(step), "is_checkpoint_format": True}
    assert (step / "model.safetensors").exists()  # not ours to remove
    assert_holds_exactly(rpc["kept"], named)


async def test_sglang_fake_server_without_sglang_loads_tensors_from_disk(
    launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", None)  # sglang does not import here
    engine = await launch(StandInSGLang)
    engine.weights_dir = None  # the default: shared memory
    named = tensors()
    assert await engine.update_weights(named, version=5) == 5 and engine.version == 5
    (disk,) = await calls(engine)
    directory = disk["body"]["model_path"]
    assert disk["path"] == "/update_weights_from_disk" and disk["body"] == {
        "model_path": directory,
        "load_format": "safetensors",
        "weight_version": "5",
    }
    assert_removed(directory, Path(push_dir()))
    assert_holds_exactly(disk["kept"], named)


async def test_sglang_fake_server_success_false_raises_its_message_and_keeps_the_version(
    launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", None)
    engine = await launch(StandInSGLang, "--refuse", "CUDA out of memory")
    with pytest.raises(EngineError, match=r"^sglang: .*HTTP 400.*CUDA out of memory"):
        await engine.update_weights(tensors(), version=2)
    with pytest.raises(EngineError, match="sglang: .*CUDA out of memory"):
        await engine.update_weights("/models/step-2")
    assert engine.version == 0
    assert list((tmp_path / "shm").iterdir()) == []


async def test_sglang_fake_server_gets_serialized_buckets_when_sglang_imports(
    launch: Launch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With sglang importable, tensors go to /update_weights_from_tensor in buckets, made by
    SGLang's serializer (here a stand-in that lists names), and the cache is flushed once."""
    utils = types.ModuleType("sglang.srt.utils")
    serializer = types.SimpleNamespace(
        serialize=lambda items, output_str: json.dumps([name for name, _ in items])
    )
    utils.MultiprocessingSerializer = serializer  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    engine = await launch(StandInSGLang)
    engine.bucket_bytes = 64  # type: ignore[attr-defined]
    assert await engine.update_weights(tensors()) == 1
    sent = await calls(engine)
    assert {c["path"] for c in sent} == {"/update_weights_from_tensor"} and len(sent) > 1
    names = [json.loads(c["body"]["serialized_named_tensors"][0]) for c in sent]
    assert sum(names, []) == [name for name, _ in tensors()]
    assert [c["body"]["flush_cache"] for c in sent] == [False] * (len(sent) - 1) + [True]
    assert list((tmp_path / "shm").iterdir()) == []


async def test_served_fake_server_not_started_or_bad_tensors_write_nothing(
    launch: Launch, tmp_path: Path
) -> None:
    engine = StandInVLLM("org/model", port=free_port())
    with pytest.raises(EngineError, match="vllm: engine is not started"):
        await engine.update_weights(tensors(), version=1)
    started = await launch(StandInVLLM)
    with pytest.raises(EngineError, match=r"vllm: cannot write the checkpoint: tensor 'w'"):
        await started.update_weights([("w", b"\x00")], version=1)
    with pytest.raises(EngineError, match="'model.norm.weight' is named twice"):
        await started.update_weights(tensors() + tensors()[1:2], version=1)
    assert started.version == 0 and await calls(started) == []
    assert list((tmp_path / "shm").iterdir()) == []
