"""Run every benchmark module under bench/ (``python -m bench [name ...]``)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> None:
    """Run the named benchmarks, or all of them."""
    wanted = sys.argv[1:]
    names = sorted(
        m.name
        for m in pkgutil.iter_modules([str(Path(__file__).parent)])
        if not m.name.startswith("_")
    )
    for name in names:
        if wanted and name not in wanted:
            continue
        print(f"== bench.{name}", flush=True)
        importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main()
