"""retrograd/threads.py: OpenMP's wait policy and the thread count, chosen in one place.

The policy's effect is measured, not assumed: a process that imports retrograd and then torch
runs short parallel regions with pauses between them, and its OpenMP workers must not burn CPU
through the pauses (libgomp's default spins about 3 ms after each region, which beside a busy
neighbour takes the core the next region needs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.errors import ConfigError
from retrograd.threads import (
    cgroup_cpu_quota,
    choose_threads,
    default_threads,
    usable_cpus,
    wait_policy_environment,
)

# Two threads, 100 regions of an elementwise op big enough to be split, 5 ms pauses between:
# spinning workers spend about 0.3 s of CPU in the pauses, sleeping ones about none.
PROBE = """
import time
import retrograd
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
for _ in range(20):
    x.add_(1)
process, main = time.process_time(), time.thread_time()
for _ in range(100):
    x.add_(1)
    time.sleep(0.005)
print((time.process_time() - process) - (time.thread_time() - main))
"""


def workers_cpu_seconds(**env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(out.stdout)


def test_importing_retrograd_first_makes_openmp_workers_sleep():
    assert workers_cpu_seconds() < 0.1


def test_the_users_wait_policy_wins(monkeypatch):
    assert wait_policy_environment({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert wait_policy_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert wait_policy_environment({"GOMP_SPINCOUNT": "10000"}) == {}
    assert wait_policy_environment({"OMP_WAIT_POLICY": " "}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    # in a fresh process, the user's choice reaches OpenMP untouched
    code = "import os, retrograd; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {"OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "ACTIVE"


def test_thread_count_precedence(monkeypatch):
    for name in ("RETRO_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert choose_threads() is None  # nothing asked: default_threads decides
    assert choose_threads(3) == 3
    monkeypatch.setenv("RETRO_THREADS", "5")
    assert choose_threads(2) == 5
    monkeypatch.setenv("RETRO_THREADS", "many")
    with pytest.raises(ConfigError, match="RETRO_THREADS='many'"):
        choose_threads()
    monkeypatch.setenv("RETRO_THREADS", "0")
    with pytest.raises(ConfigError, match="RETRO_THREADS=0: must be at least 1"):
        choose_threads()
    monkeypatch.delenv("RETRO_THREADS")
    with pytest.raises(ConfigError, match=r"\[training\].threads = 0"):
        choose_threads(0)


def test_the_default_keeps_torchs_count_within_the_usable_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("retrograd.threads.usable_cpus", lambda: 2)
    assert default_threads(64) == 2  # OpenMP counted a host's CPUs; the quota allows 2
    assert default_threads(1) == 1  # a program's own lower count stays
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # chosen by hand (or torchrun's 1): kept
    assert default_threads(8) == 8


def test_a_cgroup_quota_bounds_the_cpus(tmp_path: Path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(v1) is None
    assert cgroup_cpu_quota(tmp_path / "none") is None
    # a container allowed 1.5 CPUs of a larger machine computes with 2 threads, not all
    monkeypatch.setattr("retrograd.threads.cgroup_cpu_quota", lambda: 1.5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cpus() == 2
