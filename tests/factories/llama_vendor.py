"""llama.cpp's own test data: `vendor/llama.cpp/models` of the llama-cpp-python sdist.

Vocab-only GGUFs (`ggml-vocab-*.gguf`, with `.inp`/`.out` expected tokenizations) and the chat
templates of real models (`templates/`). Downloaded once with pip into .cache/ and extracted;
only the models/ folder is kept. Used by the test fixtures and by benchmarks that need a real
vocabulary; knows nothing about what they do with it.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
CACHE = REPO / ".cache"
LLAMA_CPP_PYTHON = "0.3.36"


def llama_vendor_dir() -> Path:
    """`vendor/llama.cpp/models` of the llama-cpp-python sdist (vocab GGUFs, chat templates).

    Downloaded once with pip and extracted into .cache/; only the models/ folder is kept.
    """
    root = CACHE / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    models = root / "vendor" / "llama.cpp" / "models"
    if (models / ".complete").exists():
        return models
    sdist_dir = CACHE / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(sdist_dir),
            ],
            check=True,
        )
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/models/"
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.name.startswith(prefix) and member.isfile():
                member.name = "vendor/llama.cpp/models/" + member.name[len(prefix) :]
                tar.extract(member, root, filter="data")
    (models / ".complete").touch()
    return models
