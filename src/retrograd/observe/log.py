"""The `retrograd` logger: what [run].verbose = true adds on stderr.

Modules log through `logging.getLogger(__name__)` (every name under `retrograd.`) and never set
logging up themselves. `configure_logging(verbose)` is the one function that does, and nothing
happens at import: `load_run` calls it with the file's [run].verbose, so train, bench, chat and
serve honour the key without each wiring it (validate_run, the server's check of a posted
document, does not: validating a run is not running it). A program with its own logging keeps
it: configure_logging(False) removes only what configure_logging(True) added.

Lines look like `retrograd   0.42s config.load: [training].lr = 0.005 (file)`: seconds since the
process started logging, the module below `retrograd.`, the message.
"""

from __future__ import annotations

import logging
import sys

from retrograd.text import printable

LOGGER = "retrograd"


class _Stderr(logging.StreamHandler):
    """Writes to the sys.stderr of the moment: pytest and rich's live display replace it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        where = record.name.removeprefix(LOGGER).lstrip(".") or LOGGER
        line = f"retrograd {record.relativeCreated / 1000:7.2f}s {where}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return printable(line)  # a quoted answer's or tool's ESC sequences: shown, not sent


class _Printable(logging.Formatter):
    """logging's last-resort output (warnings when no handler is set up), control characters
    shown: a warning may quote a tool name or an error the policy wrote."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


# The handler configure_logging(True) installed and the level it replaced; None when off.
_installed: dict[str, object] = {}


def configure_logging(verbose: bool) -> None:
    """Verbose: the `retrograd` logger writes DEBUG and above to stderr. Not verbose: undo
    that (a no-op when it was never on). Either way logging's last resort (what prints a
    warning when no handler is set up) shows control characters as escapes."""
    logger = logging.getLogger(LOGGER)
    last = logging.lastResort
    if last is not None and not isinstance(last.formatter, _Printable):
        last.setFormatter(_Printable())  # only ever reached when nothing else handles a record
    if verbose and not _installed:
        handler = _Stderr()
        handler.setFormatter(_Format())
        _installed.update(handler=handler, level=logger.level)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    elif not verbose and _installed:
        logger.removeHandler(_installed["handler"])  # type: ignore[arg-type]
        logger.setLevel(_installed["level"])  # type: ignore[arg-type]
        _installed.clear()


def verbose() -> bool:
    """True while configure_logging(True) is in effect (to skip work only a log line needs)."""
    return bool(_installed)
