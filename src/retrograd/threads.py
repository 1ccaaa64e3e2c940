"""CPU threads and OpenMP's wait policy: how many threads a process computes with, and what its
threads do while they wait for each other. The one place both are chosen (docs/performance.md,
"Beside a neighbour").

PyTorch's CPU kernels (its own, oneDNN's, MKL's) share one OpenMP pool, GNU libgomp in the pip
wheels. At the end of every parallel region the threads that finish first wait for the others,
and by default libgomp spins for them (GOMP_SPINCOUNT 300,000, about 3 ms) before sleeping. On
an idle machine that saves a wake-up; beside another busy process it burns the very cores the
late thread needs, and a run loses several times the share of the machine it lost. PASSIVE
waiters sleep at once, so a run beside a neighbour slows in proportion to the cores it lost.

libgomp reads the policy once, when it is loaded (`import torch`): `apply_wait_policy` runs
when the `retrograd` package is imported (before anything of ours imports torch), and what it
sets is inherited by every child process (the server's runs, torchrun's ranks, reward programs).
A program that imported torch before retrograd keeps the policy its environment gave it.

Knows OpenMP's environment variables (OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_NUM_THREADS; RETRO_THREADS
is read through retrograd/environ.py) and the CPUs this process may use; nothing about torch (model/device.py
applies the thread count).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from retrograd.errors import ConfigError

WAIT_POLICY = "PASSIVE"
# Either one set by the user is their choice of wait policy, and ours is not applied.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
THREADS_VARIABLE = "RETRO_THREADS"


def wait_policy_environment(environ=os.environ) -> dict[str, str]:
    """The variables to add to `environ` for our wait policy: none where the user chose one."""
    if any(environ.get(name, "").strip() for name in WAIT_VARIABLES):
        return {}
    return {"OMP_WAIT_POLICY": WAIT_POLICY}


def apply_wait_policy() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE in this process's environment unless the user chose a
    policy. Effective only before torch is first imported in the process."""
    os.environ.update(wait_policy_environment())


def wait_policy() -> str:
    """The policy this process's environment gives OpenMP, for reports."""
    chosen = [f"{n}={os.environ[n]}" for n in WAIT_VARIABLES if os.environ.get(n, "").strip()]
    return ", ".join(chosen) or "libgomp's default (spin about 3 ms, then sleep)"


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, bounded by a cgroup CPU quota
    (a container given 2 CPUs of a 64-core host gets 2, not 64)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup allows (cgroup v2 cpu.max, else v1's CFS quota); None
    when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def choose_threads(threads: int | None = None) -> int | None:
    """The intra-op thread count asked for: RETRO_THREADS, else `threads` ([training].threads,
    the Python API's argument); None when neither is given (see `default_threads`)."""
    # NOTE: imported here: `import retrograd` loads this module, and `python -m
    # retrograd.environ` (the docs table) wants environ not yet imported
    from retrograd import environ

    return asked_threads(environ.get(THREADS_VARIABLE), threads)


def asked_threads(env: int | None, threads: int | None) -> int | None:
    """`env` (RETRO_THREADS, parsed), else `threads` (at least 1), else None."""
    if env is not None:
        return env
    if threads is not None and threads < 1:
        raise ConfigError(f"[training].threads = {threads}: must be at least 1")
    return threads


def default_threads(current: int) -> int:
    """The count when none is asked for, from PyTorch's `current` one (OpenMP's: every CPU of
    the affinity mask, or OMP_NUM_THREADS; a program may have set its own): bounded by the
    usable CPUs, unless OMP_NUM_THREADS chose it (torchrun sets 1 for each rank)."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return current
    return min(current, usable_cpus())
