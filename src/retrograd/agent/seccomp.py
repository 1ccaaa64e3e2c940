"""The seccomp profile of every sandbox container: no namespaces, no kernel keyrings, none of
the system calls a process without capabilities has no use for.

`PROFILE` is a profile in the format docker and podman both read (`--security-opt
seccomp=FILE`, the format of Docker's own default); `write_profile(folder)` writes it there and
returns its path. It allows every system call except those it names: namespace creation and
entry (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags sit in memory a filter
cannot read, answers ENOSYS so that glibc falls back to clone), every mount call, and the calls
the engines' own defaults refuse a process without capabilities (modules, kexec, bpf,
perf_event_open, userfaultfd, io_uring, keyctl, AF_VSOCK sockets, NUMA policy, ...).

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
    "stime",
    "vhangup",
    "iopl",
    "ioperm",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "fanotify_init",
    "open_by_handle_at",
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


def _clone_rules() -> list[dict]:
    """clone with any namespace flag fails (s390 takes the flags second, the rest first)."""
    rules = []
    for index, arches in ((0, {"excludes": {"arches": S390}}), (1, {"includes": {"arches": S390}})):
        for flag in CLONE_NAMESPACE_FLAGS:
            arg = {"index": index, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
            deny = {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}
            rules.append({**deny, "args": [arg], **arches})
    return rules


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
