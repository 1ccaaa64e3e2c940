"""What a hostile command cannot do in a sandbox container, against real podman and the test
image: fill the host's disk, become root, make a namespace, outlive its call, or leave
anything for the next trajectory of a reused container. Each attack is run as a policy would
run it (through ContainerSandbox.exec); the image holds traps (scripts/agent-image.sh) that
give root wherever setuid is honoured, and a control shows that they do.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import textwrap
import time

import pytest

from retrograd.agent.container import INIT_USER, ContainerPool, ContainerSpec
from retrograd.agent.container_scripts import WORKDIR
from retrograd.agent.seccomp import DENIED, profile
from retrograd.config.agent import ContainerPool as PoolSettings
from retrograd.errors import ConfigError, EnvironmentFailure
from tests.unit.agent import containers
from tests.unit.agent.containers import IMAGE, exists, spec, text

pytestmark = pytest.mark.slow

cli, pool, box = containers.cli, containers.pool, containers.box
RUNNER = "runner"  # uid 1000 in the test image
INIT = "nobody"  # uid 65534, the containers' init


def inspect(cli, cid: str, fmt: str) -> str:
    done = subprocess.run([*cli, "inspect", "--format", fmt, cid], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def disk_bytes(*folders: str) -> int:
    """What files under these folders take on disk."""
    total = 0
    for folder in folders:
        for top, _, names in os.walk(folder):
            for name in names:
                try:
                    total += os.lstat(os.path.join(top, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def processes(box) -> list[tuple[str, str]]:
    """(user, args) of every process in the container but those of this listing's own call
    (its wrapper, timeout and ps)."""
    listing = text(box.exec(["ps", "-eo", "user=,args="]))
    rows = [tuple(line.split(None, 1)) for line in listing.splitlines()]
    own = [r for r in rows if r[1].startswith(("ps -eo", "timeout --foreground"))]
    own += [r for r in rows if r[1].startswith("sh -c") and "timeout --foreground" in r[1]]
    assert len(own) == 3, rows
    return [r for r in rows if r not in own]


def only_init_left(box) -> None:
    left = processes(box)
    assert left and all(user == INIT for user, _ in left), left


# -- the host's disk -----------------------------------------------------------------------


def test_nothing_a_command_writes_reaches_the_hosts_disk(cli, box):
    """pid 1's stdout and stderr, and the command's own, written 16 MiB each: the engine
    keeps no log of them, and what the container's folders on the host take does not grow."""
    assert inspect(cli, box.id, "{{.HostConfig.LogConfig.Type}}") == "none"
    folders = [
        inspect(cli, box.id, "{{.StaticDir}}"),
        os.path.dirname(inspect(cli, box.id, "{{.ConmonPidFile}}")),
    ]
    before = disk_bytes(*folders)
    to_init = "for f in /proc/1/fd/1 /proc/1/fd/2; do head -c 16M /dev/zero > $f; done"
    result = box.exec(["sh", "-c", to_init], timeout=60)
    assert result.stderr.count(b"Permission denied") == 2, result  # pid 1 is not the runner's
    own = box.exec(["sh", "-c", "head -c 16M /dev/zero; head -c 16M /dev/zero >&2"], timeout=60)
    assert own.truncated and len(own.stdout) + len(own.stderr) == 65536
    assert disk_bytes(*folders) - before < 1 << 20


def test_both_engines_start_a_container_hardened_the_same_way(tmp_path):
    profile_path = str(tmp_path / "seccomp.json")
    for podman in (False, True):
        args = spec().run_args({}, podman=podman, seccomp=profile_path)
        for part in (
            "--log-driver=none",
            f"--security-opt=seccomp={profile_path}",
            "--security-opt=no-new-privileges",
            "--cap-drop=ALL",
            f"--user={INIT_USER}",
            "--ipc=private",
            "--read-only",
            "--network=none",
        ):
            assert part in args, (podman, part)
        assert ("--read-only-tmpfs=false" in args) == podman  # podman's own /tmp, /run
        # pid 1 writes nothing anywhere: stdin, stdout and stderr are /dev/null
        assert args[-1].endswith("</dev/null >/dev/null 2>&1"), args[-1]
    with pytest.raises(ConfigError, match="init"):
        ContainerSpec(image=IMAGE, user=INIT_USER).check()


# -- root and namespaces -------------------------------------------------------------------

TRAPS = "suid-id -u; sudo -n id -u; su -c 'id -u' root </dev/null"


def test_the_images_traps_give_root_where_setuid_is_honoured(cli):
    """The control: without the sandbox's settings each trap of the test image makes uid
    1000 root, so their failing in a sandbox is the sandbox's doing."""
    done = subprocess.run(
        [*cli, "run", "--rm", "--network=none", "--user=1000:1000", IMAGE, "sh", "-c", TRAPS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.split() == ["0", "0", "0"], done


ATTEMPTS = [
    ["suid-id", "-u"],  # a setuid-root binary
    ["sudo", "-n", "id", "-u"],
    ["sh", "-c", "su -c 'id -u' root </dev/null"],
    ["unshare", "-r", "id", "-u"],  # a user namespace, and root in it
    ["unshare", "-U", "true"],
    ["unshare", "-m", "true"],
    ["unshare", "-n", "true"],
    ["unshare", "-i", "true"],
    ["unshare", "-u", "true"],
    ["unshare", "-p", "-f", "true"],
    ["unshare", "-C", "true"],
    ["unshare", "-T", "true"],
    ["nsenter", "--net=/proc/self/ns/net", "true"],
    ["nsenter", "-t", "1", "-m", "true"],
    ["sh", "-c", "mkdir -p m && mount -t tmpfs none m"],
    ["mount", "--bind", "/work", "/work"],
    ["chroot", "/", "true"],
]

# The system calls themselves, as a program would make them (numbers of x86-64 and aarch64).
SYSCALLS = textwrap.dedent(
    """
    import ctypes, mmap, os, platform, threading
    libc = ctypes.CDLL(None, use_errno=True)
    NR = {"x86_64": {"clone": 56, "clone3": 435, "add_key": 248, "keyctl": 250,
                     "setns": 308, "unshare": 272},
          "aarch64": {"clone": 220, "clone3": 435, "add_key": 217, "keyctl": 219,
                      "setns": 268, "unshare": 97}}[platform.machine()]
    def call(name, *args):
        ret = libc.syscall(NR[name], *args)
        if ret == 0 and name == "clone":
            os._exit(0)  # the clone succeeded: this is the child
        return "ok" if ret >= 0 else os.strerror(ctypes.get_errno())
    CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17
    print("unshare", call("unshare", CLONE_NEWUSER))
    print("clone", call("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0))
    print("clone-ns", call("clone", CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0))
    print("clone3", call("clone3", 0, 0))
    print("setns", call("setns", os.open("/proc/self/ns/user", os.O_RDONLY), 0))
    print("add_key", call("add_key", b"user", b"k", b"v", 1, -3))  # the session keyring
    print("keyctl", call("keyctl", 0, -3, 0))  # KEYCTL_GET_KEYRING_ID
    if platform.machine() == "x86_64":  # i386's unshare through int 0x80, same flag
        code = bytes.fromhex("b836010000" "bb00000010" "cd80" "4898" "c3")
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=7)
        page.write(code)
        fn = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
        print("int80-unshare", "ok" if fn() == 0 else "refused")
    else:
        print("int80-unshare refused")
    # what must keep working: threads (glibc's pthread_create tries clone3 first) and fork
    t = threading.Thread(target=lambda: None)
    t.start(); t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    print("thread+fork", os.waitpid(pid, 0)[1] >> 8)
    """
)


def test_no_way_to_root_a_namespace_or_a_mount(box):
    assert platform.machine() in ("x86_64", "aarch64"), "SYSCALLS knows their numbers alone"
    for argv in ATTEMPTS:
        result = box.exec(argv)
        assert result.exit_code != 0 or result.stdout == b"1000\n", (argv, result)
        assert b"\n0\n" not in b"\n" + result.stdout, (argv, result)
    result = box.exec(["python3", "-c", SYSCALLS])
    assert result.ok, result
    assert dict(line.split(" ", 1) for line in text(result).splitlines()) == {
        "unshare": "Operation not permitted",
        "clone": "Operation not permitted",
        "clone-ns": "Operation not permitted",
        "clone3": "Function not implemented",  # so that glibc falls back to clone
        "setns": "Operation not permitted",
        "add_key": "Operation not permitted",
        "keyctl": "Operation not permitted",
        "int80-unshare": "refused",
        "thread+fork": "7",
    }


def test_the_profile_denies_namespaces_in_every_form():
    written = profile()
    assert written["defaultAction"] == "SCMP_ACT_ALLOW"
    assert {"unshare", "setns", "mount", "keyctl", "bpf", "io_uring_setup"} <= set(DENIED)
    rules = written["syscalls"]
    assert {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38} in rules
    clone = [r for r in rules if r["names"] == ["clone"]]
    flags = {r["args"][0]["value"] for r in clone}
    assert sum(flags) == 0x7E020000 and len(clone) == 14  # seven flags, s390's order too
    json.dumps(written)  # what the engines read


# -- processes ------------------------------------------------------------------------------

OUTLIVERS = [
    # the wrapper's old mark, removed; a new session
    "env -u RETROGRAD_EXEC setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &",
    "(setsid sh -c 'sleep 301 & sleep 302' >/dev/null 2>&1 &)",  # a double fork
    "nohup sleep 303 >/dev/null 2>&1 &",
    "sh -c 'trap \"\" TERM HUP INT QUIT; sleep 304' >/dev/null 2>&1 &",
    "python3 -c 'import os, signal, time\nfor s in (1, 2, 3, 15): signal.signal(s, signal.SIG_IGN)"
    "\nif os.fork() == 0: os.setsid(); time.sleep(305)' &",
    # a process that kills the call's own processes first: the wrapper with them
    "setsid sh -c 'kill -9 -1; sleep 306' >/dev/null 2>&1 & sleep 1",
]


def test_nothing_but_init_outlives_a_call(box):
    for command in OUTLIVERS:
        box.exec(["sh", "-c", command], timeout=5)
        only_init_left(box)


def test_a_fork_bomb_leaves_nothing(pool):
    sandbox = pool(pids=48).acquire()
    for _ in range(3):  # it used to survive now and then
        sandbox.exec(["sh", "-c", "b() { b | b & }; b; sleep 2"], timeout=3)
        only_init_left(sandbox)
    assert sandbox.exec(["echo", "still here"]).stdout == b"still here\n"


def test_init_is_out_of_reach(box):
    """pid 1 belongs to another uid: no signal, no ptrace, no write to its output."""
    for argv in (
        ["kill", "-STOP", "1"],
        ["kill", "-9", "1"],
        ["sh", "-c", "echo x > /proc/1/fd/1"],
    ):
        assert box.exec(argv).exit_code not in (0, None), argv
    attach = "import ctypes; c = ctypes.CDLL(None, use_errno=True); print(c.ptrace(16, 1, 0, 0))"
    assert text(box.exec(["python3", "-c", attach])) == "-1\n"  # PTRACE_ATTACH
    status = text(box.exec(["cat", "/proc/1/status"]))
    assert "\nState:\tS" in status and "\nTracerPid:\t0\n" in status, status


# -- reuse = "workspace" ----------------------------------------------------------------------

LEAVE = textwrap.dedent(
    """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    IPC_CREAT = 0o1000
    assert libc.shmget(0x5EED, 4096, IPC_CREAT | 0o666) >= 0
    assert libc.msgget(0x5EED, IPC_CREAT | 0o666) >= 0
    assert libc.semget(0x5EED, 1, IPC_CREAT | 0o666) >= 0
    open("/dev/shm/left", "w").write("x")
    open("/dev/mqueue/left", "w").close()  # a message queue
    """
)
FOUND = textwrap.dedent(
    """
    import glob, os
    for name in ("shm", "msg", "sem"):
        rows = open(f"/proc/sysvipc/{name}").read().splitlines()[1:]
        print(name, len(rows))
    work = WORKDIR  # the container's workspace
    print("files", sorted(glob.glob("/dev/shm/*") + glob.glob("/dev/mqueue/*")
                          + glob.glob(work + "/*") + glob.glob(work + "/.*")))
    """
).replace("WORKDIR", repr(WORKDIR))


def test_reuse_workspace_leaves_nothing_for_the_next_lease(pool):
    p = pool(PoolSettings(reuse="workspace", max_leases_per_container=3))
    first = p.acquire()
    assert first.exec(["python3", "-c", LEAVE]).ok
    assert first.exec(["sh", "-c", "echo x > kept && sleep 400 > /dev/null 2>&1 &"]).ok
    assert first.exec(["kill", "-STOP", "1"]).exit_code != 0
    p.release(first)
    second = p.acquire()
    assert second is first
    assert text(second.exec(["python3", "-c", FOUND])) == "shm 0\nmsg 0\nsem 0\nfiles []\n"
    only_init_left(second)


def test_a_sick_container_is_replaced_before_its_next_lease(cli, pool):
    p = pool(PoolSettings(reuse="workspace", max_leases_per_container=5))
    first = p.acquire()
    p.release(first)
    # init stopped (from outside: nothing inside can reach it): orphans would never be reaped
    subprocess.run([*cli, "kill", "--signal", "STOP", first.id], check=True, capture_output=True)
    second = p.acquire()
    assert second is not first and not exists(cli, first.id)
    assert second.exec(["echo", "fresh"]).stdout == b"fresh\n"
    p.release(second)
    # gone while idle (the engine restarted, someone removed it): replaced, not a failure
    subprocess.run([*cli, "rm", "-f", second.id], check=True, capture_output=True)
    third = p.acquire()
    assert third is not second and third.exec(["true"]).ok
    assert p.live == 1
    # one started ahead (min_idle) and gone before its first lease: replaced too
    ahead = pool(PoolSettings(min_idle=1))
    (idle,) = ahead._idle
    subprocess.run([*cli, "rm", "-f", idle.id], check=True, capture_output=True)
    fresh = ahead.acquire()
    assert fresh is not idle and fresh.exec(["true"]).ok


def test_a_fork_bomb_does_not_reach_the_next_lease(pool):
    p = pool(PoolSettings(reuse="workspace"), pids=48)
    first = p.acquire()
    first.exec(["sh", "-c", "b() { b | b & }; b"], timeout=2)
    p.release(first)
    started = time.monotonic()
    second = p.acquire()
    assert second is first and time.monotonic() - started < 30
    only_init_left(second)


# -- what is writable -------------------------------------------------------------------------


def test_only_work_dev_shm_and_dev_mqueue_are_writable(box):
    """Every directory and regular file the runner could write, over the whole tree."""
    found = box.exec(
        [
            "find",
            "/",
            "(",
            "-path",
            "/proc",
            "-o",
            "-path",
            "/sys",
            ")",
            "-prune",
            "-o",
            "(",
            "-type",
            "d",
            "-o",
            "-type",
            "f",
            ")",
            "-writable",
            "-print",
        ],
        timeout=60,
    )
    assert sorted(text(found).split()) == ["/dev/mqueue", "/dev/shm", "/work"], found


def test_an_engine_that_leaves_more_writable_is_refused(cli, monkeypatch):
    """Where the engine adds writable places (podman's service behind a docker CLI mounts
    /tmp, /var/tmp and /run for --read-only), a reset would not empty them: the pool's first
    container refuses it, naming them."""
    run_args = ContainerSpec.run_args

    def with_tmp(self, labels, **keys):
        args = run_args(self, labels, **keys)
        return [*args[:2], "--tmpfs=/tmp:rw,mode=1777", *args[2:]]

    monkeypatch.setattr(ContainerSpec, "run_args", with_tmp)
    made = ContainerPool(spec(), cli=cli)
    try:
        with pytest.raises(EnvironmentFailure, match=r"can write to /tmp besides"):
            made.acquire()
        assert made.live == 0
    finally:
        made.close()


# -- personality, the clock and file handles ------------------------------------------------

# personality(2) values Docker's default allows: PER_LINUX, PER_LINUX32, UNAME26, both, query
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
ODD_CALLS = textwrap.dedent(
    """
    import ctypes, os, platform
    libc = ctypes.CDLL(None, use_errno=True)
    NR = {"x86_64": {"personality": 135, "adjtimex": 159, "clock_adjtime": 305,
                     "name_to_handle_at": 303},
          "aarch64": {"personality": 92, "adjtimex": 171, "clock_adjtime": 266,
                      "name_to_handle_at": 264}}[platform.machine()]
    def call(name, *args):
        ret = libc.syscall(NR[name], *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        return "ok" if ret >= 0 else os.strerror(ctypes.get_errno())
    for value in (0x40000, 0x1_0004_0000, 0x0400000, 0x8 | 0x40000, 0xFFFFFFFE):
        print(hex(value), call("personality", value))
    for value in (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF):
        print(hex(value), call("personality", value))
    timex = ctypes.create_string_buffer(512)  # modes 0: a read, no capability needed
    print("adjtimex", call("adjtimex", timex))
    print("clock_adjtime", call("clock_adjtime", 0, timex))
    handle = ctypes.create_string_buffer(256)
    handle[0] = 128  # handle_bytes
    mount_id = ctypes.c_int()
    print("name_to_handle_at", call("name_to_handle_at", -100, b"/work", handle,
                                    ctypes.byref(mount_id), 0))
    """
)


def test_personality_is_docker_s_and_the_clock_and_file_handles_are_closed(box):
    """No ADDR_NO_RANDOMIZE (`setarch -R`), READ_IMPLIES_EXEC or any other persona but
    Docker's; a value's upper 32 bits (which the kernel drops) do not sneak one past."""
    assert platform.machine() in ("x86_64", "aarch64"), "ODD_CALLS knows their numbers alone"
    refused = box.exec(["setarch", "-R", "true"])
    assert refused.exit_code != 0 and b"Operation not permitted" in refused.stderr, refused
    for argv in (["setarch", "linux32", "true"], ["setarch", "--uname-2.6", "true"]):
        assert box.exec(argv).ok, argv
    assert text(box.exec(["echo", "still runs"])) == "still runs\n"
    result = box.exec(["python3", "-c", ODD_CALLS])
    assert result.ok, result
    denied = "Operation not permitted"
    assert dict(line.split(" ", 1) for line in text(result).splitlines()) == {
        "0x40000": denied,
        "0x100040000": denied,
        "0x400000": denied,
        "0x40008": denied,
        "0xfffffffe": denied,
        **{hex(value): "ok" for value in PERSONALITIES},
        "adjtimex": denied,
        "clock_adjtime": denied,
        "name_to_handle_at": denied,
    }


def _personality_denied(rules: list[dict], value: int) -> bool:
    """Whether a deny rule of the profile matches personality(value) (MASKED_EQ: `value` is
    the mask, `valueTwo` what the masked argument must equal)."""
    for rule in rules:
        if "personality" not in rule["names"]:
            continue
        if not rule.get("args"):
            return True
        (arg,) = rule["args"]
        assert arg["index"] == 0 and arg["op"] == "SCMP_CMP_MASKED_EQ", rule
        if value & arg["value"] == arg["valueTwo"]:
            return True
    return False


def test_the_profile_allows_docker_s_personalities_alone():
    rules = [r for r in profile()["syscalls"] if r["action"] == "SCMP_ACT_ERRNO"]
    assert {"clock_adjtime", "adjtimex", "name_to_handle_at", "open_by_handle_at"} <= set(DENIED)
    for value in PERSONALITIES:
        assert not _personality_denied(rules, value), hex(value)
    odd = {1 << bit for bit in range(32)} | {0xFFFFFFFF ^ (1 << bit) for bit in range(32)}
    odd |= {0x40000, 0x0400000, 0x40008, 0x20008 | 0x40000, 0xFFFF, 0xFFFF0000, 0xFFFDFFF7}
    odd |= {value | (1 << 32) for value in PERSONALITIES if value != 0xFFFFFFFF} - {1 << 32}
    rng = __import__("random").Random(0)
    odd |= {rng.getrandbits(32) for _ in range(20_000)}
    for value in odd - set(PERSONALITIES):
        if value >> 32 and value & 0xFFFFFFFF in PERSONALITIES:
            continue  # the kernel reads 32 bits: an allowed value with high bits set is it
        assert _personality_denied(rules, value), hex(value)
