"""A live run answers chat and generate requests at its boundaries, one at a time inside its
training loop: at most MAX_ASKS wait at once, and a timed-out one still counts until the run
answers it (the run does the work either way), so clients resending cannot stall a run."""

from __future__ import annotations

import io
import json
import threading
from types import SimpleNamespace

import pytest

from retrograd.server.problems import Problem
from retrograd.server.runner import MAX_ASKS, Live, Runs


def _runs():
    record = SimpleNamespace(id="run_1", status="running")
    process = SimpleNamespace(stdin=io.StringIO())
    runs = object.__new__(Runs)  # the part ask reads: the store's lock and the live runs
    runs.store = SimpleNamespace(lock=threading.RLock())
    runs.live = {"run_1": Live(record, process)}
    return runs, record, process


def test_asks_past_the_bound_are_429_until_the_run_answers():
    runs, record, process = _runs()
    waiting = [runs.ask(record, "chat", {"messages": []}) for _ in range(MAX_ASKS)]
    sent = [json.loads(line) for line in process.stdin.getvalue().splitlines()]
    assert [m["op"] for m in sent] == ["chat"] * MAX_ASKS
    with pytest.raises(Problem) as refused:
        runs.ask(record, "generate", {"prompt": "hi"})
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "5"}
    assert f"has {MAX_ASKS} requests waiting for its next boundary" in refused.value.detail
    waiting[0].set_result({"body": {}})  # the run answered one: room for one more
    runs.ask(record, "generate", {"prompt": "hi"})
    with pytest.raises(Problem):
        runs.ask(record, "generate", {"prompt": "hi"})
