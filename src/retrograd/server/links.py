"""Signed download links: one artifact of one run, for 60 seconds, without the token.

A link carries `sig` (an HMAC of run, artifact and expiry under a key drawn when the server
starts) and `exp` (unix seconds), so a browser can download with a plain GET. The key lives only
in memory: every link dies with the process.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

TTL_SECONDS = 60
SIGNED_PATH = re.compile(r"^/v1/runs/[^/]+/artifacts/[^/]+$")


class Links:
    def __init__(self, ttl: int = TTL_SECONDS):
        self.key = secrets.token_bytes(32)
        self.ttl = ttl

    def _mac(self, run_id: str, name: str, exp: int) -> str:
        message = f"{run_id}/{name}/{exp}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def sign(self, run_id: str, name: str) -> tuple[str, int]:
        """(sig, exp) of a link to `name` of `run_id`, valid for ttl seconds."""
        exp = int(time.time()) + self.ttl
        return self._mac(run_id, name, exp), exp

    def valid(self, run_id: str, name: str, sig: str | None, exp: str | None) -> bool:
        if sig is None or exp is None or not exp.isdigit() or int(exp) < time.time():
            return False
        return hmac.compare_digest(sig, self._mac(run_id, name, int(exp)))


def signed_request(method: str, path: str, query: bytes) -> bool:
    """A GET of an artifact that carries a signature: the route checks it, not the token."""
    return method == "GET" and bool(SIGNED_PATH.match(path)) and b"sig=" in query
