"""LocalSandbox: the workspace as working directory, stdin, the output cap, and everything a
command starts killed on timeout and on exit, whatever session or group it made (setsid,
daemons, SIGTERM ignored, a fork bomb), and on close."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import psutil
import pytest

from retrograd.agent.local import LocalPool, LocalSandbox
from retrograd.errors import EnvironmentFailure


@pytest.fixture
def sandbox(tmp_path):
    box = LocalSandbox(exec_timeout=10.0, max_output_bytes=1000, parent=tmp_path)
    yield box
    box.close()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_runs_in_the_workspace_with_stdin(sandbox):
    result = sandbox.exec(["sh", "-c", 'pwd; cat > f; echo "$1" >&2; exit 4', "sh", "arg"], b"data")
    assert result.exit_code == 4 and not result.ok
    assert result.stdout.decode().strip() == str(Path(sandbox.workdir).resolve())
    assert result.stderr == b"arg\n"
    assert (Path(sandbox.workdir) / "f").read_bytes() == b"data"


def test_large_stdin_and_output_do_not_deadlock(sandbox):
    data = b"x" * (1 << 20)  # more than a pipe holds, both ways
    result = sandbox.exec(["cat"], data)
    assert result.ok and result.truncated
    assert result.stdout == b"x" * 1000


def test_output_cap_counts_both_streams(sandbox):
    result = sandbox.exec(["sh", "-c", "head -c 600 /dev/zero; head -c 600 /dev/zero >&2"])
    assert result.ok and result.truncated
    assert len(result.stdout) + len(result.stderr) == 1000
    small = sandbox.exec(["sh", "-c", "echo hi"])
    assert not small.truncated and small.stdout == b"hi\n"


def test_timeout_kills_the_whole_group(sandbox):
    start = time.monotonic()
    result = sandbox.exec(
        ["sh", "-c", "sleep 60 & echo $! > child; sh -c 'sleep 60' & echo $! > grandchild; wait"],
        timeout=0.5,
    )
    assert time.monotonic() - start < 5
    assert result.timed_out and result.exit_code is None and not result.ok
    for name in ("child", "grandchild"):
        pid = int((Path(sandbox.workdir) / name).read_text())
        assert wait_dead(pid), f"{name} {pid} survived the timeout"


def test_a_background_job_ends_with_its_command(sandbox):
    start = time.monotonic()
    result = sandbox.exec(["sh", "-c", "sleep 60 & echo $! > bg; echo started"])
    assert time.monotonic() - start < 5  # its open stdout does not hold the call
    assert result.ok and result.stdout == b"started\n" and not result.timed_out
    assert wait_dead(int((Path(sandbox.workdir) / "bg").read_text()))


def test_default_timeout_is_the_sandbox_s(tmp_path):
    box = LocalSandbox(exec_timeout=0.3, parent=tmp_path)
    try:
        assert box.exec(["sleep", "5"]).timed_out
        assert not box.exec(["sleep", "0.5"], timeout=5).timed_out
    finally:
        box.close()


def test_a_signal_is_no_exit_code(sandbox):
    result = sandbox.exec(["sh", "-c", "kill -9 $$"])
    assert result.exit_code is None and not result.timed_out


def test_missing_program_reads_like_a_shell(sandbox):
    result = sandbox.exec(["no-such-program-xyz", "a"])
    assert result.exit_code == 127
    assert result.stderr == b"no-such-program-xyz: command not found\n"


def test_closed_sandbox_is_gone(tmp_path):
    box = LocalSandbox(parent=tmp_path)
    workdir = Path(box.workdir)
    assert workdir.is_dir()
    box.close()
    box.close()  # idempotent
    assert not workdir.exists()
    with pytest.raises(EnvironmentFailure):
        box.exec(["true"])


def test_pool_gives_fresh_workspaces_and_removes_them(tmp_path):
    pool = LocalPool(parent=tmp_path)
    a, b = pool.acquire(), pool.acquire()
    assert a.workdir != b.workdir and not list(Path(a.workdir).iterdir())
    a.exec(["sh", "-c", "echo x > f"])
    pool.release(a)
    assert not Path(a.workdir).exists() and Path(b.workdir).exists()
    pool.close()
    assert list(tmp_path.iterdir()) == []


# --- nothing a command starts outlives its call --------------------------------------------


@pytest.fixture
def mark():
    """A number no other process carries in its command line (`sleep MARK`); whatever still
    carries it after the test is killed, so that a failing test leaves nothing behind."""
    value = str(random.randrange(10**8, 10**9))
    yield value
    for p in leftovers(value):
        p.kill()


def leftovers(mark: str) -> list[psutil.Process]:
    """Live processes (zombies aside: dead, waiting for a reaper) whose command line holds mark."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = p.info["cmdline"] or []
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(mark in c for c in cmdline):
                out.append(p)
        except psutil.Error:
            continue
    return out


ESCAPES = {
    "setsid": "setsid sleep {m} & sleep 0.3",
    "setsid -f": "setsid -f sleep {m}; sleep 0.3",
    "nohup in a subshell": "(nohup sh -c 'sleep {m}' >/dev/null 2>&1 &); sleep 0.3",
    "a double-forked daemon": (
        "python3 -c 'import os, time\n"
        "if os.fork(): os._exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): os._exit(0)\n"
        'os.chdir("/"); time.sleep({m})\' ; sleep 0.3'
    ),
    "one ignoring SIGTERM and SIGHUP": "setsid sh -c \"trap '' TERM HUP; sleep {m}\" & sleep 0.3",
    "a new process group": 'python3 -c \'import os; os.setpgid(0, 0); os.execvp("sleep", ["sleep", "{m}"])\' & sleep 0.3',
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_nothing_started_outlives_its_call(sandbox, mark, escape):
    result = sandbox.exec(["sh", "-c", ESCAPES[escape].format(m=mark)])
    assert result.ok, result
    assert leftovers(mark) == []


def test_nothing_started_outlives_a_timeout(sandbox, mark):
    result = sandbox.exec(["sh", "-c", f"setsid sleep {mark} & sleep {mark}"], timeout=0.5)
    assert result.timed_out
    assert leftovers(mark) == []


def test_a_command_that_stops_its_wrapper_is_still_swept(sandbox, mark):
    result = sandbox.exec(
        ["sh", "-c", f"setsid sleep {mark} & kill -STOP $PPID; sleep {mark}"], timeout=0.5
    )
    assert result.timed_out
    assert leftovers(mark) == []


def test_a_fork_bomb_under_rlimit_nproc_is_gone(sandbox, mark):
    """A fork bomb in a session of its own, its processes capped by RLIMIT_NPROC (as root,
    which the limit does not bind, it runs as nobody), keeps replacing whatever dies; after
    its call none is left."""
    bomb = f"setsid -f bash -c 'b() {{ b | b & }}; b  # {mark}'"
    if os.geteuid() == 0:
        as_nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups"
        command = f"(ulimit -u 64; {as_nobody} {bomb})"
    else:
        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == os.getuid())
        command = f"(ulimit -u {mine + 64}; {bomb})"  # the bomb's limit, not the caller's
    count = (  # the processes carrying the mark, counted by the command before it ends
        "import os\nn = 0\nfor p in os.listdir('/proc'):\n"
        f"    try: n += b'{mark}' in open(f'/proc/{{p}}/cmdline', 'rb').read()\n"
        "    except OSError: pass\nprint(n)"
    )
    script = f'{command} >/dev/null 2>&1; sleep 1; "$0" -c "$1"'
    result = sandbox.exec(["bash", "-c", script, sys.executable, count], timeout=10)
    assert result.ok, result
    assert int(result.stdout) >= 20  # the bomb was alive, replacing its dead, at the end
    assert leftovers(mark) == []


def test_close_kills_what_escaped_a_killed_wrapper(tmp_path, mark):
    """A command that kills its own wrapper (kill -9 $PPID) orphans what it started to the
    host's init; what is still in the workspace dies when the sandbox closes."""
    box = LocalSandbox(exec_timeout=10.0, parent=tmp_path)
    try:
        box.exec(["sh", "-c", f"setsid sleep {mark} & sleep 0.3; kill -9 $PPID; sleep 1"])
    finally:
        box.close()
    assert leftovers(mark) == []


def test_exit_status_and_signals_pass_through(sandbox):
    assert sandbox.exec(["sh", "-c", "exit 3"]).exit_code == 3
    assert sandbox.exec(["sh", "-c", "kill -TERM $$"]).exit_code is None
    # SIGPIPE is the default again in the command (Python ignores it in the wrapper)
    piped = sandbox.exec(["sh", "-c", "yes | head -c 3"])
    assert piped.ok and piped.stdout == b"y\ny"
