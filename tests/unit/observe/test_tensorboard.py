"""TensorBoard event files, read back with TensorBoard's own reader (an oracle we did not write)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboardX.record_writer import masked_crc32c as tensorboardx_masked_crc32c

from retrograd.observe import names
from retrograd.observe.tensorboard import TensorBoardSink, crc32c, masked_crc32c


def test_crc32c_check_value_and_mask_match_tensorboardx():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    for size in (0, 1, 7, 8, 12, 100, 1000):
        data = os.urandom(size)
        assert masked_crc32c(data) == tensorboardx_masked_crc32c(data)


def test_layout_and_round_trip_through_tensorboard(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    (run_dir,) = (tmp_path / "tb").iterdir()
    match = re.fullmatch(r"run-(\d+)-(\d+)", run_dir.name)
    assert match and int(match[2]) == os.getpid()
    assert [p.name for p in run_dir.iterdir()] == [f"events.out.tfevents.{match[1]}.retrograd"]

    for step in range(1, 6):
        sink.step(step, 1, {names.TRAIN_LOSS: 1.0 / step, names.LEARNING_RATE: 1e-4 * step})
    sink.step(5, 1, {names.EVAL_LOSS: 0.75, names.EVAL_PERPLEXITY: 2.117})
    sink.step(300, 2, {names.TRAIN_LOSS: 0.125})  # a step above 127: a two-byte varint
    sink.finish(300)

    events = list(event_file_loader.EventFileLoader(str(sink.path)).Load())
    assert events[0].file_version == "brain.Event:2"
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == {
        names.TRAIN_LOSS,
        names.LEARNING_RATE,
        names.EVAL_LOSS,
        names.EVAL_PERPLEXITY,
    }
    loss = [(e.step, e.value) for e in accumulator.Scalars(names.TRAIN_LOSS)]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 300]
    assert [v for _, v in loss] == pytest.approx([1, 0.5, 1 / 3, 0.25, 0.2, 0.125], rel=1e-6)
    lr = [e.value for e in accumulator.Scalars(names.LEARNING_RATE)]
    assert lr == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 5e-4], rel=1e-6)
    assert [(e.step, e.value) for e in accumulator.Scalars(names.EVAL_LOSS)] == [(5, 0.75)]


def test_two_runs_get_two_directories(tmp_path):
    first, second = TensorBoardSink(tmp_path), TensorBoardSink(tmp_path)
    assert first.run_dir != second.run_dir
    first.finish(0)
    second.fail("stopped")


KILLED_RUN = """
import os, signal, sys
from retrograd.observe.tensorboard import TensorBoardSink
sink = TensorBoardSink(sys.argv[1])
for step in range(1, 4):
    sink.step(step, 1, {"train/loss": float(step)})
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_run_keeps_what_it_logged(tmp_path):
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path)], check=False)
    assert result.returncode == -9
    (run_dir,) = tmp_path.iterdir()
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
    ]
