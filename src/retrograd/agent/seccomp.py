"""The seccomp profile of every sandbox container: no namespaces, no kernel keyrings, none of
the system calls a process without capabilities has no use for.

`PROFILE` is a profile in the format docker and podman both read (`--security-opt
seccomp=FILE`, the format of Docker's own default); `write_profile(folder)` writes it there and
returns its path. It allows every system call except those it names: namespace creation and
entry (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags sit in memory a filter
cannot read, answers ENOSYS so that glibc falls back to clone), every mount call, and the calls
the engines' own defaults refuse a process without capabilities (modules, kexec, bpf,
perf_event_open, userfaultfd, io_uring, keyctl, AF_VSOCK sockets, NUMA policy, the clock,
file handles, ...), and personality with any persona but the five Docker's default allows.

NOTE: a deny list, not the engines' allow list, so that a profile of ours works with any
engine and libc; the list holds because nothing else can reach a privilege: a container
runs without capabilities and with no-new-privileges, and with no user namespace there is
no capability to gain anywhere (what the engines' allow lists add beyond this list is
denial of calls the kernel refuses without a capability anyway). Knows nothing of how a
container starts (agent/container.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

EPERM, ENOSYS = 1, 38
# clone(2)'s namespace flags: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
# (CLONE_NEWTIME, 0x80, is reachable through unshare and clone3 alone: in clone's flags it is
# part of the exit signal).
CLONE_NAMESPACE_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
AF_VSOCK = 40  # not namespaced: it reaches the hypervisor's host, whatever --network says
DENIED = (
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "pivot_root",
    "chroot",
    # the kernel's keyrings, shared by every process of a uid on the host
    "add_key",
    "keyctl",
    "request_key",
    # kernel attack surface that needs no capability
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # other processes, the machine and its clock
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    "acct",
    "reboot",
    "syslog",
    "swapon",
    "swapoff",
    "sethostname",
    "setdomainname",
    "settimeofday",
    "clock_settime",
    "clock_settime64",
    "clock_adjtime",
    "clock_adjtime64",
    "adjtimex",
    "stime",
    "vhangup",
    "iopl",
    "ioperm",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "fanotify_init",
    "name_to_handle_at",
    "open_by_handle_at",
    # the LSM attributes of a process (its AppArmor or SELinux label)
    "lsm_get_self_attr",
    "lsm_set_self_attr",
    "lsm_list_modules",
    "mbind",
    "set_mempolicy",
    "set_mempolicy_home_node",
    "get_mempolicy",
    "migrate_pages",
    "move_pages",
    # modules and kexec
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "query_module",
    "get_kernel_syms",
    "kexec_load",
    "kexec_file_load",
    # obsolete
    "_sysctl",
    "sysfs",
    "ustat",
    "uselib",
    "nfsservctl",
    "vm86",
    "vm86old",
)
# Each machine with the older modes its processes can call in (an x86-64 process can make
# i386 calls through int 0x80): a filter must cover them all, or the old mode bypasses it.
ARCH_MAP = (
    ("SCMP_ARCH_X86_64", ("SCMP_ARCH_X86", "SCMP_ARCH_X32")),
    ("SCMP_ARCH_AARCH64", ("SCMP_ARCH_ARM",)),
    ("SCMP_ARCH_PPC64LE", ()),
    ("SCMP_ARCH_S390X", ("SCMP_ARCH_S390",)),
    ("SCMP_ARCH_RISCV64", ()),
)
S390 = ["s390", "s390x"]
# personality(2)'s values Docker's default allows: PER_LINUX, PER_LINUX32, UNAME26, the last
# two together, and 0xffffffff (a query). Every other persona is refused: ADDR_NO_RANDOMIZE
# (`setarch -R`) turns address randomisation off, READ_IMPLIES_EXEC makes data executable.
PERSONA_BITS = 0x00020008  # the bits the allowed values set
PERSONA_QUERY = 0xFFFFFFFF


def _clone_rules() -> list[dict]:
    """clone with any namespace flag fails (s390 takes the flags second, the rest first)."""
    rules = []
    for index, arches in ((0, {"excludes": {"arches": S390}}), (1, {"includes": {"arches": S390}})):
        for flag in CLONE_NAMESPACE_FLAGS:
            arg = {"index": index, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
            deny = {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
            rules.append({**deny, "args": [arg], **arches})
    return rules


def _personality_rules() -> list[dict]:
    """personality fails unless its persona is one of Docker's values.

    A filter compares one argument once per rule and rules add up (any match denies), so
    "not one of five values" is written as masked comparisons of the low 32 bits (the
    kernel reads no more): a persona is refused when it sets a bit outside PERSONA_BITS and
    is not the query. Either some such bit is set and the next one (round the 30 of them) is
    clear, or all 30 are set and one of PERSONA_BITS' two is clear.
    """
    others = [bit for bit in range(32) if not PERSONA_BITS >> bit & 1]
    masked = [
        (1 << a | 1 << b, 1 << a) for a, b in zip(others, others[1:] + others[:1], strict=True)
    ]
    all_others = PERSONA_QUERY & ~PERSONA_BITS
    masked += [(all_others | bit, all_others) for bit in (0x8, 0x20000)]
    arg = {"index": 0, "op": "SCMP_CMP_MASKED_EQ"}
    deny = {"names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
    return [{**deny, "args": [{**arg, "value": m, "valueTwo": v}]} for m, v in masked]


def profile() -> dict:
    """The profile, as the engines read it."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "archMap": [
            {"architecture": arch, "subArchitectures": list(subs)} for arch, subs in ARCH_MAP
        ],
        "syscalls": [
            {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
            *_clone_rules(),
            *_personality_rules(),
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_EQ"}],
            },
        ],
    }


def write_profile(folder: str | Path) -> str:
    """Write the profile into `folder` (through a temporary name) and return its path."""
    path = os.path.join(folder, "seccomp.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        json.dump(profile(), out, indent=1)
    os.replace(tmp, path)
    return path
