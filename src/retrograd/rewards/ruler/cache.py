"""The judge's verdict cache: a JSONL file of rows {"key", "scores"?, "text"?}.

A row's key is the sha256 of the judge model and the exact prompt, so a changed rubric, budget
or presentation order is a miss, never a stale hit. Verdict rows hold the judge's validated JSON
reply under "scores"; compaction summaries hold their text under "text". Rows are only ever
appended, each in one write that is flushed and fsynced, so a kill can tear at most the last
line: reading ignores a torn last line and cuts it off before the next append. The cache knows
nothing about HTTP or about what a verdict means.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from retrograd.text import json_dumps


def cache_key(model: str, prompt: str) -> str:
    """The row key of one request: sha256 over the model name and the prompt."""
    digest = hashlib.sha256()
    digest.update(model.encode())
    digest.update(b"\0")  # NOTE: a separator, so ("ab", "c") and ("a", "bc") differ
    digest.update(prompt.encode())
    return digest.hexdigest()


class JudgeCache:
    """Rows of one cache file, loaded at open; `put` appends a row and makes it durable."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.rows: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1  # bytes up to the end of the last complete line
        for line in data[:whole].splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line torn by an older writer, complete but not JSON
            if isinstance(row, dict) and isinstance(row.get("key"), str):
                self.rows[row["key"]] = row
        if whole < len(data):
            # A torn last line: cut it off so the next row starts on a line of its own.
            os.truncate(self.path, whole)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.rows.get(key)

    def put(self, key: str, *, scores: Any = None, text: str | None = None) -> None:
        """Append one row: a verdict (`scores`, any JSON value) or a summary (`text`)."""
        row: dict[str, Any] = {"key": key}
        if scores is not None:
            row["scores"] = scores
        if text is not None:
            row["text"] = text
        line = (json_dumps(row) + "\n").encode()  # a verdict's lone surrogate stays escaped
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.rows[key] = row

    def __len__(self) -> int:
        return len(self.rows)
