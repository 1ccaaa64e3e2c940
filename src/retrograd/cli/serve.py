"""Serve the model through the OpenAI API (/v1/chat/completions, /v1/models).

The weights are the adapter the run file trains unless --adapter, --checkpoint (the adapter
exported beside a .state directory) or --base-only says otherwise; the base model is served
beside it as `base`. The model is loaded before the server answers. Binding anything but a
loopback address requires --api-key (or RETROGRAD_API_KEY in the environment: a flag is in
every process listing, which every user of the machine reads), which clients send as
`Authorization: Bearer KEY`; without a key, only requests from this machine are answered (no
web page served from another machine).
--port 0 picks a free port; the address is printed once the server listens.
Requests join one live batch of at most --max-sequences answers at the next decode step;
up to --max-queue more wait, and beyond that a request gets 503 with Retry-After.

Example:
  retrograd serve run.toml --model-name tuned
  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused python my_eval.py
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.errors import ConfigError
from retrograd.openai_app import MAX_QUEUE, MAX_SEQUENCES
from retrograd.server.config import is_loopback

KEY_ENV = "RETROGRAD_API_KEY"  # the key, where `ps` does not show it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--adapter", metavar="ADAPTER.gguf", help="serve this LoRA adapter")
    which.add_argument(
        "--checkpoint", metavar="DIR/best.state", help="serve the adapter exported beside it"
    )
    which.add_argument("--base-only", action="store_true", help="serve the base model only")
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)
    p.add_argument(
        "--ctx",
        type=int,
        metavar="N",
        help="context length (default: 4096, or the model's trained context if shorter)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free)")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="required from clients as a Bearer token (without it: requests from this "
        f"machine only, none from a web page served from another machine); default: ${KEY_ENV}, which "
        "no process listing shows",
    )
    p.add_argument(
        "--model-name", metavar="NAME", help="the model id (default: the adapter's file name)"
    )
    p.add_argument(
        "--max-sequences",
        type=int,
        default=MAX_SEQUENCES,
        metavar="N",
        help=f"answers generated at once in one batch (default: {MAX_SEQUENCES})",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=MAX_QUEUE,
        metavar="N",
        help=f"requests waiting beyond those; more get 503 (default: {MAX_QUEUE})",
    )


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run
    from retrograd.openai_app.weights import load_for_generation, resolve_adapter

    cfg = load_run(args.config, model=args.model, device=args.device)
    api_key = args.api_key or os.environ.get(KEY_ENV) or None
    if not is_loopback(args.host) and not api_key:
        raise ConfigError(
            f"--host {args.host}: binding beyond loopback requires --api-key or {KEY_ENV}"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be 0 to 65535")
    if args.max_sequences < 1:
        raise ConfigError(f"--max-sequences {args.max_sequences}: must be at least 1")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue}: must be at least 0")
    adapter = resolve_adapter(cfg, args.adapter, args.checkpoint, args.base_only)
    sock = bind_socket(args.host, args.port)  # a taken port fails before the model loads
    loaded = load_for_generation(cfg, adapter, args.ctx, args.device)
    name = args.model_name or (adapter.name if adapter else loaded.model.gguf.path.name)
    return serve(loaded, name, sock, api_key, args.max_sequences, args.max_queue)


def bind_socket(host: str, port: int, where: str | None = None) -> socket.socket:
    """A listening socket on host:port (0: any free port); ConfigError naming `where` (the
    flags by default) when the address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        where = where or f"--host {host} --port {port}"
        raise ConfigError(f"{where}: cannot bind: {e.strerror}") from None
    sock.listen(128)
    return sock


def serve(
    loaded,
    name: str,
    sock: socket.socket,
    api_key: str | None,
    max_sequences: int = MAX_SEQUENCES,
    max_queue: int = MAX_QUEUE,
) -> int:
    import uvicorn

    from retrograd.openai_app.app import create_app

    app = create_app(
        loaded, name, api_key=api_key, max_sequences=max_sequences, max_queue=max_queue
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"serving {name} and base at http://{shown}:{port}/v1 "
        f"({loaded.model.report.describe()}, context {loaded.ctx})",
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    print("server stopped", file=sys.stderr)
    return 0
