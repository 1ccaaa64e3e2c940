"""No reward program outlives its use: close(), failures, interrupts, garbage collection."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import pytest
from reward_programs import assert_gone, pgids

from retrograd.errors import RewardError
from retrograd.rewards import RewardProgram, RewardRequest

REQUESTS = [RewardRequest("p", "a")]


def test_close_closes_stdin_then_waits_for_the_program(persistent, tmp_path):
    # stdin closing is the cue to write reports: a program that does so within the grace
    # period finishes its work.
    report = tmp_path / "report.txt"
    argv = persistent()
    with open(argv[1], "a") as f:
        f.write(f"time.sleep(0.1)\nopen({str(report)!r}, 'w').write('done')\n")
    program = RewardProgram(argv)
    program.score(REQUESTS)
    start = time.monotonic()
    program.close()
    assert 0.08 < time.monotonic() - start < 0.49  # it exited: no full grace period
    assert report.read_text() == "done"
    assert_gone(argv)


def test_close_kills_a_program_that_ignores_stdin(persistent):
    argv = persistent()
    with open(argv[1], "a") as f:
        f.write("time.sleep(60)\n")
    program = RewardProgram(argv)
    program.score(REQUESTS)
    start = time.monotonic()
    program.close()
    assert 0.45 < time.monotonic() - start < 1.5  # 500 ms of grace, then the kill
    assert_gone(argv)
    program.close()  # twice is fine


def test_close_kills_children_that_ignore_stdin(persistent):
    argv = persistent("spawn_sleeper()\n")
    with RewardProgram(argv) as program:
        program.score(REQUESTS)
    assert_gone(argv)


def test_a_failed_batch_kills_children_too(persistent):
    argv = persistent("spawn_sleeper()\ndef marker(req):\n    return ['garbage']\n")
    with pytest.raises(RewardError, match="malformed JSON"):
        RewardProgram(argv).score(REQUESTS)
    assert_gone(argv)


def test_a_timeout_kills_children_too(persistent):
    argv = persistent("spawn_sleeper()\ndef marker(req):\n    return []\n")
    with pytest.raises(RewardError, match="the end marker is missing"):
        RewardProgram(argv, timeout=0.3).score(REQUESTS)
    assert_gone(argv)


def test_a_program_dropped_without_close_is_killed(persistent):
    argv = persistent("spawn_sleeper()\n")
    program = RewardProgram(argv)
    program.score(REQUESTS)
    del program
    gc.collect()
    assert_gone(argv)


def test_an_interpreter_that_exits_without_close_kills_its_programs(persistent, tmp_path):
    argv = persistent("spawn_sleeper()\n")
    code = (
        "from retrograd.rewards import RewardProgram, RewardRequest\n"
        f"program = RewardProgram({argv!r})\n"
        "program.score([RewardRequest('p', 'a')])\n"
        "KEEP = program\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)
    assert_gone(argv)
    assert len(pgids(argv)) == 1


def test_no_torch_in_the_rewards_package():
    code = "import sys, retrograd.rewards; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
