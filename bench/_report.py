"""Fill docs/performance.md's table from bench/results/*.json (``python -m bench._report``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._rows_fleet import (
    ab_rows,
    chaos_rows,
    cluster_rows,
    dashboard_rows,
    e2e_rows,
    envs_rows,
    fleet_rows,
    pool_rows,
    run_rows,
    sandbox_rows,
    store_rows,
    straggler_rows,
    wire_rows,
)
from bench._rows_model import (
    capability_rows,
    engine_rows,
    hf_batching_rows,
    llama_server_rows,
    llamacpp_weights_rows,
    multimodal_rows,
    tool_calls_rows,
    train_agent_rows,
    train_rows,
    train_sched_rows,
    train_step_rows,
    weights_delta_rows,
    weights_rows,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"


def load(name: str) -> dict[str, Any] | None:
    """One results file, or None when that benchmark has not run."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("store_throughput", store_rows),
    ("end_to_end", e2e_rows),
    ("pool", pool_rows),
    ("engines", engine_rows),
    ("capability", capability_rows),
    ("tool_calls", tool_calls_rows),
    ("hf_batching", hf_batching_rows),
    ("stragglers", straggler_rows),
    ("dashboard", dashboard_rows),
    ("cluster", cluster_rows),
    ("run", run_rows),
    ("weights", weights_rows),
    ("llamacpp_weights", llamacpp_weights_rows),
    ("llama_server", llama_server_rows),
    ("weights_delta", weights_delta_rows),
    ("wire_parse", wire_rows),
    ("refactor_ab", ab_rows),
    ("sandbox", sandbox_rows),
    ("train_sched", train_sched_rows),
    ("train_step", train_step_rows),
    ("train", train_rows),
    ("train_agent", train_agent_rows),
    ("chaos", chaos_rows),
    ("fleet", fleet_rows),
    ("multimodal", multimodal_rows),
    ("envs", envs_rows),
]


def table() -> str:
    """The markdown table, from whatever results exist."""
    lines = ["| area | figure | rollfleet | peer / baseline | ratio |", "|---|---|---|---|---|"]
    for name, rows in SECTIONS:
        data = load(name)
        if data is not None:
            try:
                lines += rows(data)
            except (KeyError, TypeError, ZeroDivisionError) as exc:
                lines.append(f"| {name} | (results file has an unexpected shape: {exc!r}) | | | |")
    return "\n".join(lines)


def main() -> None:
    """Rewrite the table between the perf markers of docs/performance.md."""
    page = ROOT / "docs" / "performance.md"
    text = page.read_text()
    block = f"{START}\n{table()}\n{END}"
    text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _m: block, text, flags=re.S)
    page.write_text(text)
    print(block)


if __name__ == "__main__":
    main()
