"""One answer's text as it grows: incremental UTF-8, stop strings, streamable deltas.

Pieces are the tokens' bytes (control tokens hidden), decoded incrementally so that a
character split over two tokens appears once it is complete. Text that might be the start of
a stop string is held back from the stream until the next tokens decide. Knows nothing about
tensors.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class AnswerText:
    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...]):
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters already streamed
        self.stopped_by: str | None = None

    def push(self, token: int) -> bool:
        """Add a token's text; True when a stop string now ends the answer (text cut before it)."""
        before = len(self.text)
        self.text += self._decoder.decode(self._piece(token))
        if not self.stop:
            return False
        window = max(0, before - self._hold)  # a stop string may straddle the old end
        hits = [(k, s) for s in self.stop if (k := self.text.find(s, window)) >= 0]
        if not hits:
            return False
        k, s = min(hits)
        self.text, self.stopped_by = self.text[:k], s
        return True

    def finish(self) -> None:
        if self.stopped_by is None:
            self.text += self._decoder.decode(b"", final=True)

    def delta(self, final: bool = False) -> str:
        """Text not streamed yet; unless final, minus a tail that could begin a stop string."""
        end = len(self.text) if final or self.stopped_by else len(self.text) - self._hold
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
