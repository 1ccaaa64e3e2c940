"""Small reward programs written by the tests, and checks that their process groups are gone.

`persistent(hooks)` and `oneshot(hooks)` write a Python program into tmp_path whose behaviour
the hooks change (they redefine `reply`, `marker`, `handshake` or run code at start-up); each
program appends its process group id to `pgids` beside it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

PRELUDE = """\
import json, os, subprocess, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "pgids"), "a") as f:
    f.write(f"{os.getpgrp()}\\n")
def send(obj):
    sys.stdout.write(obj if isinstance(obj, str) else json.dumps(obj))
    sys.stdout.write("\\n")
    sys.stdout.flush()
def spawn_sleeper():
    # A child that ignores stdin and holds stdout and stderr open.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                     stdin=subprocess.DEVNULL)
def reply(req):
    out = {"reward": float(len(req["completion"]))}
    for key in ("_retrograd_batch", "_retrograd_index"):
        if key in req:
            out[key] = req[key]
    return out
def marker(req):
    return [req]
def handshake(req):
    return [req]
"""

PERSISTENT = """
for line in sys.stdin:
    req = json.loads(line)
    if "protocol" in req:
        out = handshake(req)
    elif "_retrograd_batch_end" in req:
        out = marker(req)
    else:
        out = reply(req)
    for obj in out if isinstance(out, list) else [out]:
        send(obj)
"""

ONESHOT = """
requests = [json.loads(line) for line in sys.stdin]
for req in requests:
    out = reply(req)
    for obj in out if isinstance(out, list) else [out]:
        send(obj)
"""


def writer(tmp_path: Path, loop: str) -> Callable[..., list[str]]:
    count = 0

    def write(hooks: str = "", name: str | None = None) -> list[str]:
        nonlocal count
        count += 1
        folder = tmp_path / (name or f"program{count}")
        folder.mkdir()
        path = folder / "reward.py"
        path.write_text(PRELUDE + hooks + "\n" + loop)
        return [sys.executable, str(path)]

    return write


def pgids(argv: list[str]) -> list[int]:
    """The process groups a test program recorded (one per start)."""
    path = Path(argv[-1]).parent / "pgids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Killed members can linger as zombies until their new parent reaps them: dead all the same.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def assert_gone(argv: list[str], timeout: float = 3.0) -> None:
    """Every process group the program ran in is empty (within `timeout`, for the reaper)."""
    groups = pgids(argv)
    assert groups, "the program never started"
    end = time.monotonic() + timeout
    while any(_alive(g) for g in groups):
        assert time.monotonic() < end, f"process groups still alive: {groups}"
        time.sleep(0.02)
