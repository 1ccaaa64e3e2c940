"""The local environment's sandbox: a fresh temporary directory per trajectory, on the host.

No isolation at all (hence `allow_unsandboxed = true`): a command can read and write anything
the user can. What it does keep is the container's contract: every command runs with the
workspace as its working directory, under a wrapper (agent/reaper.py, a child subreaper in a
session of its own) that kills and reaps everything the command started, whatever session or
group it made, when the command exits or times out (so nothing outlives its call); its stdout +
stderr are capped at max_output_bytes (`ExecResult.truncated` says so; the marker is the tool
renderer's). Closing the sandbox also kills what still works in its workspace (what escaped a
wrapper the command killed). Deadlines wait in the kernel (select on the pipes and a pidfd).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from retrograd.agent.sandbox_env import SandboxEnvironment, SandboxPool
from retrograd.agent.tools.catalog import load_catalog
from retrograd.agent.types import ExecResult, Sandbox
from retrograd.config.agent import LocalEnvironment
from retrograd.errors import EnvironmentFailure

EXEC_TIMEOUT_SECS = 30.0  # the container defaults ([agent.environment.limits])
MAX_OUTPUT_BYTES = 65536
_CHUNK = 1 << 16
_GRACE = 1.0  # seconds to read what is left in the pipes once the group is killed
_SWEEP_SECS = 10.0  # how long a timed-out command's wrapper may take to kill everything
REAPER = Path(__file__).with_name("reaper.py")


class LocalSandbox(Sandbox):
    """A temporary directory under `parent` (the system's temporary folder by default: a
    folder inside a project would let pytest or npm find that project's configuration)."""

    def __init__(
        self,
        exec_timeout: float = EXEC_TIMEOUT_SECS,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        parent: str | Path | None = None,
    ) -> None:
        self.exec_timeout = exec_timeout
        self.max_output_bytes = max_output_bytes
        self.workdir = tempfile.mkdtemp(prefix="retrograd-work-", dir=parent)
        self.closed = False
        self._running: set[subprocess.Popen] = set()  # wrappers of commands under way
        self._lock = threading.Lock()

    def exec(
        self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        if self.closed:
            raise EnvironmentFailure("the local sandbox is closed")
        limit = self.exec_timeout if timeout is None else timeout
        # NOTE: -I also keeps the script's folder off sys.path (-P), where agent/types.py
        # would shadow the standard library's types module.
        wrapped = [sys.executable, "-I", "-S", str(REAPER), str(os.getpid()), *argv]
        try:
            popen = subprocess.Popen(
                wrapped,
                cwd=self.workdir,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own session and group: pgid == pid
            )
        except OSError as e:
            raise EnvironmentFailure(f"the local sandbox cannot start a command: {e}") from None
        with self._lock:
            self._running.add(popen)
        try:
            return _collect(popen, stdin or b"", time.monotonic() + limit, self.max_output_bytes)
        finally:
            _stop(popen)
            with self._lock:
                self._running.discard(popen)
            for pipe in (popen.stdin, popen.stdout, popen.stderr):
                if pipe is not None and not pipe.closed:
                    pipe.close()

    def close(self) -> None:
        """Stop the commands under way (their wrappers sweep), kill whatever still works in
        the workspace, and remove it."""
        self.closed = True
        with self._lock:
            running = list(self._running)
        for popen in running:
            _stop(popen)
        _kill_working_in(self.workdir)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _kill_group(popen: subprocess.Popen) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def _stop(popen: subprocess.Popen) -> None:
    """End a command: its wrapper, woken if the command stopped it, sweeps on SIGTERM; a
    wrapper that does not end within _SWEEP_SECS is killed with its group."""
    if popen.poll() is not None:
        return
    for signum in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(popen.pid, signum)
        except ProcessLookupError:
            break
    try:
        popen.wait(_SWEEP_SECS)
    except subprocess.TimeoutExpired:
        _kill_group(popen)
        popen.wait()


def _kill_working_in(workdir: str) -> None:
    """SIGKILL every process of this user whose working directory is inside `workdir`,
    stopped first and scanned again until none is found (the fate of what escaped a wrapper
    the command killed, and stayed in its workspace)."""
    root = os.path.realpath(workdir) + os.sep
    for _ in range(100):
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                cwd = os.readlink(f"/proc/{name}/cwd") + os.sep
            except OSError:
                continue  # gone, or not ours to read
            if cwd.startswith(root):
                found.append(int(name))
        if not found:
            return
        for signum in (signal.SIGSTOP, signal.SIGKILL):
            for pid in found:
                try:
                    os.kill(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
        time.sleep(0.01)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # not Linux 5.3+: the loop polls instead


def _collect(popen: subprocess.Popen, data: bytes, deadline: float, cap: int) -> ExecResult:
    """Feed stdin, read both streams under the cap until they end, the leader exits (then
    its group is killed), or the deadline passes (then too)."""
    out = {popen.stdout.fileno(): bytearray(), popen.stderr.fileno(): bytearray()}
    kept, truncated, timed_out, exited, group_killed, sent = 0, False, False, False, False, 0
    pidfd = _pidfd(popen.pid)
    with selectors.DefaultSelector() as sel:
        for fd in out:
            sel.register(fd, selectors.EVENT_READ)
        if data:
            os.set_blocking(popen.stdin.fileno(), False)
            sel.register(popen.stdin.fileno(), selectors.EVENT_WRITE)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        open_streams = len(out)
        while open_streams:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # A process that left the group may hold the pipes after the leader's exit:
                # that is the end of reading, not a timeout.
                timed_out = not exited
                break
            wait = remaining if pidfd is not None else min(remaining, 0.05)
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    exited = True
                elif fd in out:
                    chunk = os.read(fd, _CHUNK)
                    if not chunk:
                        sel.unregister(fd)
                        open_streams -= 1
                        continue
                    room = max(cap - kept, 0)
                    out[fd] += chunk[:room]
                    kept += min(room, len(chunk))
                    truncated = truncated or len(chunk) > room
                else:
                    try:
                        sent += os.write(fd, data[sent:])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        sent = len(data)  # it stopped reading; its output says why
                    if sent >= len(data):
                        sel.unregister(fd)
                        popen.stdin.close()
            if not exited and pidfd is None and popen.poll() is not None:
                exited = True
            if exited and not group_killed:
                # The leader is done: its background jobs die with the group, and their EOF
                # (or the grace period) ends the reading.
                _kill_group(popen)
                group_killed = True
                deadline = min(deadline, time.monotonic() + _GRACE)
    if pidfd is not None:
        os.close(pidfd)
    if not timed_out:
        try:
            popen.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    _stop(popen)
    code = popen.wait()
    exit_code = None if timed_out or code < 0 else code
    stdout, stderr = out[popen.stdout.fileno()], out[popen.stderr.fileno()]
    return ExecResult(exit_code, bytes(stdout), bytes(stderr), timed_out, truncated)


class LocalPool(SandboxPool):
    """A fresh LocalSandbox per acquire; released ones are removed, never reused."""

    def __init__(
        self,
        exec_timeout: float = EXEC_TIMEOUT_SECS,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        parent: str | Path | None = None,
    ) -> None:
        self.exec_timeout = exec_timeout
        self.max_output_bytes = max_output_bytes
        self.parent = parent
        self.live: set[LocalSandbox] = set()

    def acquire(self) -> Sandbox:
        sandbox = LocalSandbox(self.exec_timeout, self.max_output_bytes, self.parent)
        self.live.add(sandbox)
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        self.live.discard(sandbox)  # type: ignore[arg-type]
        sandbox.close()

    def close(self) -> None:
        for sandbox in list(self.live):
            self.release(sandbox)


def local_environment(section: LocalEnvironment, run_dir: Path) -> SandboxEnvironment:
    """[agent.environment] type = "local" made live. `run_dir` is the run file's folder:
    relative definition files and inline exec scripts resolve against it. Commands time out
    after 30 s and print at most 65536 bytes, as a container's default limits."""
    catalog = load_catalog(section.tools, Path(run_dir))
    return SandboxEnvironment(
        LocalPool(),
        catalog,
        setup_timeout_secs=section.setup_timeout_secs,
        verify_timeout_secs=section.verify_timeout_secs,
    )
