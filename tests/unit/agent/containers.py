"""Fixtures of the container tests: real podman and the locally built test image.

scripts/agent-image.sh (run by `make test`) installs podman and builds
localhost/retrograd-agent:bookworm; it writes .cache/containers/containers.conf (runc,
cgroupfs, explicit ulimits), which these fixtures hand to podman through CONTAINERS_CONF
unless the environment already names one. Nothing skips: without podman or the image every
test that uses them fails, saying to run the script.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from retrograd.agent.container import ContainerPool, ContainerSandbox, ContainerSpec
from retrograd.config.agent import ContainerPool as PoolSettings

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / ".cache" / "containers" / "containers.conf"
IMAGE = "localhost/retrograd-agent:bookworm"
SETUP = "run scripts/agent-image.sh (as root; `make test` runs it) to install podman and build"


@pytest.fixture(scope="module")
def cli():
    with pytest.MonkeyPatch.context() as mp:
        if "CONTAINERS_CONF" not in os.environ:
            if not CONF.exists():
                pytest.fail(f"{CONF.relative_to(REPO)} is missing: {SETUP} {IMAGE}")
            mp.setenv("CONTAINERS_CONF", str(CONF))
        podman = shutil.which("podman")
        if podman is None:
            pytest.fail(f"podman is not installed: {SETUP} {IMAGE}")
        exists = subprocess.run([podman, "image", "exists", IMAGE], capture_output=True)
        if exists.returncode != 0:
            pytest.fail(f"image {IMAGE} is missing: {SETUP} it")
        yield [podman]


def spec(**keys) -> ContainerSpec:
    return ContainerSpec(**{"image": IMAGE, "memory_mb": 256, "pids": 64, **keys})


@pytest.fixture
def pool(cli):
    made: list[ContainerPool] = []

    def make(settings: PoolSettings | None = None, **keys) -> ContainerPool:
        made.append(ContainerPool(spec(**keys), settings, cli=cli))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def box(pool) -> ContainerSandbox:
    return pool().acquire()


def labelled(cli, label: str) -> list[str]:
    done = subprocess.run(
        [*cli, "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def exists(cli, cid: str) -> bool:
    return subprocess.run([*cli, "container", "exists", cid]).returncode == 0


def text(result) -> str:
    return result.stdout.decode()
