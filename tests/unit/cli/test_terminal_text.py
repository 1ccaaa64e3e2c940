"""What reaches the user's terminal from text we do not control (a policy's answer, a tool's
output, a program's stderr, a file name): control characters are shown as escapes, never sent
for the terminal to act on (clear the screen, set the title, move the cursor)."""

from __future__ import annotations

import logging

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
