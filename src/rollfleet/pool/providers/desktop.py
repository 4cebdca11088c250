"""``desktop``: OSWorld's ``DesktopEnv`` (PyPI ``desktop-env``, extra ``rollfleet[desktop]``).

The options are the seed's OSWorld flags. Before the pool starts anything, :meth:`preflight`
makes a missing package or hypervisor a clear error (``vmrun`` for vmware, ``VBoxManage``
for virtualbox, a reachable docker engine for docker, boto3 and a region for aws).
Reset reverts the VM to its snapshot (``DesktopEnv.reset``); check takes a screenshot.
:class:`DesktopEnvStandIn` behaves like ``DesktopEnv`` for tests on machines with no VM.
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


class _StandInController:
    def __init__(self, env: DesktopEnvStandIn) -> None:
        self._env = env

    def get_screenshot(self) -> bytes | None:
        """A fake PNG of the 'screen', or None when the VM is down."""
        if self._env.closed or self._env.crashed:
            return None
        return b"\x89PNG\r\n\x1a\n" + self._env.screen.encode()


class DesktopEnvStandIn:
    """Behaves like OSWorld's DesktopEnv (reset/step/evaluate/close) with no VM behind it.

    The 'screen' is a text buffer: ``step`` with a TYPING action (computer_13) or a
    ``pyautogui.write('…')`` string appends to it; ``reset`` reverts it to the snapshot;
    ``evaluate`` scores 1.0 when the screen matches the task's ``expected`` text.
    """

    def __init__(self, **kwargs: Any) -> None:
        """Accept DesktopEnv's keyword arguments."""
        self.kwargs = kwargs
        self.vm_ip, self.server_port = "127.0.0.1", 5000
        self.screen = ""
        self.task_config: dict[str, Any] | None = None
        self.closed = self.crashed = False
        self.resets = self.steps = 0
        self.controller = _StandInController(self)

    def _obs(self) -> dict[str, Any]:
        task = self.task_config or {}
        return {
            "screenshot": self.controller.get_screenshot(),
            "instruction": task.get("instruction"),
        }

    def reset(
        self, task_config: dict[str, Any] | None = None, seed: Any = None, options: Any = None
    ) -> dict[str, Any]:
        """Revert to the snapshot (an empty screen); remember the task."""
        if self.closed:
            raise RuntimeError("DesktopEnv is closed")
        self.screen, self.task_config, self.crashed = "", task_config, False
        self.resets += 1
        return self._obs()

    def step(
        self, action: Any, pause: float = 0
    ) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        """Apply one action; returns (obs, reward, done, info) like DesktopEnv."""
        if self.closed or self.crashed:
            raise RuntimeError("the VM is not running")
        self.steps += 1
        if action in ("DONE", "FAIL"):
            return self._obs(), 0.0, True, {"done": action}
        if isinstance(action, dict) and action.get("action_type") == "TYPING":
            self.screen += str(action.get("text", ""))
        elif (
            isinstance(action, str)
            and action.startswith("pyautogui.write(")
            and action.endswith(")")
        ):
            self.screen += action[len("pyautogui.write(") : -1].strip("'\"")
        return self._obs(), 0.0, False, {}

    def evaluate(self) -> float:
        """1.0 when the screen shows the task's ``expected`` text, else 0.0."""
        expected = (self.task_config or {}).get("expected")
        return 1.0 if expected is not None and self.screen == expected else 0.0

    def close(self) -> None:
        """Stop the 'VM'."""
        self.closed = True
