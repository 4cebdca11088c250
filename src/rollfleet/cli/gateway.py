"""``rollfleet gateway``: serve engine replicas behind the OpenAI-compatible gateway."""

from __future__ import annotations

import asyncio
import logging

import typer
from rich.console import Console

from rollfleet.engines.factory import EngineKind, build_gateway
from rollfleet.engines.gateway.app import serve_gateway
from rollfleet.errors import RollfleetError
from rollfleet.web.serving import check_bind

console = Console(stderr=True)


async def _serve(
    engine: EngineKind,
    replicas: int,
    model: str | None,
    url: str | None,
    host: str,
    port: int,
    token: str | None,
    mmproj: str | None = None,
) -> None:
    with console.status(f"starting {replicas} {engine.value} replica(s)…"):
        gateway = await build_gateway(
            engine, replicas=replicas, model=model, url=url, mmproj=mmproj
        )
    names = ", ".join(f"{r['replica_id']} ({r['model']})" for r in gateway.replicas())
    console.print(f"[green]gateway ready[/] at http://{host}:{port}/v1 → {names}")
    await serve_gateway(gateway, host, port, token)


def register(app: typer.Typer) -> None:
    """Add the ``gateway`` command to the rollfleet CLI."""

    @app.command("gateway")
    def gateway(
        engine: EngineKind = typer.Option(EngineKind.LLAMACPP, "--engine", help="inference engine"),
        engine_url: str = typer.Option(None, "--engine-url", help="server URL for --engine openai"),
        replicas: int = typer.Option(1, "--replicas", min=1, help="engine replicas to route to"),
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
        port: int = typer.Option(8100, "--port", help="port to listen on"),
        model: str = typer.Option(
            None, "--model", help="model path/name (default: bundled SmolLM2; hf: tiny, tiny-vlm)"
        ),
        mmproj: str = typer.Option(
            None, "--mmproj", help="llama.cpp: a multimodal projector GGUF; the engine then sees"
        ),
        token: str = typer.Option(
            None, "--token", envvar="ROLLFLEET_TOKEN", help="require this bearer token"
        ),
    ) -> None:
        """Serve an OpenAI-compatible LLM gateway in front of engine replicas."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        try:
            check_bind(host, token)
            asyncio.run(_serve(engine, replicas, model, engine_url, host, port, token, mmproj))
        except RollfleetError as exc:
            console.print(f"[red]error:[/] {exc.message}")
            raise typer.Exit(1) from exc
        except KeyboardInterrupt:
            console.print("gateway stopped")
