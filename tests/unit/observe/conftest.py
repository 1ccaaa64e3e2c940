"""Fixtures for the observe tests: a run description, a captured console, wandb's record reader."""

from __future__ import annotations

import io
import struct
import time
from pathlib import Path

import pytest
from rich.console import Console

from retrograd.observe import RunInfo


@pytest.fixture
def run_info() -> RunInfo:
    return RunInfo(
        algorithm="sft",
        model="models/tiny.gguf",
        train_data="data/train.jsonl",
        eval_data="data/eval.jsonl",
        epochs=2,
        learning_rate=2e-5,
        scheduler="cosine",
        warmup_steps=10,
    )


def captured_console(*, terminal: bool) -> Console:
    """A console writing to memory; `terminal=False` is what a pipe or log file looks like."""
    return Console(file=io.StringIO(), width=160, force_terminal=terminal, color_system=None)


@pytest.fixture
def plain_console() -> Console:
    return captured_console(terminal=False)


@pytest.fixture
def terminal_console() -> Console:
    return captured_console(terminal=True)


def wandb_records(path: Path, *, timeout: float = 20.0) -> list:
    """Every record of a finished run's `.wandb` file, parsed with wandb's own protobuf messages.

    NOTE: `run.finish()` returns before wandb's service has written the file out, so this waits
    for the `exit` record (the service flushes at latest when the process exits).
    """
    deadline = time.monotonic() + timeout
    while True:
        records = parse_wandb_file(path.read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.05)


def parse_wandb_file(data: bytes) -> list:
    """The framing is LevelDB's log format behind a 7-byte `:W&B` header: 32 KiB blocks of chunks,
    each `crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)`."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero fill, or a chunk still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def read_wandb_records():
    return wandb_records
