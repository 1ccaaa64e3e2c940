"""Fixtures writing small reward programs into tmp_path (see reward_programs.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# reward_programs.py, the program writer beside these tests, imports as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

from reward_programs import ONESHOT, PERSISTENT, writer  # noqa: E402


@pytest.fixture
def persistent(tmp_path: Path) -> Callable[..., list[str]]:
    return writer(tmp_path, PERSISTENT)


@pytest.fixture
def oneshot(tmp_path: Path) -> Callable[..., list[str]]:
    return writer(tmp_path, ONESHOT)
