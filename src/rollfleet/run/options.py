"""What ``rollfleet run`` takes: :class:`RunOptions`, checked before anything starts. Each field a
user sets is declared here once, with its flag (:func:`rollfleet.flags.flag`): ``rollfleet run``
builds its command line from these fields, the osworld desktop's from :class:`DesktopFlags`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.envs import EnvSpec, Mode, check_observation, get_mode
from rollfleet.errors import InvalidInput
from rollfleet.flags import flag

AGENT = "rollfleet.agents.loop:agent"
DEFAULT_ROLLOUTS = 8
DEFAULT_OUTPUT = Path("results")
AGENT_HELP = (
    "the agent every rollout runs: module:function or file.py:function, async (input, ctx); "
    "what it asks ctx.llm is recorded, and trained on (default: the built-in loop agent)"
)
MODE_HELP = (
    "a built-in mode (math, py, rag, web, osworld, lookup, reasoning-gym), an adapter "
    "(openenv:URL, verifiers:module:factory), one a package registers, or module:factory / "
    "file.py:factory for your own (docs/environments.md)"
)


@dataclass(frozen=True)
class DesktopFlags:
    """The osworld desktop's flags of ``rollfleet run`` (they fill ``RunOptions.desktop``)."""

    path_to_vm: str | None = flag(None, "osworld: the VM image (.vmx …)")
    provider_name: str = flag("vmware", "osworld: vmware, virtualbox, docker, aws")
    action_space: str = flag("pyautogui", "osworld: computer_13 or pyautogui")
    screen_width: int = flag(1920, "osworld: the screen's width in pixels")
    screen_height: int = flag(1080, "osworld: the screen's height in pixels")
    headless: bool = flag(False, "osworld: run the VM without a window")
    snapshot_name: str = flag("init_state", "osworld: the snapshot each task starts from")
    client_password: str = flag("password", "osworld: the guest's password")


@dataclass(frozen=True)
class RunOptions:
    """Everything ``rollfleet run`` takes (the seed's flags and a few of rollfleet's own)."""

    mode: str = flag(help=MODE_HELP)
    data: Path = flag(help="tasks: a .jsonl file, or a .json list")
    num_rollouts: int = flag(DEFAULT_ROLLOUTS, "N: rollouts running at once")
    num_vms: int = flag(3, "M: pool size with --use-vm-pool (osworld, py)")
    use_vm_pool: bool = flag(False, "N rollouts share M environments")
    model: str | None = flag(
        None,
        "a GGUF for the llama.cpp engine (default: bundled SmolLM2-135M), a transformers model "
        "directory (served by transformers), or the model name with --engine",
    )
    engine: str | None = flag(
        None, "an OpenAI-compatible base URL to use instead of starting llama.cpp"
    )
    llm_token: str | None = flag(
        None,
        "API key for --engine (default: OPENAI_API_KEY); runners get it in their environment, "
        "never on a command line",
        envvar="ROLLFLEET_LLM_TOKEN",
    )
    max_turns: int = flag(100, "turns per rollout")
    max_retries: int = flag(3, "retries per turn (engine errors, unreadable calls)")
    samples_per_task: int = flag(1, "K rollouts per task (pass@K)")
    output_dir: Path = flag(DEFAULT_OUTPUT, "trajectories, summary, store")
    max_tokens: int = flag(256, "tokens per model reply")
    temperature: float = flag(0.7, "sampling temperature of every model reply")
    limit: int | None = flag(None, "only the first LIMIT tasks")
    store: str | None = flag(None, "an existing control plane: only enqueue and follow")
    token: str | None = flag(None, "bearer token for --store", envvar="ROLLFLEET_TOKEN")
    desktop: dict[str, Any] = field(default_factory=dict)  # DesktopFlags' fields
    observation: str | None = flag(
        None,
        "what the model is shown: web text (default), screenshot or both; osworld screenshot "
        "(default), a11y_tree or screenshot_a11y_tree",
    )
    engine_per_runner: bool = flag(
        False,
        "each runner process loads its own llama.cpp model (the seed's design, no shared "
        "batching; for comparisons)",
    )
    engine_threads: int | None = flag(
        None, "llama.cpp threads (default: measured for this machine)"
    )
    keep_quant: bool = flag(
        False,
        "serve the GGUF as it is (by default Q4_1/Q5 files are served from a cached Q8_0 copy, "
        "whose kernels batch better)",
    )
    unsafe_sandbox: bool = flag(
        False, "py: run model-written code without bubblewrap (rlimits only; for code you trust)"
    )
    agent: str = flag(AGENT, AGENT_HELP)
    standin: bool = False  # osworld's stand-in desktop, for tests

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> RunOptions:
        """The options from a command line's values: RunOptions' flags and DesktopFlags'."""
        names = {f.name for f in dataclasses.fields(DesktopFlags)}
        desktop = {k: v for k, v in values.items() if k in names}
        return cls(**{k: v for k, v in values.items() if k not in names}, desktop=desktop)

    def check(self) -> None:
        """Refuse impossible numbers, and an agent that does not load, before anything starts."""
        from rollfleet.runner.agent import load_agent

        load_agent(self.agent)
        for name in ("num_rollouts", "num_vms", "max_turns", "samples_per_task", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInput(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.engine_threads is not None and not 1 <= self.engine_threads <= 1024:
            raise InvalidInput(f"--engine-threads must be 1 to 1024, got {self.engine_threads}")
        if self.mode == "osworld":
            from rollfleet.envs.osworld import desktop_options

            desktop_options(self.desktop)  # InvalidInput naming a bad --provider-name & co.
        check_observation(self.mode, self.observation)
        if self.max_retries < 0:
            raise InvalidInput(f"--max-retries must be 0 or more, got {self.max_retries}")
        if self.engine is None and self.model is not None:
            self._check_local_model(Path(self.model))
        if self.engine is not None and self.store is None and not self.llm_key():
            raise InvalidInput(
                f"--engine {self.engine}: no API key; set OPENAI_API_KEY or pass --llm-token "
                "(a server that checks no key takes any value, e.g. --llm-token none)"
            )

    def _check_local_model(self, path: Path) -> None:
        """A GGUF file for llama.cpp, or a transformers directory served by transformers here
        (not per runner process: those load llama.cpp)."""
        if path.is_dir():
            from rollfleet.train.policy import check_model

            check_model(path, "hf")
            if self.engine_per_runner:
                raise InvalidInput(
                    f"--model {path}: a transformers model directory is served by one engine "
                    "in this process; --engine-per-runner loads a GGUF in each runner"
                )
        elif not path.is_file():
            raise InvalidInput(
                f"--model {path}: neither a GGUF file for the llama.cpp engine nor a "
                "transformers model directory; to use a served model pass --engine URL "
                "(an OpenAI-compatible base URL) too"
            )

    def serves_directory(self) -> bool:
        """Whether the shared engine is transformers serving a ``--model`` directory."""
        return self.engine is None and self.model is not None and Path(self.model).is_dir()

    def llm_key(self) -> str | None:
        """The API key for ``--engine``: ``--llm-token``, else ``OPENAI_API_KEY``."""
        return self.llm_token or os.environ.get("OPENAI_API_KEY") or None

    def settings(self) -> dict[str, Any]:
        """The agent loop's settings, stored with every rollout."""
        model = self.model if self.engine else None
        return {
            "max_turns": self.max_turns,
            "max_retries": self.max_retries,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "model": model,
            **({"observation": self.observation} if self.observation else {}),
        }

    def desktop_settings(self) -> dict[str, Any]:
        """The OSWorld options; the accessibility tree is fetched only when it is shown."""
        if self.mode != "osworld":
            return self.desktop
        shown = "a11y_tree" in (self.observation or "screenshot")
        return {**self.desktop, "require_a11y_tree": shown}

    def load_mode(self) -> Mode:
        """The ``--mode`` (with ``--observation``): InvalidInput naming what is wrong."""
        return get_mode(self.mode, self.observation)

    def env_spec(self) -> EnvSpec:
        """The ``ctx.env`` runners give rollouts."""
        return EnvSpec(
            mode=self.mode,
            use_pool=self.use_vm_pool,
            num_instances=self.num_vms,
            desktop=self.desktop_settings(),
            standin=self.standin,
            sandbox={"isolation": "none"} if self.unsafe_sandbox else {},
        )
