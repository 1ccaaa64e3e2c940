"""Signed download links: one artifact of one run, for 60 seconds, without the token.

A link's query is exactly `sig` (an HMAC-SHA256, in lower-case hex, of run, artifact and expiry
under a key drawn when the server starts) and `exp` (unix seconds, in plain decimal), so a
browser can download with a plain GET. The guard (guard.py) asks `admits` before any route
runs: a request is signed only when its query parses (as the routes parse it) to those two
parameters, once each and nothing else, and `sig` verifies for that run, that artifact and that
expiry, not yet past; every other request needs the token. The key lives only in memory: every
link dies with the process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time

from starlette.datastructures import QueryParams

TTL_SECONDS = 60
SIGNED_PATH = re.compile(r"^/v1/runs/([^/]+)/artifacts/([^/]+)$")
_SIG = re.compile(r"[0-9a-f]{64}")
_EXP = re.compile(r"[1-9][0-9]{0,11}")  # ASCII digits only: str.isdigit takes "²" too


class Links:
    def __init__(self, ttl: int = TTL_SECONDS):
        self.key = secrets.token_bytes(32)
        self.ttl = ttl

    def _mac(self, run_id: str, name: str, exp: int) -> str:
        message = json.dumps([run_id, name, exp]).encode()  # unambiguous, whatever the names hold
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def sign(self, run_id: str, name: str) -> tuple[str, int]:
        """(sig, exp) of a link to `name` of `run_id`, valid for ttl seconds."""
        exp = int(time.time()) + self.ttl
        return self._mac(run_id, name, exp), exp

    def admits(self, method: str, path: str, query: bytes) -> bool:
        """Whether the request is a GET of one artifact carrying a link this server signed for
        it that has not expired. `path` is decoded, as the routes see it."""
        found = SIGNED_PATH.match(path)
        if method != "GET" or found is None:
            return False
        pairs = QueryParams(query).multi_items()
        if sorted(key for key, _ in pairs) != ["exp", "sig"]:
            return False
        given = dict(pairs)
        sig, exp = given["sig"], given["exp"]
        if not _SIG.fullmatch(sig) or not _EXP.fullmatch(exp) or int(exp) < time.time():
            return False
        expected = self._mac(found[1], found[2], int(exp))
        return hmac.compare_digest(sig.encode(), expected.encode())
