"""Runs as processes: the queue, `max_concurrent_runs`, commands, and what each run reports.

Each run trains in its own process (`python -m retrograd.server.child RUN_DIR`), the loop of
`retrograd train` with sinks that report JSON lines; one supervisor thread per process turns
them into status changes and events. Commands go to the process on its stdin and take effect
at the loop's next boundary. This module owns every status change after creation; it keeps no
state a restart needs beyond what store.py writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from retrograd.server.events import Hub
from retrograd.server.problems import Problem
from retrograd.server.store import TERMINAL, RunRecord, RunStore

LIVE = ("starting", "running", "paused", "pausing")  # a process that reaches boundaries
MAX_ASKS = 8  # requests a live run answers at its boundaries, waiting at once (a timed-out
# one still counts until the run answers it: the run does the work either way)


@dataclass
class Live:
    """A run's process and what the server expects of it."""

    record: RunRecord
    process: subprocess.Popen
    outcome: str | None = None  # the final status the server decided (cancel now, shutdown)
    answers: dict[str, Future] = field(default_factory=dict)  # generate requests in flight
    reported: str | None = None  # the final status the process reported
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, command: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the process is ending; its supervisor reports how


class Runs:
    """Every run's lifecycle over the store and the hub."""

    def __init__(
        self, store: RunStore, hub: Hub, max_concurrent: int, python: str = sys.executable
    ):
        self.store = store
        self.hub = hub
        self.max_concurrent = max_concurrent
        self.python = python
        self.live: dict[str, Live] = {}
        self.queue: list[tuple[str, bool]] = []  # (run id, resume) in start order
        self.closing = False
        self.abandoned = threading.Event()

    # -- events and statuses (callers hold store.lock) ------------------------------------

    def emit(self, record: RunRecord, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            event = self.store.logs[record.id].append(kind, body)
            self.hub.publish(record.id, event)
            return event

    def set_status(self, record: RunRecord, status: str, error: str | None = None) -> None:
        with self.store.lock:
            if record.status == status:
                return
            self.store.transition(record, status, error)
            self.emit(record, "status", {"status": status})
            if status in TERMINAL:
                self.emit(record, "terminal", {"status": status, "error": record.error})

    def queue_position(self, run_id: str) -> int | None:
        for i, (queued, _) in enumerate(self.queue):
            if queued == run_id:
                return i + 1
        return None

    # -- scheduling ---------------------------------------------------------------------------

    def enqueue(self, record: RunRecord, resume: bool = False) -> None:
        with self.store.lock:
            self.set_status(record, "queued")
            self.queue.append((record.id, resume))
            self.pump()

    def pump(self) -> None:
        """Start queued runs while fewer than max_concurrent_runs train."""
        with self.store.lock:
            while self.queue and len(self.live) < self.max_concurrent and not self.closing:
                run_id, resume = self.queue.pop(0)
                record = self.store.runs.get(run_id)
                if record is not None and record.status == "queued":
                    self._launch(record, resume)

    def _launch(self, record: RunRecord, resume: bool) -> None:
        folder = self.store.folder(record.id)
        self.set_status(record, "starting")
        argv = [self.python, "-m", "retrograd.server.child", str(folder)]
        log = open(folder / "log.txt", "a", encoding="utf-8")  # noqa: SIM115 - the child's stderr
        process = subprocess.Popen(
            argv + (["--resume"] if resume else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            encoding="utf-8",
            start_new_session=True,  # a Ctrl-C at the server's terminal is the server's to handle
        )
        log.close()
        live = Live(record, process)
        self.live[record.id] = live
        threading.Thread(target=self._supervise, args=(live,), daemon=True).start()

    # -- what a process reports -------------------------------------------------------------

    def _supervise(self, live: Live) -> None:
        for line in live.process.stdout:
            try:
                # NaN and the infinities a process reports (eval/loss of a held-out set without
                # a trained token) are null: no JSON answer, view or event frame carries them
                message = json.loads(line, parse_constant=lambda _: None)
            except json.JSONDecodeError:
                continue
            with self.store.lock:
                self._on_message(live, message)
        code = live.process.wait()
        with self.store.lock:
            for waiting in live.answers.values():  # the run ended before it could answer
                waiting.set_result({"error": "the run ended before its next boundary"})
            record = live.record
            final = live.reported or live.outcome
            if final is None:
                error = f"the run's process ended with exit code {code} (see log.txt in its folder)"
                self.set_status(record, "failed", error=record.error or error)
            elif final == "failed":
                self.set_status(record, "failed", error=record.error)
            else:
                self.set_status(record, final)
            self.live.pop(record.id, None)
            live.done.set()
            self.pump()

    def _on_message(self, live: Live, message: dict[str, Any]) -> None:
        record, kind = live.record, message.pop("type", None)
        if kind == "started":
            record.plan.update(message)
            record.progress.setdefault("iterations", message["iterations"])
            if record.status in ("starting", "queued"):
                self.set_status(record, "running")
        elif kind == "progress":
            record.progress.update(message)
            self.store.save(record)
            self.emit(record, "progress", dict(record.progress))
        elif kind in ("metrics", "log", "memory"):
            self.emit(record, kind, message)
        elif kind == "evaluation":
            loss = message["values"].get("eval/loss")
            if loss is not None:
                record.progress["eval_loss"] = loss
            self.emit(record, "evaluation", message)
        elif kind == "checkpoint":
            record.artifacts["last_checkpoint"] = message["path"]
            self.store.save(record)
            self.emit(record, "checkpoint", message)
        elif kind == "paused":
            self.set_status(record, "paused")
        elif kind == "resumed":
            if record.status in ("paused", "pausing"):
                self.set_status(record, "running")
        elif kind == "answer":
            waiting = live.answers.pop(message["request_id"], None)
            if waiting is not None:
                waiting.set_result(message)
        elif kind in ("completed", "cancelled", "interrupted", "failed"):
            live.reported = kind
            if kind == "failed":
                record.error = message.get("error")

    # -- commands -------------------------------------------------------------------------

    def _live(self, record: RunRecord, action: str) -> Live:
        live = self.live.get(record.id)
        if live is None:
            raise Problem("conflict", f"cannot {action} run {record.id}: it is {record.status}")
        return live

    def pause(self, record: RunRecord) -> None:
        with self.store.lock:
            if record.status not in ("running", "starting"):
                raise Problem("conflict", f"cannot pause run {record.id}: it is {record.status}")
            self._live(record, "pause").send({"op": "pause"})
            self.set_status(record, "pausing")

    def resume(self, record: RunRecord) -> None:
        """A paused run goes on; an interrupted one is queued to continue from its last
        checkpoint (from the start when it has none)."""
        with self.store.lock:
            if record.status in ("paused", "pausing"):
                self._live(record, "resume").send({"op": "resume"})
                if record.status == "pausing":  # not paused yet: the pause is withdrawn
                    self.set_status(record, "running")
                return
            if record.status == "interrupted":
                record.error = None
                self.enqueue(record, resume=True)
                return
            raise Problem("conflict", f"cannot resume run {record.id}: it is {record.status}")

    def cancel(self, record: RunRecord, at: str, checkpoint: bool) -> None:
        with self.store.lock:
            if record.status in TERMINAL:
                raise Problem("conflict", f"cannot cancel run {record.id}: it is {record.status}")
            if record.id not in self.live:  # queued or interrupted: nothing runs
                self.queue = [(r, s) for r, s in self.queue if r != record.id]
                self.set_status(record, "cancelled")
                return
            live = self.live[record.id]
            self.set_status(record, "cancelling")
            if at == "now":
                live.outcome = "cancelled"
                _kill(live.process)
            else:
                live.send({"op": "cancel", "checkpoint": checkpoint})

    def checkpoint(self, record: RunRecord) -> None:
        with self.store.lock:
            if record.status not in ("running", "paused", "pausing", "starting"):
                raise Problem(
                    "conflict", f"cannot checkpoint run {record.id}: it is {record.status}"
                )
            self._live(record, "checkpoint").send({"op": "checkpoint"})

    def ask(self, record: RunRecord, op: str, request: dict[str, Any]) -> Future:
        """Ask a live run's process for an answer at its next boundary (`generate`, or `chat`
        for the OpenAI routes); the future holds its reply ({"body": ...} or {"error": ...})."""
        with self.store.lock:
            if record.status not in LIVE:
                raise Problem("conflict", f"run {record.id} is {record.status}: nothing answers")
            live = self._live(record, "ask")
            pending = sum(not f.done() for f in live.answers.values())
            if pending >= MAX_ASKS:  # each is answered inside the training loop, one at a time
                raise Problem(
                    "too-many-requests",
                    f"run {record.id} has {pending} requests waiting for its next boundary "
                    f"(at most {MAX_ASKS}); try again when they are answered",
                    headers={"Retry-After": "5"},
                )
            request_id = uuid.uuid4().hex
            waiting: Future = Future()
            live.answers[request_id] = waiting
            live.send({"op": op, "request_id": request_id, "request": request})
            return waiting

    def shutdown(self, timeout: float) -> None:
        """Ask every live run to checkpoint and stop at its next boundary; kill those still
        running after `timeout` seconds. They are `interrupted`, resumable after a restart."""
        with self.store.lock:
            self.closing = True
            lives = list(self.live.values())
            for live in lives:
                live.outcome = "interrupted"
                live.send({"op": "stop"})
        deadline = time.monotonic() + timeout
        for live in lives:
            if not live.done.wait(max(0.0, deadline - time.monotonic())):
                _kill(live.process)
                live.done.wait(10)

    def abandon(self) -> None:
        """A second Ctrl-C: every live run's process killed at once, without a checkpoint; the
        runs are `interrupted` (on disk now, or when the server next starts). Called from a
        signal handler: takes no lock."""
        self.closing = True
        self.abandoned.set()
        for live in list(self.live.values()):
            live.outcome = "interrupted"
            _kill(live.process)


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
