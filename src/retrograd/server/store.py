"""Runs on disk: `<state_dir>/<run_id>/run.json` and `events.jsonl` (formats.md §9.1).

A `RunRecord` is the run's whole visible state; `RunStore.save` rewrites run.json through a
temporary file and a rename on every change, `EventLog.append` gives each event the run's next
`seq` (from 1, gapless) and appends it to events.jsonl, flushed per line, before anyone sees it.
On start, `RunStore.load` reads every run back (one whose run.json names another id than its
folder's is not ours, and left alone) and marks those that were live `interrupted`.
Nothing here starts a process or knows HTTP; callers hold `RunStore.lock` around changes.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrograd.text import json_dumps

STATUSES = (
    "queued",
    "resolving",
    "starting",
    "running",
    "paused",
    "pausing",
    "cancelling",
    "completed",
    "failed",
    "cancelled",
    "interrupted",
)
TERMINAL = ("completed", "failed", "cancelled")
FINISHED = (*TERMINAL, "interrupted")  # no process: may be deleted (and resumed if interrupted)
RING = 1024  # events a run keeps in memory for replay; older ones are read from events.jsonl
REPLAY_BATCH_BYTES = 64 * 1024  # of events.jsonl read at once for a replay


def now_ms() -> int:
    return int(time.time() * 1000)


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def new_run_id() -> str:
    """`run_` + creation time in ms (hex, fixed width) + randomness: ids sort by creation."""
    return f"run_{now_ms():012x}{secrets.token_hex(3)}"


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary name in the same folder and a rename, readable
    by this user alone (a run's record holds the keys the catalogue resolved for it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


@dataclass
class RunRecord:
    """What run.json holds (and GET /v1/runs/{id} shows, with the scheduler's fields)."""

    id: str
    name: str | None
    status: str
    algorithm: str
    model: str
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    transitions: list[dict[str, Any]] = field(default_factory=list)
    effective_config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
    document: dict[str, Any] = field(default_factory=dict)  # what the run's process validates
    patched: dict[str, Any] = field(default_factory=dict)  # {section: {key: value}} by PATCH
    base_dir: str = "."
    observed: bool = False
    objective: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class EventLog:
    """One run's events: seq, the in-memory ring, events.jsonl."""

    def __init__(self, path: Path):
        self.path = path
        self.ring: deque[dict[str, Any]] = deque(maxlen=RING)
        self.seq = 0
        if path.exists():
            for event in self.read_since(0):
                self.seq = event["seq"]
                self.ring.append(event)

    def append(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        event = {"seq": self.seq, "at": now_ms(), "type": kind, **body}
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json_dumps(event) + "\n")  # a lone surrogate stays, escaped
            out.flush()
        self.ring.append(event)
        return event

    def since(self, seq: int) -> list[dict[str, Any]]:
        """Events after `seq`, from the ring when it reaches back far enough."""
        recent = self.ring_since(seq)
        return recent if recent is not None else self.read_since(seq)

    def ring_since(self, seq: int) -> list[dict[str, Any]] | None:
        """Events after `seq` from the ring (at most RING), or None when the ring does not
        reach back that far and they are in events.jsonl alone. Under the store's lock."""
        if self.ring and self.ring[0]["seq"] <= seq + 1:
            return [e for e in self.ring if e["seq"] > seq]
        return None

    def read_since(self, seq: int) -> list[dict[str, Any]]:
        return [event for batch in self.batches(seq) for event in batch]

    def batches(self, seq: int, upto: int | None = None) -> Iterator[list[dict[str, Any]]]:
        """Events after `seq` (up to `upto`) read from events.jsonl as they are consumed, in
        lists of about REPLAY_BATCH_BYTES of the file: a replay or a metrics query holds one
        list at a time, however long the journal. Needs no lock (appends are whole lines)."""
        batch: list[dict[str, Any]] = []
        size = 0
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by a crash mid-write: the rest is intact
                    number = event.get("seq", 0) if isinstance(event, dict) else 0
                    if upto is not None and number > upto:
                        break
                    if number > seq:
                        batch.append(event)
                        size += len(line)
                    if size >= REPLAY_BATCH_BYTES:
                        yield batch
                        batch, size = [], 0
        except FileNotFoundError:
            pass
        if batch:
            yield batch


class RunStore:
    """Every run of the state directory, in memory and on disk."""

    def __init__(self, state_dir: Path):
        self.root = Path(state_dir)
        self.lock = threading.RLock()
        self.runs: dict[str, RunRecord] = {}
        self.logs: dict[str, EventLog] = {}

    def folder(self, run_id: str) -> Path:
        return self.root / run_id

    def load(self) -> list[str]:
        """Read every run back; live ones (no process survives a restart) become
        `interrupted`. Returns the ids so marked."""
        marked = []
        self.root.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.root.glob("run_*/run.json")):
            try:
                record = RunRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                continue  # not a run of ours, or unreadable: left alone
            if record.id != path.parent.name:
                continue  # its id names the folder every write and DELETE touches: not ours
            self.runs[record.id] = record
            self.logs[record.id] = EventLog(path.parent / "events.jsonl")
            if record.status not in FINISHED:
                self.transition(record, "interrupted", error="the server stopped while it was live")
                self.logs[record.id].append("status", {"status": "interrupted"})
                marked.append(record.id)
        return marked

    def add(self, record: RunRecord) -> None:
        folder = self.folder(record.id)
        folder.mkdir(parents=True, exist_ok=True)
        self.runs[record.id] = record
        self.logs[record.id] = EventLog(folder / "events.jsonl")
        record.transitions.append({"status": record.status, "at": record.created_at})
        self.save(record)

    def save(self, record: RunRecord) -> None:
        text = json_dumps(record.to_json(), indent=1)
        write_atomic(self.folder(record.id) / "run.json", text)

    def transition(self, record: RunRecord, status: str, error: str | None = None) -> None:
        """A new status, recorded and saved (the caller writes its event)."""
        assert status in STATUSES, status
        at = now_ms()
        record.status = status
        record.transitions.append({"status": status, "at": at})
        if error is not None:
            record.error = error
        if status == "running" and record.started_at is None:
            record.started_at = at
        if status in FINISHED:
            record.finished_at = at
        self.save(record)

    def delete(self, run_id: str) -> None:
        import shutil

        self.runs.pop(run_id)
        self.logs.pop(run_id)
        shutil.rmtree(self.folder(run_id), ignore_errors=True)
