"""`retrograd-server view OBSERVE_DIR`: an [observe] directory's rollout viewer over loopback HTTP.

The viewer is the static page every [observe] directory holds (docs/observe.md); this serves
the directory read-only (GET and HEAD) on a loopback address, so that a browser on this
machine can open it by URL and follow a live run by reloading. It has no token: it answers
only requests from this machine (openai_app/local.py: a loopback Host, no Origin of another page,
so that no web page can read the rollouts). It refuses other addresses, a folder without the
viewer, and knows nothing about runs. A served run's rollouts are browsed in
the web page under `/` (ui.py); this is for an [observe] directory without a server.
"""

from __future__ import annotations

import functools
import http.server
import socket
from pathlib import Path

from retrograd.errors import ConfigError
from retrograd.openai_app.local import from_this_machine
from retrograd.server.config import is_loopback, split_bind


class _ReadOnly(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's name
        pass  # a page polling its feed would fill the terminal

    def do_POST(self):  # noqa: N802 - the stdlib's naming
        self.send_error(405, "read-only")

    def send_head(self):
        if not from_this_machine(self.headers.get("Host"), self.headers.get("Origin")):
            self.send_error(403, "only requests from this machine")
            return None
        return super().send_head()

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815


class _V6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def viewer_server(directory: str | Path, bind: str) -> http.server.ThreadingHTTPServer:
    """A server for `directory` on `bind` (loopback only; port 0 picks one), not yet serving."""
    folder = Path(directory)
    if not (folder / "index.html").is_file():
        raise ConfigError(
            f"{folder}: not an [observe] directory (no index.html); name the run's "
            "[observe].directory"
        )
    try:
        host, port = split_bind(bind)
    except ValueError as error:
        raise ConfigError(f"--bind: {error}") from None
    if not is_loopback(host):
        raise ConfigError(f"--bind {bind}: the viewer listens on a loopback address only")
    handler = functools.partial(_ReadOnly, directory=str(folder))
    server_class = http.server.ThreadingHTTPServer
    if ":" in host:
        server_class = type(
            "V6", (server_class,), {"address_family": __import__("socket").AF_INET6}
        )
    try:
        return server_class((host, port), handler)
    except OSError as error:
        raise ConfigError(f"--bind {bind}: cannot listen there: {error.strerror}") from None
