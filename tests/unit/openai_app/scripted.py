"""A stand-in for the live batch and a real server around it, for serve tests without a model.

`ScriptedBatch` answers every request with a fixed text, a few characters per step (each step
takes `step_seconds`), records the prompts it saw and the weights each answer was made with,
holds every answer while `paused`, and raises `fail` from a step when set. `serving(app)` runs the app under uvicorn on a free
loopback port in a thread, so that clients stream and disconnect as they do for real.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from retrograd.sampling import Completion
from retrograd.sampling.batch import Entry


class ScriptedBatch:
    def __init__(self, tokenizer, text: str = "", piece: int = 4, step_seconds: float = 0.0):
        self.tokenizer, self.text, self.piece = tokenizer, text, piece
        self.step_seconds = step_seconds
        self.paused = False
        self.fail: Exception | None = None  # raised by the next step
        self.decoder = None  # set by the test: whose LoRA switch tells the weights
        self.prompts: list[str] = []
        self.weights: list[bool | None] = []  # per answer, the adapter switch while it ran
        self.cancelled: list[Entry] = []
        self.live: list[list] = []  # [entry, text, characters sent, weights]

    @property
    def size(self) -> int:
        return len(self.live)

    @property
    def idle(self) -> bool:
        return not self.live

    def add(self, request, on_text=None, on_done=None) -> Entry:
        entry = Entry(request, on_text, on_done, left=1)
        self.prompts.append(self.tokenizer.detokenize(list(request.prompt), special=True))
        self.live.append([entry, self.text, 0, self._adapter()])
        return entry

    def cancel(self, entry: Entry) -> None:
        self.cancelled.append(entry)
        self.live = [x for x in self.live if x[0] is not entry]

    def drop(self) -> list[Entry]:
        entries, self.live = [x[0] for x in self.live], []
        return entries

    def step(self) -> bool:
        time.sleep(self.step_seconds or 0.001)
        if self.fail is not None:
            raise self.fail
        if self.paused:
            return True
        now = self._adapter()
        assert all(x[3] == now for x in self.live), "the weights changed under a live answer"
        for item in list(self.live):
            entry, text, sent, weights = item
            if sent < len(text) and entry.on_text is not None:
                entry.on_text(0, text[sent : sent + self.piece])
            item[2] = sent + self.piece
            if item[2] >= len(text):
                self.live.remove(item)
                self.weights.append(weights)
                ids = tuple(self.tokenizer.tokenize(text, add_bos=False))
                entry.on_done([Completion(ids, (0.0,) * len(ids), "stop", text, 7)])
        return not self.idle

    def _adapter(self) -> bool | None:
        if self.decoder is None:
            return None
        return next((m.lora.enabled for m in self.decoder.modules() if hasattr(m, "lora")), None)


@contextlib.contextmanager
def serving(app):
    """The app under uvicorn on 127.0.0.1 (a free port); yields its /v1 base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
