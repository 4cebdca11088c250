"""The figures README.md states, generated from bench/results/*.json and the runs' metrics files
(``python -m bench._headline`` rewrites them; tests/unit/test_readme_figures.py fails when the
README and these sources disagree).

Each block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in README.md."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _result(name: str) -> dict[str, Any]:
    """One benchmark's results file."""
    data: dict[str, Any] = json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())
    return data


def _evals(name: str) -> list[dict[str, Any]]:
    """The evaluation records of a documented training run (docs/NAME.jsonl)."""
    lines = (ROOT / "docs" / f"{name}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "eval"]


def _spread(f: dict[str, float], digits: int = 1, unit: str = "") -> str:
    """``median [min–max]``."""
    return f"{f['median']:.{digits}f}{unit} [{f['min']:.{digits}f}–{f['max']:.{digits}f}]"


def demo() -> str:
    """The sentence under ``make demo``: the demo's job against a plain llama-cpp-python loop."""
    sides = _result("run")["sides"]
    naive = next(v for k, v in sides.items() if k.startswith("naive loop ("))
    ours, one = sides["rollfleet run, 8 at once (demo)"], sides["rollfleet run, 1 at a time"]
    return (
        "The same 52 prompts through the loop a user would write over llama-cpp-python take "
        f"{_spread(naive['wall_s'], unit=' s')} at {naive['tokens_per_s']['median']:.0f} "
        f"tokens/s; this whole command, start-up included, {_spread(ours['wall_s'], unit=' s')} "
        f"at {ours['tokens_per_s']['median']:.0f} tokens/s "
        f"({ours['tokens_per_s_vs_naive']:.2f}×), and one rollout at a time "
        f"{one['tokens_per_s_vs_naive']:.2f}× (the `run` rows in "
        "[docs/benchmarks.md](docs/benchmarks.md))."
    )


def headline() -> str:
    """The README's performance table: a few rows, each with its like-for-like row."""
    sides = _result("run")["sides"]
    naive = next(v for k, v in sides.items() if k.startswith("naive loop ("))
    ours, one = sides["rollfleet run, 8 at once (demo)"], sides["rollfleet run, 1 at a time"]
    agent = _result("train_agent")
    rows_in, rows_re = (
        agent["sides"][s]["rows_per_rollout"]["median"] for s in ("token_in", "retokenize")
    )
    chaos = _result("chaos")
    calm, kills = (chaos["sides"][s]["throughput_per_s"]["median"] for s in ("calm", "chaos"))
    resume = _result("resume")
    res, rst = resume["sides"]["resume"], resume["sides"]["restart"]
    turns = resume["settings"]["turns"]
    vs_trl = _result("train_vs_trl")
    k1, trl = vs_trl["sides"]["k1"], vs_trl["sides"]["trl"]
    return "\n".join(
        [
            "| figure | rollfleet | baseline | ratio |",
            "|---|---|---|---|",
            *store_rows(),
            f"| `make demo`'s job, 52 math tasks, tokens/s | {ours['tokens_per_s']['median']:.1f} "
            f"(8 at once) | {naive['tokens_per_s']['median']:.1f} (plain llama-cpp-python) "
            f"| {ours['tokens_per_s_vs_naive']:.2f}× |",
            f"| the same, one rollout at a time | {one['tokens_per_s']['median']:.1f} | "
            f"{naive['tokens_per_s']['median']:.1f} | {one['tokens_per_s_vs_naive']:.2f}× |",
            f"| training rows per {agent['settings']['turns']}-turn agent rollout | {rows_in:.2f} "
            f"(token-in) | {rows_re:.2f} (re-tokenize every turn) | {rows_re / rows_in:.2f}× fewer |",
            f"| rollouts/s, a runner SIGKILLed every ~{chaos['settings']['kill_mean_s']:g} s, "
            f"the server restarted | {kills:.1f} | {calm:.1f} (no kills) | {kills / calm:.2f}× |",
            f"| tokens per finished {turns}-turn rollout, runners SIGKILLed "
            f"(resumed by turn) | {res['tokens_per_rollout']['median']:.1f} | "
            f"{rst['tokens_per_rollout']['median']:.1f} (restart) | "
            f"{resume['tokens_resume_vs_restart']:.2f}× |",
            f"| their wall time, s | {res['seconds']['median']:.0f} | "
            f"{rst['seconds']['median']:.0f} | {resume['wall_resume_vs_restart']:.2f}× |",
            f"| GRPO samples/s, bundled model, `rollfleet train` K=1 | "
            f"{k1['samples_per_s']['median']:.2f} | {trl['samples_per_s']['median']:.2f} (TRL "
            f"GRPOTrainer) | {k1['vs_trl']:.2f}× |",
            f"| held-out reward at equal wall time / after {vs_trl['settings']['steps']} steps | "
            f"{k1['heldout_at_budget']['median']:.2f} / {k1['heldout']['median']:.2f} | "
            f"{trl['heldout_at_budget']['median']:.2f} / {trl['heldout']['median']:.2f} | |",
        ]
    )


def store_rows() -> list[str]:
    """The store's fair cells (bench/_store_fair.py), as the runner sends its requests
    (complete-and-claim), against Agent Lightning's faster completion style."""
    fair = _result("store_throughput").get("fair")
    if fair is None:
        return []
    cells = [fair["cells"][c] for c in ("batched_16", "one_per_request")]
    ratios = [fair["ratios"][c] for c in ("batched_16", "one_per_request")]
    best = [
        max(("agl", "agl_sequential"), key=lambda k: c.get(k, {}).get("median", 0)) for c in cells
    ]
    agl = " / ".join(f"{c[b]['median']:,.0f}" for c, b in zip(cells, best, strict=True))

    def row(label: str, side: str, baseline: str) -> str:
        ours = " / ".join(f"{c[side]['median']:,.0f}" for c in cells)
        ratio = " / ".join(
            f"{r[f'{side}/{b}']['median']:.1f}×" for r, b in zip(ratios, best, strict=True)
        )
        return f"| {label} | {ours} | {baseline} | {ratio} |"

    return [
        row(
            "store completions/s, 4 HTTP workers, 16/1 a call", "rollfleet_handover", f"{agl} (AGL)"
        ),
        row("the same, claim then complete (two calls, as AGL)", "rollfleet", agl),
    ]


def lookup_run() -> str:
    """The multi-turn training run's held-out success, before and after."""
    evals = _evals("train_agent_run_metrics")
    first, last = evals[0], evals[-1]
    return (
        f"held-out greedy success from **{round(first['success'] * first['tasks'])} of "
        f"{first['tasks']} to {round(last['success'] * last['tasks'])} of {last['tasks']}**, "
        f"the tool-call rate from {first['tool_call_rate']:.2f} to {last['tool_call_rate']:.2f}"
    )


def arith_run() -> str:
    """The single-turn training run's held-out reward, before and after."""
    evals = _evals("train_run_metrics")
    first, last = evals[0], evals[-1]
    trail = ", ".join(f"{e['reward']:.2f}" for e in evals[1:-1])
    return (
        f"greedy reward on the {last['tasks']} held-out tasks went from **{first['reward']:.2f} ± "
        f"{first['stderr']:.2f} to {last['reward']:.2f} ± {last['stderr']:.2f}** (evaluated at "
        f"weights versions {', '.join(str(e['version']) for e in evals)}: {trail} between)"
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "demo": demo,
    "headline": headline,
    "lookup-run": lookup_run,
    "arith-run": arith_run,
}
INLINE = {"demo", "lookup-run", "arith-run"}  # inside a paragraph: no line breaks around them


def _pattern(name: str) -> re.Pattern[str]:
    """The block ``name`` with its markers."""
    return re.compile(rf"<!-- {name}:start -->\n?(.*?)\n?<!-- {name}:end -->", re.S)


def stated(text: str) -> dict[str, str]:
    """Each block as README.md states it."""
    return {name: m.group(1) for name in BLOCKS if (m := _pattern(name).search(text))}


def main() -> None:
    """Rewrite every block of README.md from its sources."""
    text = README.read_text()
    for name, make in BLOCKS.items():
        gap = "" if name in INLINE else "\n"
        block = f"<!-- {name}:start -->{gap}{make()}{gap}<!-- {name}:end -->"
        text = _pattern(name).sub(lambda _m, b=block: b, text)  # type: ignore[misc]
    README.write_text(text)


if __name__ == "__main__":
    main()
