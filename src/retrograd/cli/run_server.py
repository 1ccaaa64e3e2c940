"""`retrograd-server`: the run server's command line.

    retrograd-server [config.toml] [--bind ADDR] [--state-dir DIR] [--vram-budget X] [--ram-budget X]
    retrograd-server openapi          # the OpenAPI document of the routes
    retrograd-server config-schema    # the run file's JSON Schema
    retrograd-server view OBSERVE_DIR [--bind 127.0.0.1:0] [--open]

Without a subcommand it serves runs over HTTP (docs/server.md): flags override the file's keys,
RETROGRAD_SERVER_TOKEN gives the token when the file has none. Nothing imported for `--help`,
`openapi` or `config-schema` pulls in torch: they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from retrograd.errors import RetrogradError

EPILOG = """\
subcommands:
  openapi          print the OpenAPI document of the server's routes
  config-schema    print the JSON Schema (draft 2020-12) of run files
  view DIR         an [observe] directory's rollout viewer on a loopback URL

examples:
  retrograd-server                          # 127.0.0.1:8471, runs under ./runs
  retrograd-server server.toml --bind 127.0.0.1:9000
  retrograd-server config-schema > retrograd.schema.json
      then point Taplo or Even Better TOML at the file (see docs/configuration.md)
"""
SUBCOMMANDS = ("openapi", "config-schema", "view")


def config_schema(args: argparse.Namespace) -> int:
    from retrograd.config import json_schema

    text = json.dumps(json_schema(), indent=None if args.compact else 2, ensure_ascii=False)
    if args.output is None:
        sys.stdout.write(text + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


def openapi(args: argparse.Namespace) -> int:
    from retrograd.server.app import create_app
    from retrograd.server.config import ServerConfig

    document = create_app(ServerConfig()).openapi()
    sys.stdout.write(json.dumps(document, indent=None if args.compact else 2) + "\n")
    return 0


def view(args: argparse.Namespace) -> int:
    from retrograd.server.view import viewer_server

    server = viewer_server(args.directory, args.bind)
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/index.html"
    print(f"retrograd-server: the viewer of {args.directory} at {url} (Ctrl-C stops)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def serve(args: argparse.Namespace) -> int:
    from retrograd.server.config import load_server_config

    overrides = {
        "bind": args.bind,
        "state_dir": args.state_dir,
        "vram_budget": _budget_flag(args.vram_budget),
        "ram_budget": _budget_flag(args.ram_budget),
    }
    config = load_server_config(args.config, overrides=overrides)
    if config.mcp_server:
        from retrograd.server.mcp_check import check_required_mcp

        base = Path(args.config).resolve().parent if args.config else Path.cwd()
        check_required_mcp(config, base)
    import uvicorn

    from retrograd.cli.serve import bind_socket
    from retrograd.server.app import create_app

    host, port = config.host_port
    sock = bind_socket(host, port, where=f"bind = {config.bind!r}")
    port = sock.getsockname()[1]  # the one chosen for port 0
    shown = f"[{host}]" if ":" in host else host
    print(
        f"retrograd-server: listening on http://{shown}:{port}/v1 (runs in {config.state_dir}"
        f"{'; a token is required' if config.auth_token else ''})",
        flush=True,
    )
    app = create_app(config)
    # open event streams get a few seconds after Ctrl-C, then the live runs are asked to stop
    server = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
    _server(server, app.state.runs).run(sockets=[sock])
    return 0


def _server(config, runs):
    """uvicorn's server with the run server's Ctrl-C: the first (or SIGTERM) stops listening
    and asks the live runs to checkpoint and stop at their next boundary (600 s at most); a
    second abandons them at once (runner.Runs.abandon)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                print("retrograd-server: abandoning the live runs", file=sys.stderr, flush=True)
                runs.abandon()
                self.force_exit = True
            elif runs.live:
                print(
                    "retrograd-server: stopping; live runs checkpoint at their next boundary "
                    "(Ctrl-C again abandons them)",
                    file=sys.stderr,
                    flush=True,
                )
            super().handle_exit(sig, frame)

    return Server(config)


def _budget_flag(value: str | None):
    """A flag's budget as TOML would hold it: "all", "6GiB", 4096 or 0.8."""
    if value is None:
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrograd-server",
        usage="retrograd-server [config.toml] [--bind ADDR] [--state-dir DIR] "
        "[--vram-budget X] [--ram-budget X]\n       retrograd-server {openapi,config-schema,view} ...",
        description="Retrograd's run server: start, follow and control training runs over HTTP.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", metavar="config.toml", help="the server's TOML")
    parser.add_argument("--bind", metavar="ADDR", help="HOST:PORT (default 127.0.0.1:8471)")
    parser.add_argument("--state-dir", metavar="DIR", help="where runs live (default ./runs)")
    parser.add_argument("--vram-budget", metavar="X", help='"all", a size (6GiB) or a fraction')
    parser.add_argument("--ram-budget", metavar="X", help='"all", a size (6GiB) or a fraction')
    parser.set_defaults(handler=serve)
    return parser


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    if name == "openapi":
        p = argparse.ArgumentParser(
            prog="retrograd-server openapi",
            description="Print the OpenAPI document of the server's routes and exit.",
        )
        p.add_argument("--compact", action="store_true", help="print on one line")
        p.set_defaults(handler=openapi)
        return p
    if name == "view":
        p = argparse.ArgumentParser(
            prog="retrograd-server view",
            description="Serve an [observe] directory's rollout viewer, read-only, on a "
            "loopback URL (docs/observe.md).",
        )
        p.add_argument("directory", metavar="OBSERVE_DIR", help="a run's [observe].directory")
        p.add_argument("--bind", default="127.0.0.1:0", help="loopback HOST:PORT (port 0: any)")
        p.add_argument("--open", action="store_true", help="open it in the default browser")
        p.set_defaults(handler=view)
        return p
    p = argparse.ArgumentParser(
        prog="retrograd-server config-schema",
        description="Print the JSON Schema (draft 2020-12) of Retrograd run files, generated "
        "from the same models that validate them. Editors use it to complete and check a "
        "run file as you type.",
        epilog="example: retrograd-server config-schema > retrograd.schema.json",
    )
    p.add_argument("--compact", action="store_true", help="print on one line")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE, not stdout")
    p.set_defaults(handler=config_schema)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        args = subcommand_parser(argv[0]).parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except RetrogradError as error:
        print(f"retrograd-server: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
