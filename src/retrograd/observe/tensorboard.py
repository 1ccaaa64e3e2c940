"""TensorBoard sink: one event file per run, scalar summaries at step = global_step.

Layout (formats.md §7.1): `<tensorboard_dir>/run-<unix_ms>-<pid>/events.out.tfevents.<unix_ms>.retrograd`.
Records are TFRecord framed (length, masked CRC32C of the length, payload, masked CRC32C of the
payload); the first one is an Event with `file_version = "brain.Event:2"`. The three protobuf
messages a scalar needs are encoded here by hand: importing tensorboardX would import torch, and
its writer picks its own file names. Tests read the files back with TensorBoard's own reader.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path

FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked checksum: rotate right by 15, add a constant (mod 2**32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    """One TFRecord: u64 length, its masked CRC32C, the payload, its masked CRC32C (little endian)."""
    header = struct.pack("<Q", len(payload))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


# Protobuf wire format, just what tensorflow/core/util/event.proto and summary.proto need:
# Event{1: double wall_time, 2: int64 step, 3: string file_version, 5: Summary summary},
# Summary{1: repeated Value value}, Value{1: string tag, 2: float simple_value}.


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def scalar_value(tag: str, value: float) -> bytes:
    return _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)


def event(
    wall_time: float, *, step: int = 0, file_version: str = "", summary: bytes = b""
) -> bytes:
    """A serialized Event; `summary` is a serialized Summary (a run of `1: Value` fields)."""
    assert step >= 0, "steps are non-negative (varint encoding of int64 assumes it)"
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version:
        out += _bytes_field(3, file_version.encode())
    if summary:
        out += _bytes_field(5, summary)
    return out


class TensorBoardSink:
    """Writes finite scalars to a fresh run directory under `root`."""

    def __init__(self, root: str | Path):
        Path(root).mkdir(parents=True, exist_ok=True)
        unix_ms = time.time_ns() // 1_000_000
        while True:  # two runs of one process in one millisecond (tests) take the next one
            self.run_dir = Path(root) / f"run-{unix_ms}-{os.getpid()}"
            try:
                self.run_dir.mkdir()
                break
            except FileExistsError:
                unix_ms += 1
        self.path = self.run_dir / f"events.out.tfevents.{unix_ms}.retrograd"
        self._file = open(self.path, "wb")  # closed by finish() or fail()
        self._write(event(time.time(), file_version=FILE_VERSION))

    def _write(self, record: bytes) -> None:
        # NOTE: flushed per record (not fsync'd): a killed run keeps every step it logged.
        self._file.write(tfrecord(record))
        self._file.flush()

    def step(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None:
        if not values:
            return
        summary = b"".join(
            _bytes_field(1, scalar_value(name, value)) for name, value in values.items()
        )
        self._write(event(time.time(), step=global_step, summary=summary))

    def finish(self, global_step: int) -> None:
        self._file.close()

    def fail(self, message: str) -> None:
        self._file.close()
