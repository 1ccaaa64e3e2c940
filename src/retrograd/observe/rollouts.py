"""[observe]: the record of a rollout run's prompts, answers and updates (formats.md §6).

A rollout loop opens one `ObserveWriter` and hands it its typed records: `prompt`, `rollouts`
after scoring, `outcome` after training, `update` at the end of every update. Each call becomes
one batch of JSON records, appended to `observe.jsonl` and folded into the viewer's `feed/`
(`feed.py`) by a background thread, so training never waits for the disk: a full queue drops
the batch (counted in `dropped_batches`, which the loop logs as `observe/dropped_batches`; gaps
in the records' `batch` ids show where), and a disk error turns the export off with one warning. One writer per directory holds an flock on `.lock`; a
resumed run appends a new `segment` to the same log.

NOTE: the loop's records are read on the caller's thread and copied into plain values: a
Rollout changes after it is handed over (`trained`, `skip_reason`), a queued record must not.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import queue
import threading
import time
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console

from retrograd.gguf.writer import atomic_copy
from retrograd.observe.feed import Feed, read_records
from retrograd.text import json_dumps

# The writer reads the records above it by attribute (a prompt: data.prompts.Prompt; groups
# and their members: rollout.records.Group and Rollout) and imports neither: observe sits
# below both layers (docs/architecture.md), and whoever imports the writer needs no numpy.
Prompt = Group = Rollout = Any

VERSION = 1
LOG = "observe.jsonl"
LOCK = ".lock"
VIEWER_FILES = ("index.html", "viewer.css", "viewer.js")
QUEUE_BATCHES = 64  # batches waiting for the disk before new ones are dropped
CLOSE_SECONDS = 60.0  # how long close() waits for the queue to drain


def clip_text(text: str, limit: int) -> str:
    """`text` cut to `limit` Unicode characters plus a marker of what was cut; 0 keeps it all."""
    if not limit or len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def clip_messages(messages: Iterable[dict], limit: int) -> list[dict]:
    """Messages with their text content clipped (plain strings and `{"text": ...}` parts)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = message | {"content": clip_text(content, limit)}
        elif isinstance(content, list):
            parts = [
                p | {"text": clip_text(p["text"], limit)}
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p
                for p in content
            ]
            message = message | {"content": parts}
        out.append(dict(message))
    return out


def number(value: Any) -> float | None:
    """A JSON-safe float: None stays None, NaN and ±inf become None."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def lock_directory(directory: Path) -> int | None:
    """An open descriptor holding an exclusive flock on `directory/.lock` (our pid inside), or
    None when another live writer holds it. The lock goes when the descriptor is closed or
    the process dies."""
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_owner(directory: Path) -> str:
    try:
        return (directory / LOCK).read_text().strip() or "?"
    except OSError:
        return "?"


def cut_unfinished_line(path: Path, chunk: int = 1 << 16) -> None:
    """Truncate `path` after its last newline (reading backwards from the end)."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                pos = start + newline + 1
                break
            pos = start
        if pos < end:
            f.truncate(pos)


def previous_log(path: Path) -> tuple[int, set[str]]:
    """(the next segment, the prompt keys already recorded) of an existing log. A last line a
    killed writer left unfinished is cut off, so that appending starts on a line of its own."""
    if not path.exists():
        return 0, set()
    cut_unfinished_line(path)
    segment, keys = -1, set()
    for record in read_records(path):
        segment = max(segment, int(record.get("segment", -1)))
        if record.get("type") == "prompt":
            keys.add(record["key"])
    return segment + 1, keys


class ObserveWriter:
    """Writes one run segment into an observe directory. Build it with `open`."""

    def __init__(
        self,
        directory: Path,
        lock_fd: int,
        *,
        every: int,
        max_text_chars: int,
        segment: int,
        recorded_prompts: set[str],
        console: Console,
        queue_batches: int | None = None,
    ):
        self.directory = directory
        self.every = every
        self.max_text_chars = max_text_chars
        self.segment = segment
        self.console = console
        self.dropped_batches = 0
        self.disabled = False  # set by the thread on a disk error; the calls then do nothing
        self._lock_fd: int | None = lock_fd
        self._recorded = set(recorded_prompts)  # prompt keys sent or already in the log
        self._pending: list[dict[str, Any]] = []  # prompt records that ride with the next batch
        self._batch = 0
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(
            queue_batches or QUEUE_BATCHES
        )
        self._thread = threading.Thread(target=self._work, name="retrograd-observe", daemon=True)
        self._thread.start()

    @classmethod
    def open(
        cls,
        section,
        *,
        algorithm: str,
        model: str,
        params: dict,
        resumed_from_update: int | None,
        console: Console | None = None,
    ) -> ObserveWriter | None:
        """A writer for [observe] (an ObserveSection), or None when the section is absent,
        `enabled = false`, another writer holds the directory or it cannot be written."""
        if section is None or not section.enabled:
            return None
        console = console or Console(stderr=True)
        directory = Path(section.directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock_fd = lock_directory(directory)
            if lock_fd is None:
                warn(
                    console,
                    f"{directory} is locked by another writer (pid {lock_owner(directory)})",
                )
                return None
        except OSError as e:
            warn(console, f"{directory}: {e}")
            return None
        try:
            segment, recorded = previous_log(directory / LOG)
        except OSError as e:
            os.close(lock_fd)
            warn(console, f"{directory / LOG}: {e}")
            return None
        writer = cls(
            directory,
            lock_fd,
            every=section.every,
            max_text_chars=section.max_text_chars,
            segment=segment,
            recorded_prompts=recorded,
            console=console,
        )
        writer._send(
            [
                writer._record(
                    "run",
                    algorithm=algorithm,
                    model=str(model),
                    resumed_from_update=resumed_from_update,
                    params=params,
                )
            ]
        )
        return writer

    # What the loop calls

    def texts_at(self, update: int) -> bool:
        """True for the updates whose texts are recorded: every, 2·every, …"""
        return update % self.every == 0

    def prompt(self, prompt: Prompt) -> None:
        """Record a prompt's messages once per run; it goes out with the next batch."""
        if self.disabled or prompt.key in self._recorded:
            return
        self._recorded.add(prompt.key)
        messages = clip_messages(prompt.messages, self.max_text_chars)
        self._pending.append(self._record("prompt", key=prompt.key, messages=messages))

    def rollouts(self, update: int, groups: list[Group]) -> None:
        """One `rollout` record per member; texts (and their prompts) on `texts_at` updates."""
        if self.disabled:
            return
        texts = self.texts_at(update)
        records = []
        for group in groups:
            if texts:
                self.prompt(group.prompt)
            records += [self._rollout(update, group, r, texts) for r in group.members]
        self._send(records)

    def selection(self, update: int, groups: list[Group]) -> None:
        """Agentic runs, before training: each member's advantage and whether it is eligible."""
        if self.disabled:
            return
        entries = [
            {
                "group": group.index,
                "member": r.member,
                "advantage": number(r.advantage),
                "eligible": r.eligible,
                "skip_reason": r.skip_reason,
            }
            for group in groups
            for r in group.members
        ]
        self._send([self._record("selection", update=update, entries=entries)])

    def outcome(self, update: int, groups: list[Group]) -> None:
        """After training (or skipping) an update: which members were in the loss."""
        if self.disabled:
            return
        entries = [
            {
                "group": group.index,
                "member": r.member,
                "trained": bool(r.trained),
                "skip_reason": r.skip_reason,
            }
            for group in groups
            for r in group.members
        ]
        self._send([self._record("outcome", update=update, entries=entries)])

    def update(self, update: int, status: str, metrics: dict[str, float]) -> None:
        """Every update's summary; `status` is `completed` or `skipped`. Non-finite values go."""
        if self.disabled:
            return
        kept = {k: v for k, v in ((k, number(v)) for k, v in metrics.items()) if v is not None}
        self._send([self._record("update", update=update, status=status, metrics=kept)])

    def close(self) -> None:
        """Write what is queued (waiting up to CLOSE_SECONDS), then release the directory."""
        if self._lock_fd is None:
            return
        if self._pending and not self.disabled:
            self._send([])
        try:
            self._queue.put(None, timeout=CLOSE_SECONDS)
            self._thread.join(CLOSE_SECONDS)
        except queue.Full:
            pass
        if self._thread.is_alive():
            warn(self.console, f"{self.directory}: the disk did not keep up; batches are lost")
        os.close(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> ObserveWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Records, on the caller's thread

    def _record(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"v": VERSION, "type": kind, "time": round(time.time(), 3), **fields}

    def _rollout(self, update: int, group: Group, r: Rollout, texts: bool) -> dict[str, Any]:
        trained = r.trained if r.trained is not None else (False if r.skip_reason else None)
        fields: dict[str, Any] = {
            "update": update,
            "group": group.index,
            "member": r.member,
            "prompt": group.prompt.key,
            "seed": r.seed,
            "completion": clip_text(r.text, self.max_text_chars) if texts else None,
            "tokens": r.n_tokens,
            "truncated": bool(r.truncated),
            "reward": number(r.reward),
            "advantage": number(r.advantage),
            "trained": trained,
            "skip_reason": r.skip_reason,
            "reward_raw": number(r.reward_raw),
            "judge_term": number(r.judge_term),
        }
        sample = r.extra.get("sample")
        if sample is not None:  # an agentic trajectory: its conversation, not one completion
            traj = sample.traj
            errors = [o for t in traj.turns for o in t.observations if o.get("is_error")]
            fields |= {
                "completion": None,
                "messages": clip_messages(traj.messages, self.max_text_chars) if texts else None,
                "tokens": traj.n_tokens,  # the policy's own
                "step_rewards": [number(x) for x in traj.step_rewards],
                "terminal_reward_raw": number(traj.final_reward),
                "turns": len(traj.turns),
                "tool_calls": sum(len(t.calls) for t in traj.turns),
                "tool_errors": len(errors),
                "finish": traj.finish,
                "failure": traj.failure,
            }
        return self._record("rollout", **fields)

    def _send(self, records: list[dict[str, Any]]) -> None:
        """Queue one batch (pending prompts first); drop it when the queue is full."""
        self._batch += 1
        prompts, self._pending = self._pending, []
        batch = [r | {"segment": self.segment, "batch": self._batch} for r in prompts + records]
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped_batches += 1
            self._recorded.difference_update(r["key"] for r in prompts)  # sent again later

    # The writing thread

    def _work(self) -> None:
        try:
            feed = self._start()
            with open(self.directory / LOG, "a", encoding="utf-8") as log:
                while (batch := self._queue.get()) is not None:
                    self._write(feed, log, batch)
        except Exception as e:  # a full disk, a lost mount: export stops, training goes on
            self.disabled = True
            warn(self.console, f"{self.directory}: {type(e).__name__}: {e}")
            while self._queue.get() is not None:
                pass

    def _start(self) -> Feed:
        """The viewer's files copied in, the feed rebuilt from the log as it stands."""
        viewer = resources.files("retrograd.observe") / "viewer"
        for name in VIEWER_FILES:
            with resources.as_file(viewer / name) as source:
                atomic_copy(source, self.directory / name)
        return Feed.rebuild(self.directory, self.directory / LOG)

    def _write(self, feed: Feed, log, batch: list[dict[str, Any]]) -> None:
        lines = [json_dumps(r, default=str) + "\n" for r in batch]  # lone surrogates escaped
        log.write("".join(lines))
        log.flush()
        for record, line in zip(batch, lines, strict=True):
            # The run record's params may hold paths: the feed gets them as the log has them.
            feed.add(json.loads(line) if record["type"] == "run" else record)
        feed.write()


def warn(console: Console, message: str) -> None:
    console.print(
        f"warning: [observe] {message}; rollout export disabled, training continues",
        markup=False,
        highlight=False,
        soft_wrap=True,  # one line, whatever the terminal's width
    )
