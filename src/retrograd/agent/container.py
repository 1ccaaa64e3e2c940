"""The container environment (formats.md §4.2): each trajectory's commands run in a container
of its own, leased from a pool, through a Docker-compatible CLI.

`ContainerSpec` is how every container of a pool starts (no network, read-only root, a tmpfs
/work, no capabilities, no namespaces (agent/seccomp.py), no log, resource limits, an init of
another uid than the commands') and what it refuses (root, a mount that exposes the engine's
socket); `ContainerSandbox` runs one command at a time with `<cli> exec` as uid 1000 and then
kills every process of that uid, so that nothing but init outlives a call; `ContainerPool`
starts, leases, resets (and checks) and removes containers, and reaps those a crashed run
left behind. The CLI is podman when present, else docker (which honours DOCKER_HOST);
RETRO_CONTAINER_CLI overrides both. Nothing here knows about tools or scenarios: they reach a
container through Sandbox.exec (agent/sandbox_env.py).

NOTE: every container carries retrograd.pool (one id per pool) and its creator's host, pid and
process start time: reap_stale removes only containers whose creator is dead on this host, so
concurrent runs never remove each other's containers.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shlex
import shutil
import socket
import stat
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from retrograd import environ
from retrograd.agent.container_scripts import (
    CHECK_IMAGE,
    IDLE,
    REAPER,
    RESET,
    WORKDIR,
    WRAPPER,
    WRITABLE,
)
from retrograd.agent.sandbox_env import PoolStats, SandboxEnvironment, SandboxPool
from retrograd.agent.seccomp import write_profile
from retrograd.agent.tools.catalog import load_catalog
from retrograd.agent.types import ExecResult, Sandbox
from retrograd.config import agent as agent_config
from retrograd.errors import ConfigError, EnvironmentFailure

CLI_VARIABLE = "RETRO_CONTAINER_CLI"
USER = "1000:1000"  # every command's
# pid 1's: not the commands' uid, so that no command can signal, stop, ptrace or write for it
INIT_USER = "65534:65534"
POOL_LABEL = "retrograd.pool"
HOST_LABEL, PID_LABEL, START_LABEL = "retrograd.host", "retrograd.pid", "retrograd.pid_start"
# profile -> (image, where cache_volume is mounted). NOTE: the mount is read-only, which pip
# refuses as its own cache (PIP_CACHE_DIR): setup commands read it as a wheelhouse instead.
PROFILES = {
    "python": ("python:3.12-slim", "/opt/cache/pip"),
    "typescript": ("node:22-slim", "/opt/cache/npm"),
}
ENGINE_SOCKETS = (
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/run/podman/podman.sock",
    "/run/containerd/containerd.sock",
)
GRACE_SECS = 15.0  # how long `<cli> exec` may run past the command's own timeout
CLI_TIMEOUT_SECS = 120.0  # run, rm, ps, inspect
ACQUIRE_TIMEOUT_SECS = 600.0  # waiting for a free container, rather than deadlocking
_CHUNK = 1 << 16


def container_cli() -> list[str]:
    """The container CLI's argv: RETRO_CONTAINER_CLI (split as a shell would); else docker
    when DOCKER_HOST names a daemon; else podman, else docker."""
    override = environ.get(CLI_VARIABLE)
    if override:
        return list(override)
    names = ("docker", "podman") if os.environ.get("DOCKER_HOST") else ("podman", "docker")
    for name in names:
        path = shutil.which(name)
        if path:
            return [path]
    raise EnvironmentFailure(
        "no container CLI: install podman or docker (scripts/agent-image.sh installs podman), "
        f"or name one in {CLI_VARIABLE}"
    )


_engine_dir: str | None = None


def _engine_cwd() -> str:
    """Where the container CLI runs: a directory of its own, made once a process and removed at
    exit. podman's monitor (conmon) writes a file named `oom` into its working directory when a
    command it runs is killed for memory; run from the user's directory, it left one there."""
    global _engine_dir
    if _engine_dir is None or not os.path.isdir(_engine_dir):
        import atexit
        import tempfile

        _engine_dir = tempfile.mkdtemp(prefix="retrograd-engine-")
        atexit.register(shutil.rmtree, _engine_dir, True)
    return _engine_dir


_profile_lock = threading.Lock()


def _seccomp_profile() -> str:
    """The path of agent/seccomp.py's profile, written once into the engine's directory."""
    with _profile_lock:
        folder = _engine_cwd()
        path = os.path.join(folder, "seccomp.json")
        return path if os.path.exists(path) else write_profile(folder)


def _cli(cli: list[str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(
            [*cli, *args],
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_SECS,
            cwd=_engine_cwd(),
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EnvironmentFailure(f"`{shlex.join([*cli, args[0]])}` failed: {err}") from None
    if check and done.returncode != 0:
        why = done.stderr.strip() or f"exit code {done.returncode}"
        raise EnvironmentFailure(f"`{shlex.join([*cli, *args[:2]])} ...` failed: {why}")
    return done


# -- who made a container ---------------------------------------------------------------


def _process_start(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), which tells a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19]  # field 22 of stat(5); fields[0] is field 3


def _owner_labels() -> dict[str, str]:
    pid = os.getpid()
    return {
        HOST_LABEL: socket.gethostname(),
        PID_LABEL: str(pid),
        START_LABEL: _process_start(pid) or "",
    }


def _creator_dead(host: str, pid: str, start: str) -> bool:
    """True only for a creator on this host that is gone (or whose pid now names another
    process); a container made elsewhere is not ours to judge."""
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if not Path("/proc/self/stat").exists():  # no procfs (macOS): the pid alone
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass  # alive, another user's
        return False
    now = _process_start(int(pid))
    return now is None or (start != "" and now != start)


def is_podman(cli: list[str]) -> bool:
    """Podman, under its name or as docker (podman-docker): it says so in --version."""
    return "podman" in _cli(cli, "--version", check=False).stdout.lower()


def _remove(cli: list[str], ids: list[str]) -> None:
    if ids:
        _cli(cli, "rm", "-f", *ids, check=False)


def _labelled(cli: list[str], label: str) -> list[str]:
    return _cli(cli, "ps", "-aq", "--filter", f"label={label}").stdout.split()


def reap_stale(cli: list[str] | None = None) -> list[str]:
    """Remove the containers of pools whose creating process died (a crash, a kill -9):
    every container labelled retrograd.pool made on this host by a process that is gone.
    Returns their ids."""
    cli = cli or container_cli()
    ids = _labelled(cli, POOL_LABEL)
    if not ids:
        return []
    keys = (HOST_LABEL, PID_LABEL, START_LABEL)
    fmt = "{{.Id}}" + "".join(f'|{{{{index .Config.Labels "{k}"}}}}' for k in keys)
    # A container may vanish between ps and inspect: read what inspect could answer.
    out = _cli(cli, "inspect", "--format", fmt, *ids, check=False).stdout
    stale = []
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 4 and _creator_dead(*fields[1:]):
            stale.append(fields[0])
    _remove(cli, stale)
    return stale


# -- how a container starts --------------------------------------------------------------


def _engine_sockets() -> list[str]:
    sockets = list(ENGINE_SOCKETS)
    host = os.environ.get("DOCKER_HOST", "")
    if host.startswith("unix://"):
        sockets.append(host[len("unix://") :])
    if os.environ.get("XDG_RUNTIME_DIR"):
        sockets.append(os.path.join(os.environ["XDG_RUNTIME_DIR"], "podman", "podman.sock"))
    # As written and resolved: /var holds /var/run/docker.sock even where /var/run -> /run.
    return sorted({*sockets, *(os.path.realpath(s) for s in sockets)})


def _exposes_engine(source: str) -> bool:
    """A bind source that is a socket, or is or holds a container engine's socket."""
    if not source.startswith("/"):
        return False  # a named volume
    path = os.path.realpath(source)
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            return True
    except OSError:
        pass
    prefix = path.rstrip("/") + "/"
    return any(s == path or s.startswith(prefix) for s in _engine_sockets())


@dataclass(frozen=True)
class ContainerSpec:
    """How every container of a pool starts; `check()` refuses what would weaken it."""

    image: str
    cpus: float = 1.0
    memory_mb: int = 1024
    pids: int = 256
    exec_timeout_secs: float = 30.0
    max_output_bytes: int = 65536
    allow_network: bool = False
    cache_volume: str | None = None
    cache_dir: str | None = None
    user: str = USER
    # NOTE: without a user namespace nproc counts every uid-1000 process of the host, so it
    # must leave room for all of a pool's containers; the pids limit is the per-container cap.
    nproc: int = 2048
    nofile: int = 1024

    @classmethod
    def from_section(cls, section: agent_config.ContainerEnvironment) -> ContainerSpec:
        where = "[agent.environment]"
        image, cache_dir = PROFILES.get(section.profile, (None, None))
        image = section.image or image
        if image is None:
            raise ConfigError(f'{where}.image: required with profile = "custom"')
        if section.cache_volume and cache_dir is None:
            raise ConfigError(
                f"{where}.cache_volume: profile {section.profile!r} has no package cache "
                "(python or typescript have one)"
            )
        limits = section.limits
        spec = cls(
            image=image,
            cpus=limits.cpus,
            memory_mb=limits.memory_mb,
            pids=limits.pids,
            exec_timeout_secs=limits.exec_timeout_secs,
            max_output_bytes=limits.max_output_bytes,
            allow_network=section.allow_network,
            cache_volume=section.cache_volume,
            cache_dir=cache_dir if section.cache_volume else None,
            nproc=max(1024, limits.pids * section.pool.max_live),
        )
        spec.check(f"{where}.cache_volume")
        return spec

    def check(self, where: str = "cache_volume") -> None:
        """Refuse a root user, the init's user, and any mount of a container engine's socket."""
        uid, _, gid = self.user.partition(":")
        if not uid.isdigit() or int(uid) == 0 or (gid and (not gid.isdigit() or int(gid) == 0)):
            raise ConfigError(
                f"container user {self.user!r}: containers run as a non-root numeric "
                "uid:gid (1000:1000), never as root"
            )
        if uid == INIT_USER.partition(":")[0]:
            raise ConfigError(
                f"container user {self.user!r}: the containers' init runs as {INIT_USER}, out "
                "of the commands' reach; commands need another uid (1000:1000)"
            )
        if self.cache_volume is None:
            return
        if ":" in self.cache_volume:
            raise ConfigError(
                f"{where} = {self.cache_volume!r}: a volume name or a host directory, without "
                "a target or options (it is mounted read-only on the profile's cache)"
            )
        if _exposes_engine(self.cache_volume):
            raise ConfigError(
                f"{where} = {self.cache_volume!r}: refused, it exposes the container engine's "
                "socket (docker.sock), which is root on the host"
            )
        if self.cache_dir is None:
            raise ConfigError(f"{where}: a cache volume needs the profile's cache directory")

    def run_args(self, labels: dict[str, str], *, podman: bool, seccomp: str) -> list[str]:
        """`run` arguments of a detached, idle container (what `exec` then runs in), for
        docker or podman; `seccomp` is the path of agent/seccomp.py's profile."""
        self.check()
        mb, nofile, nproc = self.memory_mb, self.nofile, self.nproc
        args = ["run", "--detach", "--rm", "--stop-timeout=0", "--read-only"]
        if podman:  # with --read-only podman adds writable tmpfs on /tmp, /var/tmp and /run
            args.append("--read-only-tmpfs=false")
        if not self.allow_network:
            args.append("--network=none")
        args += [
            # No log: pid 1 writes nothing, and nothing a command writes reaches the host's
            # disk (a log of pid 1's stdout grew without bound, whatever the memory limit).
            "--log-driver=none",
            f"--tmpfs={WORKDIR}:rw,exec,size={mb}m,mode=1777",  # counts against --memory anyway
            f"--user={INIT_USER}",  # pid 1's; commands run as self.user (ContainerSandbox)
            "--cap-drop=ALL",
            "--security-opt=no-new-privileges",
            f"--security-opt=seccomp={seccomp}",  # no namespaces, mounts, keyrings
            "--ipc=private",  # its own SysV IPC and /dev/mqueue, whatever the engine's default
            f"--memory={mb}m",
            f"--memory-swap={mb}m",
            f"--cpus={self.cpus:g}",
            f"--pids-limit={self.pids}",
            # The engine's default rlimits cannot always be applied (no CAP_SYS_RESOURCE).
            f"--ulimit=nofile={nofile}:{nofile}",
            f"--ulimit=nproc={nproc}:{nproc}",
            f"--workdir={WORKDIR}",
            f"--env=HOME={WORKDIR}",  # the only writable place
        ]
        if self.cache_volume:
            args.append(f"--volume={self.cache_volume}:{self.cache_dir}:ro")
        args += [f"--label={key}={labels[key]}" for key in sorted(labels)]
        return [*args, "--entrypoint", "sh", self.image, "-c", IDLE]


# -- one container ------------------------------------------------------------------------


class ContainerSandbox(Sandbox):
    """A live container; `exec` runs one command at a time in /work as uid 1000.

    After each command a reaper (REAPER, in an exec of its own, in the background) kills
    whatever the command left; the next call, `settle()` and the pool wait for it, so that a
    command never meets what an earlier one started.
    """

    workdir = WORKDIR

    def __init__(self, cli: list[str], cid: str, spec: ContainerSpec, on_close=None) -> None:
        self.cli = cli
        self.id = cid
        self.spec = spec
        self.leases = 0
        self.closed = False
        self._on_close = on_close
        self._reaper: threading.Thread | None = None
        self._broken: str | None = None  # why this container can serve no further command

    def exec(
        self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        if self.closed:
            raise EnvironmentFailure("the container sandbox is closed")
        if not argv:
            raise ValueError("exec needs a command")
        self.settle()
        secs = self.spec.exec_timeout_secs if timeout is None else timeout
        cmd = [*self.cli, "exec", "-i", f"--user={self.spec.user}", "-w", WORKDIR, self.id]
        cmd += ["sh", "-c", WRAPPER, "sh", f"{secs:.3f}", *argv]
        started = time.monotonic()
        code, out, err, truncated = _run_capped(
            cmd, stdin or b"", self.spec.max_output_bytes, secs + GRACE_SECS
        )
        elapsed = time.monotonic() - started
        if code is None or code == 125:  # the CLI hung, or the engine refused the exec
            if not self.alive():
                self._broken = f"container {self.id[:12]} is gone"
                raise EnvironmentFailure(self._broken)
        self._reaper = threading.Thread(target=self._reap, daemon=True)
        self._reaper.start()
        if code is None:
            return ExecResult(None, out, err, timed_out=True, truncated=truncated)
        # timeout exits 137 when the deadline killed the command. NOTE: a shell
        # reports a death by signal N as 128 + N; so does this sandbox, as exit_code None.
        timed_out = code == 137 and elapsed >= secs
        exit_code = None if timed_out or code > 128 else code
        return ExecResult(exit_code, out, err, timed_out=timed_out, truncated=truncated)

    def _reap(self) -> None:
        """Kill what the last command left, from outside its reach: the command could kill
        or stop its own wrapper, which runs as the same uid."""
        try:
            done = self._exec_as_user(REAPER)
        except EnvironmentFailure as err:
            self._broken = str(err)
            return
        if done.returncode == 1:
            self._broken = f"container {self.id[:12]}: a command's processes survived every kill"
        elif done.returncode != 0:
            self._broken = f"container {self.id[:12]} " + (
                f"failed its reaper: {done.stderr.strip() or done.returncode}"
                if self.alive()
                else "is gone"
            )

    def _exec_as_user(self, script: str) -> subprocess.CompletedProcess:
        """A script of ours as the commands' uid (kill -1 reaches that uid's processes alone),
        outside the wrapper."""
        user = f"--user={self.spec.user}"
        return _cli(self.cli, "exec", user, self.id, "sh", "-c", script, check=False)

    def settle(self) -> None:
        """Wait until the last command's reaper is done; EnvironmentFailure when a process
        survived it or the container is gone."""
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None
        if self._broken is not None:
            raise EnvironmentFailure(self._broken)

    def alive(self) -> bool:
        done = _cli(self.cli, "inspect", "--format", "{{.State.Running}}", self.id, check=False)
        return done.returncode == 0 and done.stdout.strip() == "true"

    def reset(self) -> bool:
        """Before another lease: no process left, /work, /dev/shm, /dev/mqueue and SysV IPC
        emptied, init healthy (RESET). False when any of that failed: replace the container."""
        try:
            self.settle()
            return self._exec_as_user(RESET).returncode == 0
        except EnvironmentFailure:
            return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _remove(self.cli, [self.id])
        if self._on_close is not None:
            self._on_close(self)


def _run_capped(
    cmd: list[str], data: bytes, cap: int, limit: float
) -> tuple[int | None, bytes, bytes, bool]:
    """Run the CLI, feed stdin, keep at most `cap` bytes of stdout + stderr (reading on past
    it) and kill the CLI after `limit` seconds: (exit code or None when killed, stdout,
    stderr, truncated)."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if data else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=_engine_cwd(),
        )
    except OSError as err:
        raise EnvironmentFailure(f"cannot run {cmd[0]}: {err}") from None
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    kept, truncated, sent = 0, False, 0
    deadline = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        for fd in out:
            sel.register(fd, selectors.EVENT_READ)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        open_streams = len(out)
        while open_streams:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                break
            for key, _ in sel.select(remaining):
                if key.fd in out:
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fd)
                        open_streams -= 1
                        continue
                    room = max(cap - kept, 0)
                    out[key.fd] += chunk[:room]
                    kept += min(room, len(chunk))
                    truncated = truncated or len(chunk) > room
                    continue
                try:
                    sent += os.write(key.fd, data[sent:])
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    sent = len(data)  # it stopped reading; its output says why
                if sent >= len(data):
                    sel.unregister(key.fd)
                    proc.stdin.close()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()
    try:
        code = proc.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    if code is not None and code < 0:
        code = None  # the CLI itself was killed
    stdout, stderr = (bytes(b) for b in out.values())
    return code, stdout, stderr, truncated


def _start_failure(image: str, done: subprocess.CompletedProcess) -> str:
    """Why `run` failed, short: a daemon that cannot read the seccomp profile quotes it whole."""
    why = done.stderr.strip() or f"exit code {done.returncode}"
    if "seccomp" in why:
        why = why[:300] + (
            " ... (the engine could not take the seccomp profile the CLI sent; podman's "
            "service behind a docker CLI takes a path only: use podman's own CLI)"
        )
    return f"cannot start a container of {image}: {why}"


# -- the pool -----------------------------------------------------------------------------


def _remove_pool(cli: list[str], pool_id: str) -> None:
    """Remove every container of a pool (close, and at exit whatever close missed)."""
    try:
        _remove(cli, _labelled(cli, f"{POOL_LABEL}={pool_id}"))
    except EnvironmentFailure:
        pass  # the engine is gone at exit; the next pool's reaper removes them


class ContainerPool(SandboxPool):
    """Containers of one spec, at most `max_live` alive, `min_idle` kept started ahead.

    reuse = "never": a container serves one lease and is removed. reuse = "workspace": it serves
    up to max_leases_per_container leases. An idle container (reused, or started ahead) is reset
    and checked before its lease (ContainerSandbox.reset), and replaced by a fresh one when
    that fails. `acquire` blocks
    while max_live containers are leased.
    Creating a pool reaps stale containers first; close() (or, failing that, the end of the
    process) removes all of this pool's containers.
    """

    def __init__(
        self,
        spec: ContainerSpec,
        settings: agent_config.ContainerPool | None = None,
        cli: list[str] | None = None,
        acquire_timeout_secs: float = ACQUIRE_TIMEOUT_SECS,
    ) -> None:
        spec.check()
        self.acquire_timeout_secs = acquire_timeout_secs
        self.spec = spec
        self.settings = settings or agent_config.ContainerPool()
        self.cli = cli or container_cli()
        self.podman = is_podman(self.cli)
        self.id = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._cond = threading.Condition()
        self._idle: list[ContainerSandbox] = []
        self._live: dict[str, ContainerSandbox] = {}
        self._starting = 0
        self._image_checked = False
        self._closed = False
        self.stats = PoolStats()
        self._finalizer = weakref.finalize(self, _remove_pool, self.cli, self.id)
        reap_stale(self.cli)
        self.warm()

    @property
    def live(self) -> int:
        """Containers alive now, idle or leased."""
        with self._cond:
            return len(self._live)

    def acquire(self) -> ContainerSandbox:
        deadline = time.monotonic() + self.acquire_timeout_secs
        while True:
            box = self._take(deadline)
            if box is None:  # room for one more
                box = self._start()
                box.leases = 1
                return box
            if box.reset():  # emptied and healthy (one started ahead may have died idle)
                box.leases += 1
                if box.leases > 1:
                    self.stats.add(reused=1)
                self._warm_soon()
                return box
            box.close()  # a sick container: another takes its place

    def _take(self, deadline: float) -> ContainerSandbox | None:
        """An idle container, or None once a start is counted in _starting; waits while
        max_live are leased."""
        with self._cond:
            while True:
                if self._closed:
                    raise EnvironmentFailure("the container pool is closed")
                if self._idle:
                    return self._idle.pop(0)
                if len(self._live) + self._starting < self.settings.max_live:
                    self._starting += 1
                    return None
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise EnvironmentFailure(
                        f"no container free after {self.acquire_timeout_secs:g} s: all "
                        f"[agent.environment.pool].max_live = {self.settings.max_live} are "
                        "leased (a rollout holds the containers of all its trajectories at "
                        "once: make max_live at least scenarios_per_update x group_size)"
                    )

    def release(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, ContainerSandbox), sandbox
        if sandbox.closed:
            return
        try:
            sandbox.settle()  # nothing of the trajectory runs on while the container idles
            settled = True
        except EnvironmentFailure:
            settled = False
        keep = (
            settled
            and self.settings.reuse == "workspace"
            and sandbox.leases < self.settings.max_leases_per_container
            and not self._closed
        )
        if keep:
            with self._cond:
                self._idle.append(sandbox)
                self._cond.notify()
        else:
            sandbox.close()
            self._warm_soon()

    def _warm_soon(self) -> None:
        """warm() in the background (a failure there shows at the next cold start)."""
        if self.settings.min_idle > len(self._idle) and not self._closed:
            threading.Thread(target=self._warm_quietly, daemon=True).start()

    def _warm_quietly(self) -> None:
        try:
            self.warm()
        except EnvironmentFailure:
            pass

    def warm(self) -> None:
        """Start containers until min_idle are idle (as far as max_live allows), in parallel:
        at start, and in the background after a lease or a removal."""
        with self._cond:
            want = self.settings.min_idle - len(self._idle)
            room = self.settings.max_live - len(self._live) - self._starting
            count = max(min(want, room), 0) if not self._closed else 0
            self._starting += count
        errors: list[EnvironmentFailure] = []

        def start() -> None:
            try:
                box = self._start()
            except EnvironmentFailure as err:
                errors.append(err)
                return
            with self._cond:
                self._idle.append(box)
                self._cond.notify()

        threads = [threading.Thread(target=start) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _start(self) -> ContainerSandbox:
        """One new container; the caller has counted it in _starting."""
        labels = {POOL_LABEL: self.id, **_owner_labels()}
        try:
            t0 = time.perf_counter()
            args = self.spec.run_args(labels, podman=self.podman, seccomp=_seccomp_profile())
            done = _cli(self.cli, *args, check=False)
            self.stats.add(created=1, create_seconds=time.perf_counter() - t0)
            if done.returncode != 0:
                raise EnvironmentFailure(_start_failure(self.spec.image, done))
            box = ContainerSandbox(self.cli, done.stdout.split()[-1], self.spec, self._forget)
            with self._cond:
                self._live[box.id] = box
                closed = self._closed
                self.stats.live(len(self._live))
            if closed:
                box.close()
                raise EnvironmentFailure("the container pool is closed")
            self._check_image(box)
            return box
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()

    def _check_image(self, box: ContainerSandbox) -> None:
        """Once per pool: the image's pid 1 starts, its commands run as a non-root user, and
        nothing but WRITABLE is writable to them (what a reset empties; an engine that adds
        writable places, as podman's service under a docker CLI adds /tmp and /run, would let
        one trajectory leave files for the next)."""
        if self._image_checked:
            return
        try:
            result = box.exec(["sh", "-c", CHECK_IMAGE], timeout=120.0)
        except EnvironmentFailure:
            box.close()
            raise EnvironmentFailure(
                f"image {self.spec.image}: its container stopped as it started; its pid 1 "
                "runs `env --ignore-signal=CHLD sleep infinity`, which needs GNU coreutils "
                "8.31 or later"
            ) from None
        uid, *writable = result.stdout.decode(errors="replace").split("\n")
        uid, writable = uid.strip(), sorted(w for w in writable if w)
        if not result.ok or not uid.isdigit() or int(uid) == 0:
            box.close()
            raise EnvironmentFailure(
                f"image {self.spec.image}: `id -u` printed {uid or 'nothing'!r} as uid "
                f"{self.spec.user}; containers must run as a non-root user"
            )
        extra = [w for w in writable if w not in WRITABLE]
        if extra:
            box.close()
            raise EnvironmentFailure(
                f"image {self.spec.image}: uid {self.spec.user} can write to "
                + ", ".join(extra[:5])
                + (" ..." if len(extra) > 5 else "")
                + f" besides {', '.join(WRITABLE)}: the engine "
                f"({shlex.join(self.cli)}) does not keep the root read-only (with docker's CLI "
                "in front of podman's service, use podman's own CLI)"
            )
        self._image_checked = True

    def _forget(self, box: ContainerSandbox) -> None:
        with self._cond:
            self._live.pop(box.id, None)
            if box in self._idle:
                self._idle.remove(box)
            self._cond.notify_all()

    def close(self) -> None:
        """Remove every container of this pool (idempotent)."""
        with self._cond:
            self._closed = True
            boxes = list(self._live.values())
            self._idle.clear()
            self._cond.notify_all()
        for box in boxes:
            box.closed = True
        _remove(self.cli, [box.id for box in boxes])
        with self._cond:
            self._live.clear()
        self._finalizer()  # by label: what a start in flight may have added


def container_environment(
    section: agent_config.ContainerEnvironment, run_dir: Path
) -> SandboxEnvironment:
    """[agent.environment] type = "container" made live. `run_dir` is the run file's folder,
    against which tool definition files and inline exec scripts resolve."""
    catalog = load_catalog(section.tools, Path(run_dir))
    pool = ContainerPool(ContainerSpec.from_section(section), section.pool)
    return SandboxEnvironment(
        pool,
        catalog,
        setup_timeout_secs=section.setup_timeout_secs,
        verify_timeout_secs=section.verify_timeout_secs,
    )
