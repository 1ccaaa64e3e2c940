"""A writer killed with SIGKILL at a random moment leaves only loadable checkpoints behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrograd.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

REPO = Path(__file__).resolve().parents[3]
SAVER = Path(__file__).with_name("kill_saver.py")

pytestmark = pytest.mark.slow


def run_and_kill(directory: Path, start: int, delay: float) -> None:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(SAVER), str(directory), str(start)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        line = proc.stdout.readline()  # one pair has landed
        assert line.startswith("saved"), proc.stderr.read()
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the saver ended on its own: {proc.stderr.read()}"


def test_every_complete_checkpoint_loads_after_sigkill(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    start = 1
    for trial in range(4):
        run_and_kill(tmp_path, start, rng.uniform(0.0, 0.4))
        infos = list_checkpoints(tmp_path)
        complete = [c for c in infos if c.complete]
        assert complete, f"seed {seed}, trial {trial}: nothing complete in {infos}"
        for c in complete:
            state = load_checkpoint(c.path)  # sha256 of every file checked
            if c.kind == "step":
                assert state.global_step == c.global_step == int(c.id[5:]), f"seed {seed}"
        assert [c for c in infos if c.kind == "best" and c.complete], f"seed {seed}: best lost"
        latest = load_checkpoint(latest_checkpoint(tmp_path))
        start = latest.global_step + 1  # a resumed run goes on from there
