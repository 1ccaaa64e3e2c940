"""One generation thread driving a live batch: requests join at the next decode step.

HTTP handlers `submit` jobs and get their text and answer through callbacks (called on this
thread). The thread admits queued jobs into the `LiveBatch` while it holds fewer than
`max_sequences` rows, then runs one step, and again. Jobs wait in a bounded queue beyond
that; past `max_queue` waiting jobs, `submit` raises `Busy`. Weights: the batch answers with
one set at a time (the adapter or the base model); when the oldest waiting job wants the
other, nothing more is admitted until the batch has drained, then the adapter is switched.
First come, first served: a job never waits behind later ones. The model is only ever
touched from this thread, so the switch needs no lock. Knows nothing about HTTP.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from retrograd.openai_app.weights import set_adapter
from retrograd.sampling import Completion, SampleRequest
from retrograd.sampling.batch import Entry, LiveBatch


class Busy(Exception):
    """The queue is full; `retry_after`: seconds after which a place is likely free."""

    def __init__(self, queued: int, retry_after: int):
        super().__init__(f"{queued} requests are waiting already; try again shortly")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    request: SampleRequest
    adapter: bool  # True: with the adapter; False: the base model
    on_text: Callable[[str], None] | None  # text deltas as they are decided
    on_done: Callable[[Completion], None]
    on_error: Callable[[Exception], None]
    entry: Entry | None = None  # once admitted
    admitted: float = 0.0
    cancelled: bool = False


class Worker:
    def __init__(self, batch: LiveBatch, decoder, max_sequences: int, max_queue: int):
        """batch: a LiveBatch of at least max_sequences rows (or what stands in for one)."""
        self.batch = batch
        self.decoder = decoder
        self.max_sequences = max_sequences
        self.max_queue = max_queue
        self._queue: deque[Job] = deque()
        self._live: dict[Entry, Job] = {}  # admitted jobs by their batch entry
        self._cancelled: list[Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self._adapter: bool | None = None
        self._answer_seconds = 10.0  # running mean of a row's time in the batch
        self._thread = threading.Thread(target=self._run, name="retrograd-generate", daemon=True)
        self._thread.start()

    def submit(
        self,
        request: SampleRequest,
        adapter: bool,
        on_done: Callable[[Completion], None],
        on_error: Callable[[Exception], None],
        on_text: Callable[[str], None] | None = None,
    ) -> Job:
        """Queue a job; Busy when max_queue jobs are waiting already."""
        if request.n > self.max_sequences:
            raise ValueError(f"{request.n} answers: at most {self.max_sequences} at once")
        job = Job(request, adapter, on_text, on_done, on_error)
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise Busy(len(self._queue), self._retry_after())
            self._queue.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue, a live one frees its row."""
        with self._cond:
            job.cancelled = True
            self._cancelled.append(job)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _retry_after(self) -> int:
        """Seconds until a row is likely free: a row's mean time over the rows in use."""
        return int(min(60, max(1, round(self._answer_seconds / self.max_sequences))))

    def _run(self) -> None:
        while self._admit():
            try:
                self.batch.step()
            except Exception as e:  # answered to every client in the batch, the thread lives on
                for entry in self.batch.drop():
                    job = self._live.pop(entry, None)
                    if job is not None:
                        job.on_error(e)

    def _admit(self) -> bool:
        """Wait for work, then move waiting jobs into the batch. False when closing."""
        with self._cond:
            while not self._queue and self.batch.idle and not self._cancelled and not self._stop:
                self._cond.wait()
            if self._stop:
                return False
            for job in self._cancelled:
                if job.entry is not None:
                    self.batch.cancel(job.entry)
                    self._live.pop(job.entry, None)
                elif job in self._queue:
                    self._queue.remove(job)
            self._cancelled.clear()
            while self._queue and self._fits(self._queue[0]):
                self._start(self._queue.popleft())
            return True

    def _fits(self, job: Job) -> bool:
        if self.batch.size + job.request.n > self.max_sequences:
            return False
        if job.adapter != self._adapter:
            if not self.batch.idle:
                return False  # the other weights wait until the batch drains
            set_adapter(self.decoder, job.adapter)
            self._adapter = job.adapter
        return True

    def _start(self, job: Job) -> None:
        job.admitted = time.monotonic()
        text = None if job.on_text is None else (lambda _answer, delta: job.on_text(delta))
        try:
            job.entry = self.batch.add(job.request, text, lambda answers: self._done(job, answers))
        except Exception as e:  # answered to this client; the thread lives on for the others
            job.on_error(e)
            return
        if job.entry.left:  # not answered at once (no answers asked)
            self._live[job.entry] = job

    def _done(self, job: Job, answers: list[Completion]) -> None:
        self._live.pop(job.entry, None)
        seconds = time.monotonic() - job.admitted
        self._answer_seconds += 0.1 * (seconds - self._answer_seconds)
        job.on_done(answers[0])
