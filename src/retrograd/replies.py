"""A cap on what one HTTP reply of a peer may hold: a judge endpoint, a remote MCP server.

`cap_replies(client, limit, place)` adds a response hook to an httpx client, async or not (or
the OpenAI SDK's httpx2 one): a reply whose
Content-Length is over `limit`, or whose body grows past it as it arrives, raises ReplyTooLarge
naming `place` and the limit, before more of it is read. A reply that is a stream of server-sent
events (text/event-stream, an MCP server's answers) is counted one event at a time: the stream
lasts, each message in it is bounded. Knows nothing of what the replies mean; the callers
decide what a refused reply is (a failed judge call, a failed tool call).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import AsyncIterator, Iterator
from functools import cache

from retrograd.errors import RetrogradError


class ReplyTooLarge(RetrogradError):
    """A peer's reply (or one event of its stream) past the cap."""


def cap_replies(client, limit: int, place: str, refused: list[str] | None = None):
    """`client`, every reply it reads from now on bounded to `limit` bytes. `refused` gets
    the message of each reply refused (for a caller that sees the refusal only through a
    library that turns it into a closed connection)."""
    notes = refused if refused is not None else []

    def check(response) -> None:
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(place, limit, notes)
        events = response.headers.get("content-type", "").startswith("text/event-stream")
        capped = _capped(type(response), asynchronous)
        response.stream = capped(response.stream, limit, place, events, notes)

    async def hook(response) -> None:
        check(response)

    asynchronous = inspect.iscoroutinefunction(client.send)
    hook = hook if asynchronous else check
    hooks = client.event_hooks
    client.event_hooks = {**hooks, "response": [*hooks.get("response", []), hook]}
    return client


def _too_large(place: str, limit: int, notes: list[str]) -> ReplyTooLarge:
    notes.append(f"{place}: a reply over {limit} bytes (a broken or hostile peer)")
    return ReplyTooLarge(notes[-1])


@cache
def _capped(response_class: type, asynchronous: bool) -> type:
    """_Capped as a byte stream of the response's own package: httpx, or the copy of it the
    OpenAI SDK ships (httpx2), whose responses read only their own package's streams."""
    package = sys.modules[response_class.__module__.split(".")[0]]
    if asynchronous:
        return type("Capped", (_Capped, package.AsyncByteStream), {})
    return type("CappedSync", (_Capped, package.SyncByteStream), {})


class _Capped:
    """A body (async or not) that raises ReplyTooLarge once `limit` bytes arrived (since the last event's
    end, for an event stream)."""

    def __init__(self, stream, limit: int, place: str, events: bool, notes: list[str]):
        self.stream, self.limit, self.place, self.events = stream, limit, place, events
        self.notes = notes

    def _count(self, held: int, chunk: bytes) -> int:
        end = chunk.rfind(b"\n\n") if self.events else -1
        held = len(chunk) - end - 2 if end >= 0 else held + len(chunk)
        if held > self.limit:
            raise _too_large(self.place, self.limit, self.notes)
        return held

    async def __aiter__(self) -> AsyncIterator[bytes]:
        held = 0
        async for chunk in self.stream:
            held = self._count(held, chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()

    def __iter__(self) -> Iterator[bytes]:
        held = 0
        for chunk in self.stream:
            held = self._count(held, chunk)
            yield chunk

    def close(self) -> None:
        self.stream.close()
