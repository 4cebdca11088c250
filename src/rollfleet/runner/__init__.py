"""Execution: the runner, agent loading, fleets of runners (processes, threads, Ray actors)."""

from rollfleet.runner.agent import agent, load_agent
from rollfleet.runner.api import Fleet, run_workers
from rollfleet.runner.context import RolloutContext
from rollfleet.runner.recorder import RunnerStats
from rollfleet.runner.runner import Runner

__all__ = ["Fleet", "RolloutContext", "Runner", "RunnerStats", "agent", "load_agent", "run_workers"]
