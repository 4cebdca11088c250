"""A stand-in for a vLLM or SGLang server (which need a GPU): the weight-update endpoints.

Run as ``python served_standin.py --kind vllm|sglang --host H --port P [--params F]
[--refuse MSG] [--keep DIR]``. It answers the health check and ``/v1/models``, and the
weight-update calls with the request fields and answers the real servers use:

* vLLM (only with ``VLLM_SERVER_DEV_MODE=1``, as vLLM): ``POST /collective_rpc`` with
  ``{"method", "args", "kwargs", "timeout"}``; ``reload_weights(weights_path=…,
  is_checkpoint_format=…)`` loads the safetensors in ``weights_path`` and answers
  ``{"results": [null]}``, a failure is HTTP 500 ``{"error": {"message", "type", "param",
  "code"}}``; ``POST /reset_prefix_cache`` answers 200 with no body.
* SGLang: ``POST /update_weights_from_disk`` (``model_path``, ``load_format``, …) and
  ``POST /update_weights_from_tensor`` (``serialized_named_tensors``, ``load_format``,
  ``flush_cache``) answer ``{"success", "message", …}``, HTTP 200, or 400 on failure.

Loading checks each tensor's name and shape against ``--params`` (JSON ``{name: shape}``),
as the real loaders do, and copies what it loaded to a new numbered directory under
``--keep`` (the caller deletes its checkpoint afterwards). ``--refuse MSG`` refuses every
update with MSG. ``GET /_calls`` lists the calls received, in order, for the test to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ARGS = argparse.Namespace()
CALLS: list[dict[str, Any]] = []


def load_checkpoint(directory: str) -> str:
    """Check the safetensors in ``directory`` against the model and keep a copy; return it."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"Cannot find any model weights with {directory!r}")
    params = json.loads(Path(ARGS.params).read_text()) if ARGS.params else None
    for file in files:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if params is not None and name not in params:
                raise ValueError(f"There is no module or parameter named {name!r} in the model")
            if params is not None and entry["shape"] != params[name]:
                raise ValueError(
                    f"Attempted to load weight {name} of shape {entry['shape']} into a"
                    f" parameter of shape {params[name]}"
                )
    kept = os.path.join(ARGS.keep, str(len(os.listdir(ARGS.keep))))
    shutil.copytree(directory, kept)
    return kept


class Handler(BaseHTTPRequestHandler):
    """One request: route by path and method."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Quiet."""

    def answer(self, status: int, body: Any = None) -> None:
        """Send ``body`` as JSON (or nothing when None)."""
        raw = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        """Health, models, and the recorded calls."""
        if self.path == "/health":
            self.answer(200)
        elif self.path == "/v1/models":
            self.answer(200, {"object": "list", "data": [{"id": ARGS.model}]})
        elif self.path == "/_calls":
            self.answer(200, CALLS)
        else:
            self.answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        """The weight-update endpoints of the chosen server kind."""
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        call: dict[str, Any] = {"path": self.path, "body": body}
        route = ROUTES[ARGS.kind].get(self.path)
        if route is None or (ARGS.kind == "vllm" and os.environ.get("VLLM_SERVER_DEV_MODE") != "1"):
            self.answer(404, {"detail": "Not Found"})
            return
        CALLS.append(call)
        status, reply = route(body, call)
        self.answer(status, reply)


def vllm_rpc(body: dict[str, Any], call: dict[str, Any]) -> tuple[int, Any]:
    """vLLM's ``/collective_rpc``: run a worker method, here ``reload_weights``."""
    if body.get("method") is None:
        return 400, {"detail": "Missing 'method' in request body"}
    try:
        if body["method"] != "reload_weights":
            raise ValueError(f"'Worker' object has no attribute {body['method']!r}")
        if ARGS.refuse:
            raise ValueError(ARGS.refuse)
        call["kept"] = load_checkpoint(body.get("kwargs", {})["weights_path"])
    except (ValueError, KeyError) as exc:
        error = {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}
        return 500, {"error": error}
    return 200, {"results": [None]}


def sglang_disk(body: dict[str, Any], call: dict[str, Any]) -> tuple[int, Any]:
    """SGLang's ``/update_weights_from_disk``."""
    try:
        if ARGS.refuse:
            raise ValueError(ARGS.refuse)
        call["kept"] = load_checkpoint(body["model_path"])
    except (ValueError, KeyError) as exc:
        message = f"Failed to update weights: {exc}.\nRolling back to original weights."
        return 400, {"success": False, "message": message, "num_paused_requests": 0}
    return 200, {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }


def sglang_tensor(body: dict[str, Any], call: dict[str, Any]) -> tuple[int, Any]:
    """SGLang's ``/update_weights_from_tensor`` (the payload is recorded, not unpickled)."""
    if ARGS.refuse:
        return 400, {"success": False, "message": ARGS.refuse}
    return 200, {"success": True, "message": "Succeeded to update model weights."}


ROUTES: dict[str, dict[str, Any]] = {
    "vllm": {"/collective_rpc": vllm_rpc, "/reset_prefix_cache": lambda b, c: (200, None)},
    "sglang": {
        "/update_weights_from_disk": sglang_disk,
        "/update_weights_from_tensor": sglang_tensor,
        "/abort_request": lambda b, c: (200, None),
    },
}


def main() -> None:
    """Parse the arguments and serve until terminated."""
    parser = argparse.ArgumentParser()
    for flag in ("--kind", "--host", "--port", "--model", "--params", "--refuse", "--keep"):
        parser.add_argument(flag)
    parser.parse_args(namespace=ARGS)
    os.makedirs(ARGS.keep, exist_ok=True)
    ThreadingHTTPServer((ARGS.host, int(ARGS.port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
