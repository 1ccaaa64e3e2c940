"""Which requests come from this machine: what a server without a key or token answers.

A server on a loopback address without a key trusts whoever reaches its port, and a web page
the browser shows reaches it too: by rebinding its own name to 127.0.0.1 (the request then
names the site in `Host`), or by sending to 127.0.0.1 from its own origin (`Origin`, which
browsers always send with a page's requests but scripts and SDKs do not). A request from this
machine is addressed to a loopback address or `localhost`, and comes from no page elsewhere.
Nothing here knows about routes, keys or models.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """Whether a host (a name or an address, no port) is this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The name or address of a Host header, without its port or brackets."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.partition(":")[0] if header.count(":") == 1 else header


def from_this_machine(host: str | None, origin: str | None) -> bool:
    """A request whose `Host` and `Origin` headers (None when absent) say it comes from this
    machine: addressed to a loopback name, sent by no page served from another machine."""
    if host is not None and not is_loopback(_host_of(host)):
        return False
    return origin is None or is_loopback(urlsplit(origin).hostname or "")
