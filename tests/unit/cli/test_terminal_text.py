"""What reaches the user's terminal from text we do not control (a policy's answer, a tool's
output, a program's stderr, a file name): control characters are shown as escapes, never sent
for the terminal to act on (clear the screen, set the title, move the cursor)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from retrograd.cli.main import main
from retrograd.observe.log import configure_logging
from retrograd.text import printable

HOSTILE = "a\x1b[2J\x1b]0;owned\x07\x9b31m\rb\x00\x7f"
SHOWN = "a\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\rb\\x00\\x7f"


def test_printable_shows_controls_and_keeps_text():
    assert printable(HOSTILE) == SHOWN
    kept = "tab\tnew\nline é ✓ \u2028 [sft].data"
    assert printable(kept) == kept  # tabs, newlines and every printable character stay


def test_an_error_quoting_hostile_text_is_printed_escaped(tmp_path, capsys):
    name = HOSTILE.replace("\x00", "")  # argv cannot carry a NUL
    missing = tmp_path / f"{name}.toml"
    assert main(["train", str(missing)]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and SHOWN.replace("\\x00", "") in err
    assert "\x1b" not in err and "\x9b" not in err and "\x07" not in err


@pytest.fixture
def verbose():
    configure_logging(True)
    yield
    configure_logging(False)


def test_a_log_line_quoting_hostile_text_is_written_escaped(verbose, capsys):
    logging.getLogger("retrograd.agent.rollout").warning("tool failed: %s", HOSTILE)
    err = capsys.readouterr().err
    assert "agent.rollout: tool failed: " + SHOWN in err and "\x1b" not in err


def test_a_warning_without_verbose_is_written_escaped():
    """Not verbose, a warning goes through logging's last resort: a tool name the policy made
    up, or its traceback, is shown escaped there too (a process of its own: pytest installs a
    handler, so the last resort never runs here)."""
    code = (
        "import logging; from retrograd.observe.log import configure_logging\n"
        "configure_logging(False)\n"
        f"try:\n    raise ValueError({HOSTILE!r})\n"
        "except ValueError:\n"
        f"    logging.getLogger('retrograd.agent.rollout').warning('tool %s raised', {HOSTILE!r}, exc_info=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(SHOWN) == 2, done.stderr
    assert "\x1b" not in done.stderr and "\x9b" not in done.stderr
