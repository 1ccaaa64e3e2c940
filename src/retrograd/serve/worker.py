"""One generation thread: requests queue up and leave in batches.

HTTP handlers submit jobs and await their futures; the worker takes the oldest job and every
queued job for the same weights (adapter or base) up to `max_batch`, and answers them in one
`Sampler.generate` call. The model is only ever touched from this thread, so the adapter
switch between batches needs no lock. Knows nothing about HTTP.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from retrograd.sampling import Completion, SampleRequest
from retrograd.serve.weights import set_adapter


@dataclass
class Job:
    request: SampleRequest
    adapter: bool  # True: with the adapter; False: the base model
    future: Future = field(default_factory=Future)


class Worker:
    def __init__(self, sampler, decoder, max_batch: int = 8):
        self.sampler = sampler
        self.decoder = decoder
        self.max_batch = max_batch
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._adapter: bool | None = None
        self._thread = threading.Thread(target=self._run, name="retrograd-generate", daemon=True)
        self._thread.start()

    def submit(self, request: SampleRequest, adapter: bool) -> Future:
        job = Job(request, adapter)
        with self._cond:
            self._queue.append(job)
            self._cond.notify()
        return job.future

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _take(self) -> list[Job] | None:
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
            first = self._queue.popleft()
            batch = [first]
            for job in list(self._queue):
                if len(batch) == self.max_batch:
                    break
                if job.adapter == first.adapter:
                    self._queue.remove(job)
                    batch.append(job)
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                if self._adapter != batch[0].adapter:
                    set_adapter(self.decoder, batch[0].adapter)
                    self._adapter = batch[0].adapter
                answers: list[list[Completion]] = self.sampler.generate([j.request for j in batch])
            except Exception as e:  # answered to every waiting client, the thread lives on
                for job in batch:
                    job.future.set_exception(e)
                continue
            for job, answer in zip(batch, answers, strict=True):
                job.future.set_result(answer[0])
