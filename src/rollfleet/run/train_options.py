"""What a training run takes (``rollfleet train``'s settings): their checks before anything
starts, the fleet options they give, and the fingerprint a checkpoint must share to be resumed."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollfleet.coordinator.advantages import check_estimator
from rollfleet.coordinator.staleness import MAX_STALENESS_BOUND
from rollfleet.envs import get_mode
from rollfleet.errors import InvalidInput
from rollfleet.run.options import AGENT, RunOptions
from rollfleet.run.stack import engine_threads

MAX_TURNS, MAX_EVAL_SAMPLES = 100, 64
ENGINES = ("llamacpp", "hf")
BUNDLED = "bundled SmolLM2-135M"  # the model of a run without --model (its GGUF)


# Settings added after checkpoints were first written, with the value every older run had: a
# run at that value leaves them out of its fingerprint, so older checkpoints still resume.
LATER_DEFAULTS: dict[str, Any] = {"agent": AGENT, "model": BUNDLED}


@dataclass
class TrainOptions:
    """What a training run takes."""

    mode: str
    data: Path
    output_dir: Path
    steps: int = 10
    tasks_per_step: int = 4
    group_size: int = 8
    max_staleness: int = 0
    lr: float = 5e-4
    lora_rank: int | None = 16  # None: full fine-tuning
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    eval_data: Path | None = None
    eval_every: int = 5
    engine: str = "llamacpp"  # or "hf": the policy itself served by transformers
    model: Path | None = None  # a local GGUF file or transformers directory; None: bundled
    max_turns: int = 4  # model calls per rollout (a mode without tools answers in one)
    estimator: str = "grpo"  # or drgrpo, rloo
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False  # groups that all scored alike leave the token denominator
    mask_truncated: bool = False  # rows cut by max_tokens are not trained on
    eval_samples: int = 1  # 1: greedy; n: n samples a task at the training temperature
    report_to: str | None = None  # "tensorboard": event files in OUTPUT/tensorboard
    agent: str = AGENT  # the agent whose ctx.llm calls are trained on
    trainer_threads: int | None = None  # torch's threads; None: cores_by_phase()
    extra: dict[str, Any] = field(default_factory=dict)  # more RunOptions fields

    def check(self) -> None:
        """Refuse impossible numbers before anything starts."""
        names = (
            "steps",
            "tasks_per_step",
            "group_size",
            "max_tokens",
            "eval_every",
            "max_turns",
            "eval_samples",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise InvalidInput(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_turns > MAX_TURNS or self.eval_samples > MAX_EVAL_SAMPLES:
            raise InvalidInput(
                f"--max-turns must be at most {MAX_TURNS} and --eval-samples at most"
                f" {MAX_EVAL_SAMPLES}"
            )
        if self.max_turns == 1 and get_mode(self.mode).uses_tools:
            raise InvalidInput(
                f"--mode {self.mode} gives the model tools: at --max-turns 1 every tool call would"
                " end its rollout unanswered and training would teach the model to avoid its"
                " tools; use --max-turns 2 or more"
            )
        check_estimator(self.estimator)
        for name in ("kl_coef", "entropy_coef"):
            if not 0 <= getattr(self, name) <= 10:
                raise InvalidInput(f"--{name.replace('_', '-')} must be 0 to 10")
        if self.report_to not in (None, "tensorboard"):
            raise InvalidInput(f"--report-to {self.report_to!r}: the one choice is tensorboard")
        if self.report_to and importlib.util.find_spec("tensorboard") is None:
            raise InvalidInput(
                "--report-to tensorboard needs the tensorboard package: "
                "pip install 'rollfleet[tensorboard]'"
            )
        if self.tasks_per_step * self.group_size > 4096:
            raise InvalidInput("--tasks-per-step × --group-size must be at most 4096")
        if not 0 <= self.max_staleness <= MAX_STALENESS_BOUND:
            raise InvalidInput(
                f"--max-staleness must be 0 to {MAX_STALENESS_BOUND}, got {self.max_staleness}"
            )
        if not 0 < self.lr < 1:
            raise InvalidInput(f"--lr must be between 0 and 1, got {self.lr}")
        if "://" in self.engine:
            raise InvalidInput(
                f"--engine {self.engine}: a remote OpenAI-compatible server cannot take weights"
                " from the trainer; train serves the policy itself: --engine llamacpp or hf"
            )
        if self.engine not in ENGINES:
            raise InvalidInput(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.model is not None:
            from rollfleet.train.policy import check_model

            check_model(self.model, self.engine)

    def cores_by_phase(self) -> tuple[int, int]:
        """Threads for the engine and for the trainer, from this machine's cores: each gets every
        core (the engine as ``rollfleet run`` gives it, a core left for sandboxed programs).
        Synchronous (K=0) the phases take turns. Asynchronous they overlap, and splitting the
        cores between them measured slower on 2 cores than sharing all of them
        (bench/train_threads.py): overlapped steps take as long either way, and the steps that
        do not overlap (the first batch's generation, the last step's training) are faster on
        every core."""
        return engine_threads(get_mode(self.mode)), len(os.sched_getaffinity(0))

    def run_options(self) -> RunOptions:
        """The fleet's options: one rollout slot per sample of a step's batch."""
        threads = {"engine_threads": self.cores_by_phase()[0]}
        return RunOptions(
            mode=self.mode,
            data=self.data,
            output_dir=self.output_dir,
            num_rollouts=self.tasks_per_step * self.group_size,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            max_turns=self.max_turns,
            agent=self.agent,
            model=self.model_name() if self.model and self.engine == "llamacpp" else None,
            **{**threads, **self.extra},
        )

    def loss(self) -> Any:
        """The trainer's LossOptions from these settings."""
        from rollfleet.train.grpo import LossOptions

        return LossOptions(
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            dynamic_sampling=self.dynamic_sampling,
            mask_truncated=self.mask_truncated,
        )

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint must share to be resumed (``steps`` may grow)."""
        kept = asdict(self)
        for name in ("output_dir", "steps", "engine", "extra", "report_to", "trainer_threads"):
            kept.pop(name)
        kept["data"] = str(self.data.resolve())
        kept["eval_data"] = str(self.eval_data.resolve()) if self.eval_data else None
        kept["model"] = self.model_name()
        for name, default in LATER_DEFAULTS.items():  # settings newer than some checkpoints
            if kept[name] == default:
                kept.pop(name)
        return kept

    def model_name(self) -> str:
        """The policy's model as a run records it: its absolute path, or :data:`BUNDLED`."""
        return str(self.model.resolve()) if self.model is not None else BUNDLED
