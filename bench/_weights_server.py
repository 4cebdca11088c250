"""A gateway over an HF engine holding a SmolLM2-135M-shaped model (random weights, built from
its config: nothing is downloaded), for ``bench/weights.py``. Prints its URL, then serves until
killed. Run: ``python -m bench._weights_server PORT``."""

from __future__ import annotations

import asyncio
import sys

from bench.weights import smollm2_135m
from rollfleet.engines.gateway.app import serve_gateway
from rollfleet.engines.gateway.gateway import Gateway
from rollfleet.engines.hf.engine import HFEngine


async def main(port: int) -> None:
    """Start the engine and serve the gateway on 127.0.0.1:PORT."""
    engine = HFEngine(*smollm2_135m(seed=0), max_batch=8)
    await engine.start()
    gateway = Gateway()
    gateway.add_replica(engine, "hf-0")
    print(f"http://127.0.0.1:{port}", flush=True)
    await serve_gateway(gateway, "127.0.0.1", port)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
