"""The baseline a user would write without rollfleet: one ``Llama``, a loop over the prompts.

Same GGUF (the bundled SmolLM2), same prompts (the math mode's system and user messages for
each task), same ``max_tokens`` and temperature as ``rollfleet run``; llama-cpp-python's own
defaults otherwise (all cores as threads). Prints one JSON line: wall time of the whole command
(imports and model load included, as for ``rollfleet run``), completion tokens, tokens/s.
Run: ``python -m bench._naive_loop DATA LIMIT MAX_TOKENS [GGUF]`` (default: the bundled file).
"""

from __future__ import annotations

import json
import os
import sys
import time

STARTED = time.perf_counter()

from llama_cpp import Llama  # noqa: E402  (imports count: they are part of the user's wait)

from rollfleet.engines.llamacpp.model import bundled_gguf  # noqa: E402
from rollfleet.envs import get_mode  # noqa: E402


def main() -> None:
    """Generate a reply for each of the first LIMIT tasks of DATA, one after another."""
    data, limit, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = sys.argv[4] if len(sys.argv) > 4 else str(bundled_gguf())
    mode = get_mode("math")
    tasks = [json.loads(line) for line in open(data, encoding="utf-8") if line.strip()][:limit]
    threads = len(os.sched_getaffinity(0))
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, verbose=False)
    tokens = 0
    for task in tasks:
        messages = [
            {"role": "system", "content": mode.system_prompt(task)},
            {"role": "user", "content": mode.user_prompt(task)},
        ]
        reply = llm.create_chat_completion(
            messages=messages, max_tokens=max_tokens, temperature=0.7
        )
        tokens += reply["usage"]["completion_tokens"]
    wall = time.perf_counter() - STARTED
    print(
        json.dumps(
            {
                "wall_s": wall,
                "completion_tokens": tokens,
                "tokens_per_s": tokens / wall,
                "tasks": len(tasks),
                "threads": threads,
            }
        )
    )


if __name__ == "__main__":
    main()
