"""Importing retrograd: huge pages for PyTorch's large CPU buffers, unless the user says no."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = "import os, retrograd; print(os.environ['THP_MEM_ALLOC_ENABLE'])"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_turns_huge_pages_on_and_leaves_a_users_choice():
    assert _run(None) == "1"
    assert _run("0") == "0"


def test_import_loads_no_torch():
    """The setting only works before torch's first allocation: the package must not load it."""
    code = "import sys, retrograd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
