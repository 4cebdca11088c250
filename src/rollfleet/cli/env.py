"""``rollfleet env serve``: a mode's tasks served as an OpenEnv environment.

``rollfleet env serve --mode lookup --data tasks.jsonl --port 8000`` serves on 127.0.0.1 what
:func:`rollfleet.envs.openenv_serve.serve_mode` builds: any OpenEnv client (its ``EnvClient``, TRL's
environment loop) resets it to a task and steps it with tool calls and a final answer, scored by
the mode. Needs ``openenv-core``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(help="OpenEnv environments: serve a mode's tasks as one.", no_args_is_help=True)


@app.command("serve")
def serve(
    mode: str = typer.Option(..., "--mode", help="a registered mode or module:factory"),
    data: Path = typer.Option(..., "--data", help="the mode's tasks (.jsonl or .json)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    port: int = typer.Option(8000, "--port", help="port to listen on"),
    max_sessions: int = typer.Option(
        8, "--max-sessions", min=1, max=1024, help="WebSocket sessions (episodes) at once"
    ),
) -> None:
    """Serve ``--mode``'s tasks of ``--data`` as an OpenEnv environment until interrupted."""
    import uvicorn

    from rollfleet.envs.openenv_serve import serve_mode

    served = serve_mode(mode, data, max_sessions=max_sessions)
    print(f"serving --mode {mode} ({data}) as an OpenEnv environment on http://{host}:{port}")
    sys.stdout.flush()
    uvicorn.run(served, host=host, port=port, ws="websockets-sansio", log_level="warning")


def register(root: typer.Typer) -> None:
    """Add the ``env`` group to the app."""
    root.add_typer(app, name="env")
