"""Live event delivery: per-run and merged subscriptions, bounded, never blocking a run.

Events are published from any thread (a run's supervisor, a request handler) and delivered to
subscribers living on the app's event loop. Each subscriber has a bounded queue; when a slow
client lets it fill up, the subscription is marked lagged instead of waiting, and its stream
says so (`event: lagged`, `{"since": <last seq sent>}`) and ends, so the client reconnects
with `since`. The run never waits for a client. SSE framing is here too; storage is store.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from retrograd.text import json_dumps

QUEUE = 256  # events a subscriber may fall behind by before it is lagged


class Subscription:
    """Events for one stream: `run` (one run's) or None (every run's, merged)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run: str | None, size: int = QUEUE):
        self.loop = loop
        self.run = run
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=size)
        self.lagged = False
        self.woken = asyncio.Event()

    def offer(self, event: dict[str, Any]) -> None:
        """On the loop's thread: queue the event, or mark the subscription lagged."""
        if self.lagged:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.lagged = True
        self.woken.set()

    async def next(self) -> dict[str, Any] | None:
        """The next event, or None once lagged."""
        while True:
            if self.lagged:
                return None
            if not self.queue.empty():
                return self.queue.get_nowait()
            self.woken.clear()
            await self.woken.wait()


class Hub:
    """Who listens to what; `publish` is safe from any thread and never blocks."""

    def __init__(self, size: int = QUEUE):
        self.size = size
        self.lock = threading.Lock()
        self.subscribers: set[Subscription] = set()

    def subscribe(self, run: str | None) -> Subscription:
        sub = Subscription(asyncio.get_running_loop(), run, self.size)
        with self.lock:
            self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            self.subscribers.discard(sub)

    def publish(self, run: str, event: dict[str, Any]) -> None:
        with self.lock:
            targets = [s for s in self.subscribers if s.run in (run, None)]
        for sub in targets:
            item = event if sub.run is not None else {"run": run, **event}
            try:
                sub.loop.call_soon_threadsafe(sub.offer, item)
            except RuntimeError:  # its loop is closed: the stream is gone
                self.unsubscribe(sub)


def frame(event: dict[str, Any], with_id: bool = True) -> str:
    """One SSE frame: `id: <seq>`, `event: <type>`, `data: <json>`."""
    head = f"id: {event['seq']}\n" if with_id and "seq" in event else ""
    return f"{head}event: {event['type']}\ndata: {json_dumps(event)}\n\n"


def lagged_frame(since: int) -> str:
    return f"event: lagged\ndata: {json.dumps({'since': since})}\n\n"
