"""Run one command and leave nothing it started: the local sandbox's wrapper of every command.

    python -I -S reaper.py PARENT_PID ARGV...

This process marks itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so everything the
command starts stays its descendant whatever session or group it makes: an orphan (`setsid`, a
double-forked daemon, `nohup ... &`) is re-parented here, not to the host's init. The command
runs in a process group of its own, so `kill 0` spares this process. When the command exits,
or this process gets SIGTERM (the caller's timeout; the caller's death, through
PR_SET_PDEATHSIG), every descendant is stopped (SIGSTOP: a stopped process cannot fork, so a
fork bomb cannot outrun the sweep), killed (SIGKILL, which no process ignores) and reaped, scan
after scan of /proc until none is left; then this process ends as the command did (its exit
status, or its signal).

NOTE: a command can still kill this process itself (`kill -9 $PPID`, as the same user): what
it started then goes to the host's init, and only the sandbox's close finds it (by its working
directory). Only a container bounds that.

A program, not a module: it imports nothing of retrograd and runs in a fresh interpreter of its
own (-I -S), never in a fork of the trainer, whose threads and locks a child must not inherit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
NOT_FOUND = 127  # what a shell answers for a program it cannot run
STOPPED_OR_DEAD = "TtZX"  # /proc states of a process that runs no more
STOP_PATIENCE = 2.0  # seconds to stop every descendant before killing them running


class Stop(Exception):
    """SIGTERM: sweep now."""


def _stop(signum, frame) -> None:
    raise Stop


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` and its state letter (R, S, D, T, t, Z, ...), from one scan
    of /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone since the listing
        children.setdefault(int(fields[1]), []).append((int(name), fields[0].decode()))
    out, todo = {}, [root]
    while todo:
        for child, state in children.get(todo.pop(), ()):
            out[child] = state
            todo.append(child)
    return out


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _reap(command: int, status: int | None) -> int | None:
    """Reap every child that has ended; the command's wait status when it is among them."""
    while True:
        try:
            pid, wait = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == command:
            status = wait


def _has_children() -> bool:
    """True while this process has a child, running or ended (none is reaped here)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def sweep(command: int, status: int | None) -> int | None:
    """Stop every descendant until none runs (a stopped process cannot fork or wake another),
    then kill them all, reap, and scan again until none is left. A process that will not stop
    (in uninterruptible sleep) is killed running after STOP_PATIENCE seconds. Returns the
    command's wait status (`status`, or the one reaped here)."""
    me, pause, started = os.getpid(), 0.0005, time.monotonic()
    if not _has_children():
        # No child, so no descendant: the command's orphans were re-parented here before it
        # could be reaped. The common case, answered without a scan of /proc.
        return status
    while procs := descendants(me):
        running = [pid for pid, state in procs.items() if state not in STOPPED_OR_DEAD]
        if running and time.monotonic() - started < STOP_PATIENCE:
            for pid in running:
                _signal(pid, signal.SIGSTOP)
        else:
            for pid, state in procs.items():
                if state not in "ZX":
                    _signal(pid, signal.SIGKILL)
        status = _reap(command, status)  # orphans of the killed come here, and are reaped
        time.sleep(pause)  # a stop or a kill lands asynchronously
        pause = min(pause * 2, 0.05)
    return _reap(command, status)


def _exit_as(status: int | None) -> None:
    """End this process as the command ended: its exit code, or its signal."""
    sys.stdout.flush()
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        import resource  # here alone: one import less for every command

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command's core, not ours
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # which have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


def _run(argv: list[str]) -> None:
    """In the child: the command, in a process group of its own, with default signals."""
    os.setpgid(0, 0)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):  # Python's own, undone
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.execvp(argv[0], argv)
    except OSError:
        os.write(2, f"{argv[0]}: command not found\n".encode(errors="replace"))
    os._exit(NOT_FOUND)


def main(parent: int, argv: list[str]) -> None:
    term = [signal.SIGTERM]
    signal.pthread_sigmask(signal.SIG_BLOCK, term)  # delivered only while the command runs
    signal.signal(signal.SIGTERM, _stop)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the caller died before the line above
        os._exit(1)
    command = os.fork()
    if command == 0:
        _run(argv)
    status = None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, term)
        status = os.waitpid(command, 0)[1]
    except Stop:
        pass
    signal.pthread_sigmask(signal.SIG_BLOCK, term)  # the sweep runs to its end
    _exit_as(sweep(command, status))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
