"""LocalSandbox: the workspace as working directory, stdin, the output cap, and the process
group killed on timeout and on exit (children included)."""

from __future__ import annotations

import time
from pathlib import Path

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
