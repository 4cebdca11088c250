"""``rollfleet run``: the seed's parallel rollout command (N rollout processes sharing M VMs)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from rollfleet.cli.common import AGENT_HELP, MODE_HELP, console, job_start
from rollfleet.refs import absolute
from rollfleet.run import RunOptions, run
from rollfleet.run.orchestrate import AGENT, DEFAULT_ROLLOUTS

DEFAULT_OUTPUT = "results"


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(summary: dict[str, Any]) -> None:
    """The summary as a table."""
    table = Table(
        title=(
            f"--mode {summary['mode']}: {summary['rollouts']} rollouts in {summary['wall_s']:.1f}s"
        )
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row(
        "run now / kept from before", f"{summary['ran_now']} / {summary['kept_from_before']}"
    )
    for status, count in sorted(summary["counts"].items()):
        table.add_row(f"status {status}", str(count))
    for kind, count in sorted(summary.get("failures", {}).items()):
        table.add_row(f"failed: {kind}", str(count))
    reward = summary["reward"]
    table.add_row("reward mean ± std", f"{_fmt(reward['mean'])} ± {_fmt(reward['std'])}")
    table.add_row("accuracy (of scored)", _fmt(summary["accuracy"]))
    for name, value in (summary.get("pass_at_k") or {}).items():
        table.add_row(name, _fmt(value))
    table.add_row(
        "latency p50 / p95 (s)",
        f"{_fmt(summary['latency_s']['p50'], '.2f')} / {_fmt(summary['latency_s']['p95'], '.2f')}",
    )
    table.add_row(
        "tokens prompt / completion",
        f"{summary['tokens']['prompt']} / {summary['tokens']['completion']}",
    )
    table.add_row("completion tokens/s", _fmt(summary["tokens_per_s"], ".1f"))
    startup = summary.get("startup_s") or {}
    if "first_token" in startup:
        table.add_row("start-up: first token after (s)", _fmt(startup["first_token"], ".2f"))
    console.print(table)


def run_command(
    mode: str = typer.Option(..., "--mode", help=MODE_HELP),
    data: str = typer.Option(..., "--data", help="tasks: a .jsonl file, or a .json list"),
    num_rollouts: int = typer.Option(
        DEFAULT_ROLLOUTS, "--num-rollouts", help="N: rollouts running at once"
    ),
    num_vms: int = typer.Option(
        3, "--num-vms", help="M: pool size with --use-vm-pool (osworld, py)"
    ),
    use_vm_pool: bool = typer.Option(
        False, "--use-vm-pool", help="N rollouts share M environments"
    ),
    model: str = typer.Option(
        None,
        "--model",
        help="a GGUF for the llama.cpp engine (default: bundled SmolLM2-135M), a transformers "
        "model directory (served by transformers), or the model name with --engine",
    ),
    engine: str = typer.Option(
        None, "--engine", help="an OpenAI-compatible base URL to use instead of starting llama.cpp"
    ),
    llm_token: str = typer.Option(
        None,
        "--llm-token",
        envvar="ROLLFLEET_LLM_TOKEN",
        help="API key for --engine (default: OPENAI_API_KEY); runners get it in their "
        "environment, never on a command line",
    ),
    max_turns: int = typer.Option(100, "--max-turns", help="turns per rollout"),
    max_retries: int = typer.Option(
        3, "--max-retries", help="retries per turn (engine errors, unreadable calls)"
    ),
    samples_per_task: int = typer.Option(
        1, "--samples-per-task", help="K rollouts per task (pass@K)"
    ),
    output_dir: str = typer.Option(
        DEFAULT_OUTPUT, "--output-dir", help="trajectories, summary, store"
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="tokens per model reply"),
    temperature: float = typer.Option(0.7, "--temperature"),
    limit: int = typer.Option(None, "--limit", help="only the first LIMIT tasks"),
    store: str = typer.Option(
        None, "--store", help="an existing control plane: only enqueue and follow"
    ),
    token: str = typer.Option(
        None, "--token", envvar="ROLLFLEET_TOKEN", help="bearer token for --store"
    ),
    path_to_vm: str = typer.Option(None, "--path-to-vm", help="osworld: the VM image (.vmx …)"),
    provider_name: str = typer.Option(
        "vmware", "--provider-name", help="osworld: vmware, virtualbox, docker, aws"
    ),
    action_space: str = typer.Option(
        "pyautogui", "--action-space", help="osworld: computer_13 or pyautogui"
    ),
    screen_width: int = typer.Option(1920, "--screen-width"),
    screen_height: int = typer.Option(1080, "--screen-height"),
    headless: bool = typer.Option(False, "--headless"),
    snapshot_name: str = typer.Option("init_state", "--snapshot-name"),
    client_password: str = typer.Option("password", "--client-password"),
    observation: str = typer.Option(
        None,
        "--observation",
        help="what the model is shown: web text (default), screenshot or both; osworld "
        "screenshot (default), a11y_tree or screenshot_a11y_tree",
    ),
    engine_per_runner: bool = typer.Option(
        False,
        "--engine-per-runner",
        help="each runner process loads its own llama.cpp model (the seed's "
        "design, no shared batching; for comparisons)",
    ),
    engine_threads: int = typer.Option(
        None, "--engine-threads", help="llama.cpp threads (default: measured for this machine)"
    ),
    keep_quant: bool = typer.Option(
        False,
        "--keep-quant",
        help="serve the GGUF as it is (by default Q4_1/Q5 files are served from a cached Q8_0 "
        "copy, whose kernels batch better)",
    ),
    unsafe_sandbox: bool = typer.Option(
        False,
        "--unsafe-sandbox",
        help="py: run model-written code without bubblewrap (rlimits only; for code you trust)",
    ),
    agent: str = typer.Option(AGENT, "--agent", help=AGENT_HELP),
    verbose: bool = typer.Option(False, "--verbose", help="log every lifecycle event"),
) -> None:
    """Run every task of --data in --mode with N parallel rollouts; resumable; writes OUTPUT/."""
    mode = job_start(mode, verbose)
    desktop = {
        "path_to_vm": path_to_vm,
        "provider_name": provider_name,
        "action_space": action_space,
        "screen_width": screen_width,
        "screen_height": screen_height,
        "headless": headless,
        "snapshot_name": snapshot_name,
        "client_password": client_password,
    }
    opts = RunOptions(
        mode=mode,
        data=Path(data),
        num_rollouts=num_rollouts,
        num_vms=num_vms,
        use_vm_pool=use_vm_pool,
        model=model,
        engine=engine,
        max_turns=max_turns,
        max_retries=max_retries,
        samples_per_task=samples_per_task,
        output_dir=Path(output_dir),
        max_tokens=max_tokens,
        temperature=temperature,
        limit=limit,
        store=store,
        token=token,
        llm_token=llm_token,
        desktop=desktop,
        engine_per_runner=engine_per_runner,
        unsafe_sandbox=unsafe_sandbox,
        engine_threads=engine_threads,
        keep_quant=keep_quant,
        observation=observation,
        agent=absolute(agent),
    )
    try:
        summary = asyncio.run(run(opts, console))
    except KeyboardInterrupt:
        console.print(
            "interrupted: finished rollouts are kept in the store; run the same command to resume",
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    print_summary(summary)
    console.print(
        f"wrote {opts.output_dir / 'trajectories.jsonl'} and {opts.output_dir / 'summary.json'}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add ``run`` to the app."""
    app.command("run")(run_command)
