"""``desktop``: OSWorld's ``DesktopEnv`` (PyPI ``desktop-env``, extra ``rollfleet[desktop]``).

The options are the seed's OSWorld flags. Before the pool starts anything, :meth:`preflight`
makes a missing package or hypervisor a clear error (``vmrun`` for vmware, ``VBoxManage``
for virtualbox, a reachable docker engine for docker, boto3 and a region for aws).
Reset reverts the VM to its snapshot (``DesktopEnv.reset``); check takes a screenshot.
:class:`DesktopEnvStandIn` (in :mod:`~rollfleet.pool.providers.desktop_standin`) behaves like
``DesktopEnv`` for tests on machines with no VM.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.errors import PoolError
from rollfleet.pool.providers.desktop_standin import DesktopEnvStandIn

__all__ = ["DesktopEnvStandIn", "DesktopOptions", "DesktopProvider", "check_hypervisor"]

HYPERVISOR_TOOL = {"vmware": "vmrun", "virtualbox": "VBoxManage", "docker": "docker"}


class DesktopOptions(BaseModel):
    """The seed's OSWorld options, passed to ``DesktopEnv``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider_name: Literal["vmware", "virtualbox", "docker", "aws"] = "vmware"
    path_to_vm: str | None = None
    snapshot_name: str = "init_state"
    screen_width: int = Field(default=1920, ge=320)
    screen_height: int = Field(default=1080, ge=240)
    headless: bool = False
    client_password: str = "password"
    action_space: Literal["computer_13", "pyautogui"] = "computer_13"
    region: str | None = None
    os_type: str = "Ubuntu"
    require_a11y_tree: bool = True
    extra: dict[str, Any] = Field(default_factory=dict, description="more DesktopEnv arguments")

    def env_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DesktopEnv(...)``."""
        return {
            "provider_name": self.provider_name,
            "path_to_vm": self.path_to_vm,
            "snapshot_name": self.snapshot_name,
            "action_space": self.action_space,
            "screen_size": (self.screen_width, self.screen_height),
            "headless": self.headless,
            "client_password": self.client_password,
            "region": self.region,
            "os_type": self.os_type,
            "require_a11y_tree": self.require_a11y_tree,
            **self.extra,
        }


def load_desktop_env() -> Callable[..., Any]:
    """OSWorld's ``DesktopEnv`` class; PoolError naming the extra when it is not installed."""
    try:
        module = importlib.import_module("desktop_env.desktop_env")
    except ImportError as exc:
        raise PoolError(
            "desktop pool: the desktop-env package is not installed; "
            "install it with: pip install 'rollfleet[desktop]'"
        ) from exc
    return module.DesktopEnv  # type: ignore[no-any-return]


def check_hypervisor(
    options: DesktopOptions, which: Callable[[str], str | None] = shutil.which
) -> None:
    """Raise PoolError naming what is missing for ``options.provider_name`` on this machine."""
    name = options.provider_name
    tool = HYPERVISOR_TOOL.get(name)
    if tool and which(tool) is None:
        raise PoolError(
            f"desktop pool: provider_name={name!r} needs the `{tool}` command on PATH, "
            f"and it is not there; install {name} or choose another provider_name"
        )
    if name == "docker" and not (
        os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists()
    ):
        raise PoolError(
            "desktop pool: provider_name='docker' but no docker engine is reachable "
            "(no DOCKER_HOST and no /var/run/docker.sock)"
        )
    if name == "aws":
        if importlib.util.find_spec("boto3") is None:
            raise PoolError("desktop pool: provider_name='aws' needs boto3 (pip install boto3)")
        if not (options.region or os.environ.get("AWS_REGION")):
            raise PoolError(
                "desktop pool: provider_name='aws' needs a region (option region or AWS_REGION)"
            )
    if (
        name in ("vmware", "virtualbox")
        and options.path_to_vm
        and not Path(options.path_to_vm).exists()
    ):
        raise PoolError(f"desktop pool: path_to_vm {options.path_to_vm} does not exist")


class DesktopProvider:
    """Instances are ``DesktopEnv`` objects (or anything built by ``env_class`` with its API)."""

    name = "desktop"

    def __init__(
        self,
        options: DesktopOptions | None = None,
        *,
        env_class: Callable[..., Any] | None = None,
        which: Callable[[str], str | None] = shutil.which,
    ) -> None:
        """``env_class``: what to build instead of OSWorld's DesktopEnv (e.g. the stand-in)."""
        self.options = options or DesktopOptions()
        self._env_class = env_class
        self._which = which

    def preflight(self) -> None:
        """Fail now, clearly, when the package or the hypervisor is missing."""
        check_hypervisor(self.options, self._which)
        if self._env_class is None:
            self._env_class = load_desktop_env()

    async def start(self, instance_id: str) -> Any:
        """Build a DesktopEnv (it boots or attaches to the VM)."""
        self.preflight()
        assert self._env_class is not None
        return await asyncio.to_thread(self._env_class, **self.options.env_kwargs())

    async def reset(self, handle: Any) -> None:
        """Revert the VM to its snapshot."""
        await asyncio.to_thread(handle.reset)

    async def check(self, handle: Any) -> None:
        """Take a screenshot through the VM's controller; raise if none comes back."""
        controller = getattr(handle, "controller", None)
        if controller is None:
            return
        shot = await asyncio.to_thread(controller.get_screenshot)
        if not shot:
            raise PoolError(f"desktop VM at {self.endpoint(handle)} returned no screenshot")

    async def stop(self, handle: Any) -> None:
        """Close the DesktopEnv (stops the VM)."""
        await asyncio.to_thread(handle.close)

    def endpoint(self, handle: Any) -> str | None:
        """The in-VM server's URL, when the env exposes its address."""
        ip = getattr(handle, "vm_ip", None)
        return f"http://{ip}:{getattr(handle, 'server_port', 5000)}" if ip else None
