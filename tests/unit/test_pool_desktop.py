"""The desktop provider against the in-package DesktopEnv stand-in (no VM runs on CI machines)."""

from __future__ import annotations

import importlib.util

import pytest

from rollfleet.errors import PoolError
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.desktop import (
    DesktopEnvStandIn,
    DesktopOptions,
    DesktopProvider,
    check_hypervisor,
)


def everything(tool: str) -> str | None:
    """A PATH on which every hypervisor tool exists."""
    return f"/usr/bin/{tool}"


def nothing(tool: str) -> str | None:
    """A PATH with no hypervisor tool."""
    return None


def standin_pool(size: int = 1, **options: object) -> Pool:
    """A pool of stand-in desktops."""
    provider = DesktopProvider(
        DesktopOptions(**options),
        env_class=DesktopEnvStandIn,  # type: ignore[arg-type]
        which=everything,
    )
    return Pool(provider, size, name="osworld", policy=PoolPolicy(backoff_s=0.0))


async def test_desktop_standin_gets_the_seed_options_and_an_endpoint() -> None:
    pool = standin_pool(
        provider_name="virtualbox",
        snapshot_name="clean",
        screen_width=1280,
        screen_height=720,
        headless=True,
        client_password="pw",
        action_space="pyautogui",
    )
    async with pool, pool.lease(attempt_id="a1", timeout=5) as instance:
        kwargs = instance.handle.kwargs
        assert kwargs["provider_name"] == "virtualbox" and kwargs["snapshot_name"] == "clean"
        assert kwargs["screen_size"] == (1280, 720) and kwargs["headless"] is True
        assert kwargs["client_password"] == "pw" and kwargs["action_space"] == "pyautogui"
        assert instance.endpoint == "http://127.0.0.1:5000"


async def test_desktop_standin_is_reverted_to_its_snapshot_between_holders() -> None:
    pool = standin_pool()
    async with pool:
        async with pool.lease(timeout=5) as first:
            env = first.handle
            env.reset(task_config={"instruction": "type hi", "expected": "hi"})
            _, _, done, _ = env.step({"action_type": "TYPING", "text": "hi"})
            assert not done and env.evaluate() == 1.0
        async with pool.lease(timeout=5) as second:
            assert second.handle is env and env.screen == "" and env.evaluate() == 0.0
            assert env.resets == 2  # the holder's own reset, then the pool's
    assert env.closed


async def test_desktop_standin_crashed_vm_is_replaced() -> None:
    pool = standin_pool()
    async with pool:
        async with pool.lease(timeout=5) as first:
            first.handle.crashed = True  # reset will revive it, so crash it for the check too
            first.handle.reset = lambda: None
        stats = await pool.wait_for(lambda s: s.replacements == 1 and s.states["IDLE"] == 1, 5)
        assert "no screenshot" in (stats.instances[0].last_error or "")
        async with pool.lease(timeout=5) as second:
            assert second.handle is not first.handle and first.handle.closed


@pytest.mark.parametrize(
    ("provider", "tool"), [("vmware", "vmrun"), ("virtualbox", "VBoxManage"), ("docker", "docker")]
)
async def test_desktop_missing_hypervisor_is_a_clear_error_at_start(
    provider: str, tool: str
) -> None:
    pool = Pool(
        DesktopProvider(
            DesktopOptions(provider_name=provider),
            env_class=DesktopEnvStandIn,  # type: ignore[arg-type]
            which=nothing,
        ),
        1,
        name="osworld",
    )
    with pytest.raises(PoolError, match=f"`{tool}`"):
        await pool.start()
    await pool.close()


def test_desktop_missing_vm_image_is_a_clear_error() -> None:
    with pytest.raises(PoolError, match="path_to_vm /nonexistent/vm.vmx does not exist"):
        check_hypervisor(DesktopOptions(path_to_vm="/nonexistent/vm.vmx"), everything)


@pytest.mark.skipif(
    importlib.util.find_spec("desktop_env") is not None,
    reason="desktop-env is installed here, so it cannot be missing",
)
def test_desktop_missing_package_names_the_extra() -> None:
    provider = DesktopProvider(DesktopOptions(provider_name="vmware"), which=everything)
    with pytest.raises(PoolError, match=r"rollfleet\[desktop\]"):
        provider.preflight()


def test_desktop_standin_step_and_close_behave_like_desktopenv() -> None:
    env = DesktopEnvStandIn(provider_name="docker")
    obs = env.reset(task_config={"instruction": "write", "expected": "ok"})
    assert obs["instruction"] == "write" and obs["screenshot"].startswith(b"\x89PNG")
    env.step("pyautogui.write('ok')")
    assert env.evaluate() == 1.0
    assert env.step("DONE")[2] is True
    env.close()
    with pytest.raises(RuntimeError):
        env.step("DONE")
