"""One reward or judge program as a child process: pipes, deadlines, stderr tail, process group.

This module moves bytes and lines; it does not know the protocol (program.py and judge.py say
what a line means). Invariant: every child started here ends with its process group killed and
its leader reaped, whatever happens: a failed batch, close(), garbage collection, interpreter
exit. Deadlines wait in the kernel (epoll on stdout, stdin and a pidfd), never in a busy loop.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable

from retrograd.errors import RetrogradError, RewardError

LINE_LIMIT = 8 << 20  # one stdout line (persistent), or a oneshot program's whole output
STDERR_TAIL = 8 << 10  # quoted in error messages
_CHUNK = 1 << 16  # a pipe's default capacity

# What an exchange ended on: on_line said done, stdout ended (or the program exited), the
# deadline passed, or a line (oneshot: the whole output) outgrew its limit.
DONE, EOF, TIMEOUT, OVERFLOW = "done", "eof", "timeout", "overflow"


class _Tail:
    """The last STDERR_TAIL bytes a child wrote to stderr, filled by a drain thread."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.dropped = False
        self.lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        with self.lock:
            self.data += chunk
            if len(self.data) > STDERR_TAIL:
                del self.data[: len(self.data) - STDERR_TAIL]
                self.dropped = True

    def text(self) -> str:
        with self.lock:
            text = self.data.decode("utf-8", "replace")
            return ("..." if self.dropped else "") + text


def _drain(fd: int, tail: _Tail) -> None:
    # NOTE: a free function holding no reference to the Child, so garbage collection of the
    # Child can still run its finalizer (which kills the group, which ends this thread).
    while chunk := os.read(fd, _CHUNK):
        tail.add(chunk)


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when `pid` exits (Linux 5.3+); None elsewhere."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _end(popen: subprocess.Popen, pidfd: int | None, drain: threading.Thread) -> None:
    """Kill the process group, then reap the leader (in that order: until it is reaped, the
    leader's pid, which names the group, cannot be reused)."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already
    popen.wait()
    for pipe in (popen.stdin, popen.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()
    if pidfd is not None:
        os.close(pidfd)
    drain.join(timeout=1.0)  # EOF follows the kill unless a process left the group
    if not drain.is_alive() and popen.stderr is not None:
        popen.stderr.close()


class Child:
    """A started program in its own process group, with piped stdin, stdout and stderr."""

    def __init__(self, argv: list[str], cwd: str | os.PathLike | None = None) -> None:
        # Raises OSError when the program cannot be started; the caller words it.
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            bufsize=0,
            start_new_session=True,  # its own session and process group: pgid == pid
        )
        self.pid = self.popen.pid
        self._pidfd = _pidfd(self.pid)
        self._in = self.popen.stdin.fileno()
        self._out = self.popen.stdout.fileno()
        os.set_blocking(self._in, False)
        self._buffer = bytearray()  # stdout not yet cut into lines
        self._scanned = 0  # bytes of _buffer already searched for a newline
        self.received = 0  # stdout bytes read so far
        self.exited_alone = False  # the leader exited before we killed it
        self.tail = _Tail()
        drain = threading.Thread(
            target=_drain, args=(self.popen.stderr.fileno(), self.tail), daemon=True
        )
        drain.start()
        self._end = weakref.finalize(self, _end, self.popen, self._pidfd, drain)

    # --- talking -------------------------------------------------------------------------

    def exchange(
        self,
        data: bytes,
        deadline: float,
        on_line: Callable[[bytes], bool],
        *,
        close_stdin: bool = False,
        total_limit: int | None = None,
    ) -> str:
        """Write `data` to stdin while cutting stdout into lines for `on_line`, until it returns
        True (DONE), stdout ends or the leader exits (EOF), `deadline` (time.monotonic) passes
        (TIMEOUT), or a line over LINE_LIMIT, or more than `total_limit` bytes, arrive
        (OVERFLOW). Lines reach `on_line` without their newline; a last unterminated line is
        passed at EOF. Stdin is closed once written when `close_stdin`."""
        view, sent = memoryview(data), 0
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            if self._pidfd is not None:
                sel.register(self._pidfd, selectors.EVENT_READ)
            if data:
                sel.register(self._in, selectors.EVENT_WRITE)
            elif close_stdin:
                self.close_stdin()
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return TIMEOUT
                for event, _ in sel.select(remaining):
                    if event.fd == self._in:
                        try:
                            sent += os.write(self._in, view[sent:])
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            sent = len(data)  # it stopped reading: its output says why
                        if sent == len(data):
                            sel.unregister(self._in)
                            if close_stdin:
                                self.close_stdin()
                    elif event.fd == self._out:
                        status = self._read(on_line, total_limit)
                        if status is not None:
                            return status
                    else:  # the leader exited: take what it wrote, then report EOF
                        return self._read_rest(on_line, total_limit, deadline)

    def _read(self, on_line: Callable[[bytes], bool], total_limit: int | None) -> str | None:
        chunk = os.read(self._out, _CHUNK)
        if not chunk:
            return DONE if self._buffer and on_line(self._take_rest()) else EOF
        self.received += len(chunk)
        if total_limit is not None and self.received > total_limit:
            return OVERFLOW
        return self._cut(chunk, on_line)

    def _read_rest(
        self, on_line: Callable[[bytes], bool], total_limit: int | None, deadline: float
    ) -> str:
        """After the leader's exit: what is already in the pipe, without waiting for EOF (a
        child it left behind may hold stdout open)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            while sel.select(0) and time.monotonic() < deadline:
                status = self._read(on_line, total_limit)
                if status is not None:
                    return status
        return DONE if self._buffer and on_line(self._take_rest()) else EOF

    def _cut(self, chunk: bytes, on_line: Callable[[bytes], bool]) -> str | None:
        buffer = self._buffer
        buffer += chunk
        start, search = 0, self._scanned
        while (end := buffer.find(b"\n", search)) >= 0:
            line = bytes(buffer[start:end])
            start = search = end + 1
            if len(line) > LINE_LIMIT:
                return OVERFLOW
            if on_line(line):
                del buffer[:start]
                self._scanned = 0
                return DONE
        del buffer[:start]
        self._scanned = len(buffer)
        return OVERFLOW if len(buffer) > LINE_LIMIT else None

    def _take_rest(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._scanned = 0
        return rest

    def stray(self) -> bytes:
        """Output nobody asked for (between batches), read without waiting."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            while len(self._buffer) <= LINE_LIMIT and sel.select(0):
                chunk = os.read(self._out, _CHUNK)
                if not chunk:
                    break
                self._buffer += chunk
        return bytes(self._buffer)

    def close_stdin(self) -> None:
        if not self.popen.stdin.closed:
            self.popen.stdin.close()

    # --- ending --------------------------------------------------------------------------

    def wait(self, deadline: float) -> bool:
        """Wait until the leader exits or `deadline` passes, without reaping it."""
        if self.popen.returncode is not None:
            return True
        remaining = max(0.0, deadline - time.monotonic())
        if self._pidfd is None:  # no pidfd: Popen.wait polls, and reaps
            try:
                self.popen.wait(remaining)
            except subprocess.TimeoutExpired:
                return False
            self.exited_alone = True
            return True
        with selectors.DefaultSelector() as sel:
            sel.register(self._pidfd, selectors.EVENT_READ)
            exited = bool(sel.select(remaining))
        self.exited_alone |= exited
        return exited

    def kill(self) -> None:
        """Kill the process group and reap the leader; idempotent."""
        self._end()

    def close(self, grace: float) -> None:
        """Close stdin (the program's cue to finish), give it `grace` seconds, kill the group."""
        self.close_stdin()
        self.wait(time.monotonic() + grace)
        self.kill()

    @property
    def status(self) -> str:
        """How the leader ended, for messages: only meaningful after kill()."""
        code = self.popen.returncode
        if code is None or not self.exited_alone:
            return "still running, killed"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit status {code}"


class Channel:
    """A program as configured (argv, working directory, the key that named it): starts its
    children and words its failures."""

    def __init__(
        self,
        argv: list[str],
        where: str,
        *,
        cwd: str | os.PathLike | None = None,
        unit: str = "batch",
        error: type[RetrogradError] = RewardError,
    ) -> None:
        if not argv or not all(isinstance(arg, str) and arg for arg in argv):
            raise ValueError(f"{where}: an argument list of non-empty strings is required")
        self.argv, self.where, self.cwd, self.unit, self.error = list(argv), where, cwd, unit, error

    def start(self, number: int) -> Child:
        try:
            return Child(self.argv, self.cwd)
        except OSError as exc:
            where = "" if os.sep in self.argv[0] else " (searched in PATH)"
            what = f"cannot start {self.argv[0]!r}{where}: {exc.strerror}"
            raise self.fail(what, number) from None

    def fail(
        self,
        what: str,
        number: int,
        child: Child | None = None,
        *,
        line: int | str | None = None,
        raw: bytes | None = None,
    ) -> RetrogradError:
        """The error for a failed batch; kills `child` first, so its stderr tail is complete."""
        if child is not None:
            child.kill()
        place = f"{self.unit} {number}" + ("" if line is None else f", line {line}")
        message = f"{self.where} = {json.dumps(self.argv)}: {place}: {what}"
        if raw is not None:
            message += f"\n  the line: {_quote(raw)}"
        tail = child.tail.text().rstrip() if child is not None else ""
        if tail:
            message += "\n  stderr (last 8 KiB):\n    " + tail.replace("\n", "\n    ")
        elif child is not None:
            message += "\n  stderr: (empty)"
        return self.error(message)


def _quote(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(raw)} bytes)"
