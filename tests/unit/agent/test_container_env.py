"""The container environment against real podman and the locally built test image (the
fixtures, in containers.py, fail every test, saying what to run, where podman or the image is
missing; nothing skips). What a hostile command cannot do is test_container_isolation.py's.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from retrograd.agent.container import (
    HOST_LABEL,
    PID_LABEL,
    POOL_LABEL,
    START_LABEL,
    ContainerPool,
    ContainerSandbox,
    ContainerSpec,
    _creator_dead,
    _owner_labels,
    container_environment,
    reap_stale,
)
from retrograd.agent.local import LocalSandbox
from retrograd.agent.scenarios import parse_scenario
from retrograd.agent.types import Observation, Verification
from retrograd.config.agent import ContainerEnvironment
from retrograd.config.agent import ContainerPool as PoolSettings
from retrograd.errors import ConfigError, EnvironmentFailure
from tests.unit.agent import containers
from tests.unit.agent.containers import IMAGE, REPO, exists, labelled, spec, text

# The fixtures (tests/e2e import `cli` from here).
cli, pool, box = containers.cli, containers.pool, containers.box

pytestmark = pytest.mark.slow


def test_a_command_runs_as_uid_1000_in_work_without_capabilities(box):
    result = box.exec(["sh", "-c", "id -u; id -g; pwd; grep CapEff /proc/self/status"])
    assert result.ok, result
    assert text(result).split("\n")[:3] == ["1000", "1000", "/work"]
    assert text(result).split()[-1] == "0000000000000000"
    assert box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"]) == (
        box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])  # deterministic
    )
    failed = box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (failed.exit_code, failed.stdout, failed.stderr) == (3, b"out\n", b"err\n")
    missing = box.exec(["no-such-tool", "x"])
    assert (missing.exit_code, missing.stderr) == (127, b"no-such-tool: command not found\n")
    assert box.exec(["cat"], stdin=b"x" * 200_000).stdout == b"x" * 65536  # the default cap


def test_results_match_a_local_sandbox(box, tmp_path):
    """The local sandbox (agent/local.py) as the reference: same exit codes, streams, timeout
    and truncation flags for the same commands."""
    local = LocalSandbox(max_output_bytes=1000, parent=tmp_path)
    box.settle()  # its reaper (of the pool's `id -u`), which would kill this one's commands
    contained = ContainerSandbox(box.cli, box.id, spec(max_output_bytes=1000))
    cases = [
        (["sh", "-c", "echo out; echo err >&2; exit 3"], None, None),
        (["sh", "-c", "echo x >&2; kill -9 $$"], None, None),
        (["sh", "-c", "read x; echo got $x"], b"line\n", None),
        (["no-such-tool", "--help"], None, None),
        (["sh", "-c", "echo started; sleep 30"], None, 1.0),
        (["sh", "-c", "yes | head -c 3000; echo done >&2"], None, None),
        (["sh", "-c", "sleep 30 & echo bg"], None, None),
    ]
    try:
        for argv, stdin, timeout in cases:
            assert contained.exec(argv, stdin, timeout) == local.exec(argv, stdin, timeout), argv
    finally:
        local.close()


def test_nothing_outside_work_is_writable(box):
    for path in ("/etc/x", "/tmp/x", "/home/runner/x", "/x"):
        result = box.exec(["touch", path])
        assert result.exit_code == 1, (path, result)
        assert b"Read-only file system" in result.stderr, (path, result)
    assert box.exec(["sh", "-c", "echo hi > notes && mkdir -p a/b && cat notes"]).stdout == b"hi\n"


def test_no_network(box):
    assert text(box.exec(["ls", "/sys/class/net"])).split() == ["lo"]
    probe = textwrap.dedent(
        """
        import socket
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("1.1.1.1", 80))
        except OSError as err:
            print("refused", err.errno)
        else:
            print("connected")
        """
    )
    result = box.exec(["python3", "-c", probe])
    assert text(result) == "refused 101\n", result  # ENETUNREACH


def test_a_command_and_its_children_die_at_the_timeout(box):
    started = time.monotonic()
    # A child in the command's group, and one that left it with setsid.
    result = box.exec(["sh", "-c", "sleep 100 & setsid sleep 101 & sleep 102"], timeout=2)
    elapsed = time.monotonic() - started
    assert result.timed_out and result.exit_code is None and not result.ok
    assert result.stderr == b"" and 2.0 <= elapsed < 5.0, (result, elapsed)
    listing = text(box.exec(["ps", "-eo", "args"]))
    assert "sleep 10" not in listing, listing
    assert "sleep infinity" in listing  # the container's init lives on
    # The limit's default: ContainerSpec.exec_timeout_secs.
    box.settle()  # its reaper, which would kill the other sandbox's command too
    quick = ContainerSandbox(box.cli, box.id, spec(exec_timeout_secs=1.0))
    started = time.monotonic()
    assert quick.exec(["sleep", "30"]).timed_out
    assert time.monotonic() - started < 4.0


def test_a_background_job_does_not_outlive_its_command(box):
    result = box.exec(["sh", "-c", "(sleep 200 &); sleep 300 & echo started"])
    assert result.ok and result.stdout == b"started\n"
    assert "sleep 200" not in text(box.exec(["ps", "-eo", "args"]))
    assert "sleep 300" not in text(box.exec(["ps", "-eo", "args"]))


def test_output_is_capped(pool):
    sandbox = pool(max_output_bytes=1000).acquire()
    result = sandbox.exec(["sh", "-c", "yes | head -c 5000"])
    assert result.ok and result.truncated and result.stdout == b"y\n" * 500
    both = sandbox.exec(["sh", "-c", "head -c 600 /dev/zero; sleep 0.2; head -c 600 /dev/zero >&2"])
    assert both.truncated and (len(both.stdout), len(both.stderr)) == (600, 400)
    exact = sandbox.exec(["head", "-c", "1000", "/dev/zero"])
    assert not exact.truncated and len(exact.stdout) == 1000
    # An endless writer is drained to its timeout, not left blocked on a full pipe.
    endless = sandbox.exec(["yes"], timeout=2)
    assert endless.timed_out and endless.truncated and len(endless.stdout) == 1000


def test_memory_and_process_limits(pool, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sandbox = pool(memory_mb=128, pids=32).acquire()
    hog = sandbox.exec(["python3", "-c", "b = bytearray(512 << 20); print(len(b))"])
    assert (hog.exit_code, hog.timed_out, hog.stderr) == (None, False, b""), hog  # OOM-killed
    # podman's monitor notes the kill in a file `oom` of its working directory: not the user's
    assert list(tmp_path.iterdir()) == []
    forks = sandbox.exec(["sh", "-c", "for i in $(seq 64); do sleep 5 & done; wait"], timeout=10)
    assert b"fork" in forks.stderr.lower() or b"resource" in forks.stderr.lower(), forks


def test_the_cache_volume_is_mounted_read_only(pool, tmp_path):
    cache = tmp_path / "wheels"
    cache.mkdir()
    (cache / "pkg-1.0-py3-none-any.whl").write_bytes(b"wheel")
    sandbox = pool(cache_volume=str(cache), cache_dir="/opt/cache/pip").acquire()
    read = sandbox.exec(["cat", "/opt/cache/pip/pkg-1.0-py3-none-any.whl"])
    assert read.ok and read.stdout == b"wheel"
    write = sandbox.exec(["touch", "/opt/cache/pip/new"])
    assert write.exit_code == 1 and b"Read-only file system" in write.stderr
    assert sorted(p.name for p in cache.iterdir()) == ["pkg-1.0-py3-none-any.whl"]


def test_reuse_workspace_empties_work_between_leases(cli, pool):
    p = pool(PoolSettings(reuse="workspace", max_leases_per_container=2))
    first = p.acquire()
    first.exec(["sh", "-c", "mkdir -p d/e && echo x > d/e/f && echo y > .hidden && chmod 500 d"])
    assert first.exec(["sh", "-c", "sleep 500 > /dev/null 2>&1 &"]).ok
    p.release(first)
    second = p.acquire()
    assert second is first and second.leases == 2
    assert second.exec(["ls", "-A", "/work"]).stdout == b""
    assert "sleep 500" not in text(second.exec(["ps", "-eo", "args"]))
    p.release(second)  # its last lease: removed
    assert not exists(cli, first.id)
    third = p.acquire()
    assert third.id != first.id and third.leases == 1
    assert p.live == 1
    assert p.stats.created == 2 and p.stats.reused == 1  # one lease of three served by reuse
    stats = p.stats.take()
    assert stats["env/container_create_ms"] > 0 and stats["env/live_containers_max"] >= 1
    assert stats["env/pool_reuse_fraction"] == 0.0  # acquires are counted by the environment
    assert p.stats.reused == 0 and p.stats.created == 0  # take() starts a fresh count


def test_reuse_never_gives_a_fresh_container(cli, pool):
    p = pool()  # reuse = "never"
    first = p.acquire()
    first.exec(["sh", "-c", "echo x > left-behind"])
    p.release(first)
    assert first.closed and not exists(cli, first.id)
    second = p.acquire()
    assert second.id != first.id and second.exec(["ls", "-A"]).stdout == b""
    assert p.live == 1


def test_max_live_blocks_acquire_until_a_release(pool):
    p = pool(PoolSettings(max_live=2, min_idle=1))
    assert p.live == 1  # min_idle started one ahead
    one, two = p.acquire(), p.acquire()
    got: list[ContainerSandbox] = []
    waiter = threading.Thread(target=lambda: got.append(p.acquire()))
    waiter.start()
    waiter.join(1.5)
    assert waiter.is_alive() and not got and p.live == 2
    p.release(one)
    waiter.join(30)
    assert not waiter.is_alive() and got and got[0].id not in (one.id, two.id)
    assert p.live == 2
    p.acquire_timeout_secs = 0.5  # a rollout holding more than max_live fails, never hangs
    with pytest.raises(EnvironmentFailure, match="max_live = 2 are leased"):
        p.acquire()


def test_close_leaves_no_container_behind(cli, pool):
    p = pool(PoolSettings(min_idle=2, max_live=3, reuse="workspace"))
    leased = p.acquire()
    deadline = time.monotonic() + 30
    while p.live < 3 and time.monotonic() < deadline:  # a third warms in the background
        time.sleep(0.1)
    assert len(labelled(cli, f"{POOL_LABEL}={p.id}")) == 3  # two idle, one leased
    p.close()
    assert labelled(cli, f"{POOL_LABEL}={p.id}") == []
    assert leased.closed
    p.close()  # idempotent


CRASH = """
import os, signal, sys
from retrograd.agent.container import ContainerPool, ContainerSpec
pool = ContainerPool(ContainerSpec(image=sys.argv[1], memory_mb=64), cli=[sys.argv[2]])
print(pool.acquire().id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no atexit
"""


EXIT = """
import sys
from retrograd.agent.container import ContainerPool, ContainerSpec
pool = ContainerPool(ContainerSpec(image=sys.argv[1], memory_mb=64), cli=[sys.argv[2]])
print(pool.acquire().id, flush=True)
# no close(): the pool's finalizer removes it as the interpreter exits
"""


def test_an_unclosed_pool_is_removed_at_exit(cli):
    done = subprocess.run(
        [sys.executable, "-c", EXIT, IMAGE, cli[0]], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and not exists(cli, done.stdout.strip())


def test_a_container_that_vanished_fails_the_trajectory(cli, pool):
    p = pool(PoolSettings(reuse="workspace"))
    sandbox = p.acquire()
    subprocess.run([*cli, "rm", "-f", sandbox.id], capture_output=True, check=True)
    with pytest.raises(EnvironmentFailure, match=f"container {sandbox.id[:12]} is gone"):
        sandbox.exec(["true"])
    p.release(sandbox)  # a failed reset: removed, not reused
    assert p.live == 0


def test_reap_stale_removes_the_containers_of_a_dead_creator(cli, pool):
    mine = pool().acquire()  # a live creator (this process): never reaped
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH, IMAGE, cli[0]], capture_output=True, text=True, cwd=REPO
    )
    assert crashed.returncode == -9, crashed.stderr
    orphan = crashed.stdout.strip()
    assert exists(cli, orphan)
    assert orphan in reap_stale(cli)
    assert not exists(cli, orphan) and exists(cli, mine.id)
    assert reap_stale(cli) == []


def test_a_creator_is_known_by_host_pid_and_start_time():
    me = _owner_labels()
    host, pid, start = me[HOST_LABEL], me[PID_LABEL], me[START_LABEL]
    assert start.isdigit() and not _creator_dead(host, pid, start)
    assert _creator_dead(host, pid, str(int(start) + 1))  # the pid, reused by another process
    assert not _creator_dead("another-host", "999999999", start)  # not ours to judge
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _creator_dead(host, str(gone.pid), "")


def test_root_and_engine_sockets_are_refused(cli, tmp_path, monkeypatch):
    for user in ("0:0", "0", "root", "1000:0"):
        with pytest.raises(ConfigError, match="never as root"):
            ContainerPool(spec(user=user), cli=cli)
    socket_dir = tmp_path / "run"
    socket_dir.mkdir()
    fake = socket_dir / "engine.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(fake))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{fake}")  # an engine's socket where it says
    try:
        for volume in ("/var/run/docker.sock", "/run", "/", "/var", str(fake), str(socket_dir)):
            keys = {"cache_volume": volume, "cache_dir": "/opt/cache/pip"}
            with pytest.raises(ConfigError, match="docker.sock|engine"):
                ContainerPool(spec(**keys), cli=cli)
    finally:
        server.close()
    section = {"type": "container", "tools": {"default": "base"}}
    with pytest.raises(ConfigError, match=r"cache_volume = '/var/run/docker.sock'.*socket"):
        ContainerSpec.from_section(
            ContainerEnvironment.model_validate({**section, "cache_volume": "/var/run/docker.sock"})
        )
    with pytest.raises(ConfigError, match=r"\.image: required"):
        ContainerSpec.from_section(
            ContainerEnvironment.model_validate({**section, "profile": "custom"})
        )
    with pytest.raises(ConfigError, match="a volume name or a host directory"):
        ContainerSpec.from_section(
            ContainerEnvironment.model_validate({**section, "cache_volume": "v:/etc"})
        )


def test_run_arguments_follow_the_section():
    section = ContainerEnvironment.model_validate(
        {
            "type": "container",
            "tools": {"default": "python"},
            "cache_volume": "pip-cache",
            "limits": {"cpus": 0.5, "memory_mb": 300, "pids": 40},
            "pool": {"max_live": 3},
        }
    )
    built = ContainerSpec.from_section(section)
    assert built.image == "python:3.12-slim"
    args = built.run_args({POOL_LABEL: "p1"}, podman=False, seccomp="/profile.json")
    joined = " ".join(args)
    for part in (
        "--network=none",
        "--read-only",
        "--tmpfs=/work:rw,exec,size=300m,mode=1777",
        "--user=65534:65534",  # init's; commands run as 1000:1000
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--memory=300m --memory-swap=300m --cpus=0.5 --pids-limit=40",
        "--ulimit=nofile=1024:1024 --ulimit=nproc=1024:1024",
        "--volume=pip-cache:/opt/cache/pip:ro --label",
        f"--label={POOL_LABEL}=p1",
    ):
        assert part in joined, part
    networked = ContainerSpec.from_section(section.model_copy(update={"allow_network": True}))
    networked_args = networked.run_args({}, podman=False, seccomp="/profile.json")
    assert not any(a.startswith("--network") for a in networked_args)
    typescript = section.model_copy(update={"profile": "typescript"})
    assert ContainerSpec.from_section(typescript).image == "node:22-slim"


FIX_ADD = {
    "files": {"calc.py": "def add(a, b):\n    return a - b\n", "tests/README": "run me\n"},
    "setup": ["echo prepared > setup.log", "mkdir -p build"],
    "verify": {
        "command": ["python3", "-c", "import calc; assert calc.add(2, 3) == 5"],
        "reward_on_success": 2.5,
    },
    "summary": ["cat", "calc.py"],
    "toolset": "python",
}


def test_a_scenario_runs_through_the_sandbox_environment(cli, tmp_path, monkeypatch):
    """test_sandbox_env.py's local scenario, in a container: the same observations."""
    monkeypatch.setenv("RETRO_CONTAINER_CLI", cli[0])
    section = ContainerEnvironment.model_validate(
        {
            "type": "container",
            "profile": "custom",
            "image": IMAGE,
            "tools": {"default": "base", "scenario_toolsets": ["python"]},
            "limits": {"memory_mb": 256},
            "pool": {"max_live": 2, "reuse": "workspace"},
            "setup_timeout_secs": 60,
            "verify_timeout_secs": 60,
        }
    )
    env = container_environment(section, tmp_path)
    record = {"id": "fix-add", "user": "Fix add.", "metadata": {"env": FIX_ADD}}
    scenario = parse_scenario(record, "scenarios.jsonl:1", 0)
    try:
        episode = env.open(scenario, seed=7)
        try:
            assert episode.step("list_dir", {}).content == (
                "dir  build\nfile calc.py (32 bytes)\nfile setup.log (9 bytes)\ndir  tests"
            )
            assert episode.step("read_file", {"path": "tests/README"}) == Observation("run me\n")
            failing = episode.verify()
            assert failing.reward == 0.0 and not failing.passed
            assert "AssertionError" in failing.output
            edit = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
            assert episode.step("edit_file", edit) == Observation("edited 'calc.py'")
            grep = episode.step("grep", {"pattern": "a + b"})
            assert grep.content.endswith("calc.py:2:    return a + b\n"), grep
            assert episode.step("submit", {}) == Observation("submitted", done=True)
            assert episode.verify() == Verification(2.5, True, "exit code: 0\n")
            assert episode.summary() == "def add(a, b):\n    return a + b"
        finally:
            episode.close()
        again = env.open(scenario, seed=8)  # the same container, its workspace emptied
        try:
            assert not again.verify().passed
        finally:
            again.close()
        assert env.pool.live == 1
    finally:
        env.close()
    assert labelled(cli, f"{POOL_LABEL}={env.pool.id}") == []
