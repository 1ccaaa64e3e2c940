"""Reward programs (formats.md §2): one JSON line per answer in, one `{"reward": x}` line out.

Two modes, chosen once from a table: persistent (one process for the run, a handshake, batch
and index fields echoed, an end marker per batch) and oneshot (one process per batch, stdin
closed, exit 0). Any failure raises RewardError naming the key, the batch, the line and the
program's stderr tail, after killing the program's process group. This module knows nothing
about models or tokens: a request is two strings, a reply is a number (and, in GRPO with a
judge, a judge weight). One RewardProgram serves one thread.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from retrograd import nesting
from retrograd.rewards.process import DONE, LINE_LIMIT, OVERFLOW, TIMEOUT, Channel, Child

PROTOCOL = {"protocol": "retrograd-reward/1"}
HANDSHAKE = b'{"protocol":"retrograd-reward/1"}\n'
BATCH, INDEX, END = "_retrograd_batch", "_retrograd_index", "_retrograd_batch_end"
GRACE_SECONDS = 0.5  # after stdin closes at shutdown, before the group is killed
T = TypeVar("T")
ONESHOT_HINT = (
    '; a program that does not speak the persistent protocol needs reward_mode = "oneshot"'
)


@dataclass(frozen=True)
class RewardRequest:
    """What a reward program sees of one answer: the last user message and the answer text.
    `record` (the prompt's whole line) is for reward functions in Python
    (rewards/callables.py); a program never receives it (formats.md §2)."""

    prompt: str
    completion: str
    record: dict[str, Any] | None = None

    def line(self, **reserved: int) -> bytes:
        fields = {"prompt": self.prompt, "completion": self.completion, **reserved}
        text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "replace") + b"\n"


@dataclass(frozen=True)
class RewardReply:
    """One decoded reply. `judge_weight` (GRPO with a judge only) overrides the run's weight."""

    reward: float
    judge_weight: float | None = None


class BadLine(Exception):
    """A reply line is wrong; the caller adds the place (batch, line) and the stderr tail."""


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        value = nesting.loads(raw)  # nested deeper than nesting.MAX_DEPTH: TooDeep, a ValueError
    except ValueError as exc:
        raise BadLine(f"malformed JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadLine(f"expected a JSON object, got {type(value).__name__}")
    return value


def finite_float(value: Any) -> float:
    """A number as a finite float: TypeError for what is not a number (a bool is none; numpy's
    scalars are), ValueError for NaN or an infinity (an integer too large for a float too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(type(value).__name__)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def finite_number(value: Any, name: str) -> float:
    try:
        return finite_float(value)
    except TypeError:
        raise BadLine(f'"{name}" must be a number, got {json.dumps(value)[:80]}') from None
    except ValueError:
        raise BadLine(f'"{name}" is not finite ({value})') from None


def decode_reply(obj: dict[str, Any], *, allow_judge_weight: bool) -> RewardReply:
    """`{"reward": x}` plus an optional judge_weight; other keys are ignored (docs/rewards.md)."""
    if "reward" not in obj:
        raise BadLine('missing "reward"')
    reward = finite_number(obj["reward"], "reward")
    weight = obj.get("judge_weight")
    if weight is None:
        return RewardReply(reward)
    if not allow_judge_weight:
        raise BadLine('"judge_weight" is allowed only in GRPO with a [grpo.judge]')
    weight = finite_number(weight, "judge_weight")
    if weight < 0:
        raise BadLine(f'"judge_weight" must be at least 0, got {weight}')
    return RewardReply(reward, weight)


def _is(value: Any, expected: int) -> bool:
    return type(value) is int and value == expected


def oneshot(
    channel: Channel,
    requests: list[RewardRequest],
    deadline: float,
    number: int,
    limit: str,
    decode: Callable[[dict[str, Any]], T],
) -> list[T]:
    """One process for one batch: write the requests, close stdin, read all of stdout (at most
    8 MiB), require exit 0 and one line per request; `decode` turns each line into a reply."""
    child = channel.start(number)
    try:
        lines: list[tuple[int, bytes]] = []  # (stdout line number, line), blank lines skipped
        count = 0

        def on_line(raw: bytes) -> bool:
            nonlocal count
            count += 1
            if raw.strip():
                lines.append((count, raw))
            return False  # read to the end

        payload = b"".join(r.line() for r in requests)
        status = child.exchange(
            payload, deadline, on_line, close_stdin=True, total_limit=LINE_LIMIT
        )
        if status == OVERFLOW:
            raise channel.fail("more than 8 MiB of output", number, child)
        if status == TIMEOUT or not child.wait(deadline):
            what = f"not finished within {limit} ({len(lines)} lines of output so far)"
            raise channel.fail(what, number, child)
        child.kill()
        if child.popen.returncode != 0:
            raise channel.fail(f"the program ended with {child.status}", number, child)
    except BaseException:
        child.kill()
        raise
    if len(lines) != len(requests):
        raise channel.fail(f"{len(lines)} reply lines for {len(requests)} requests", number, child)
    replies = []
    for no, raw in lines:
        try:
            replies.append(decode(parse_object(raw)))
        except BadLine as exc:
            raise channel.fail(str(exc), number, child, line=no, raw=raw) from None
    return replies


class RewardProgram:
    """A reward program as configured; `score` sends one batch and returns one reply per
    request, in order. Close it (or use it as a context manager) at the end of the run."""

    def __init__(
        self,
        argv: list[str],
        mode: str = "persistent",
        timeout: float = 300.0,
        *,
        cwd: str | os.PathLike | None = None,
        allow_judge_weight: bool = False,
        where: str = "[grpo].reward_command",
    ) -> None:
        modes = {"persistent": self._persistent, "oneshot": self._oneshot}
        if mode not in modes:
            raise ValueError(f"reward mode must be persistent or oneshot, got {mode!r}")
        if not timeout > 0:
            raise ValueError(f"reward timeout must be above 0, got {timeout}")
        self.mode, self.timeout, self.allow_judge_weight = mode, timeout, allow_judge_weight
        self.channel = Channel(argv, where, cwd=cwd)
        self._score = modes[mode]
        self._child: Child | None = None  # the persistent worker, once started
        self.batches = 0  # batches sent so far: the next batch's number

    @property
    def pid(self) -> int | None:
        """The persistent worker's pid (and process group id), while one runs."""
        return self._child.pid if self._child is not None else None

    def score(self, requests: list[RewardRequest]) -> list[RewardReply]:
        """Score one batch. Raises RewardError; the batch is not retried."""
        if not requests:
            return []
        deadline = time.monotonic() + self.timeout
        number = self.batches
        self.batches += 1
        return self._score(list(requests), number, deadline)

    def close(self) -> None:
        """Persistent: close stdin, wait GRACE_SECONDS, kill the process group."""
        child, self._child = self._child, None
        if child is not None:
            child.close(GRACE_SECONDS)

    def __enter__(self) -> RewardProgram:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- oneshot -------------------------------------------------------------------------

    def _oneshot(self, requests: list[RewardRequest], number: int, deadline: float):
        limit = f"reward_timeout_seconds = {self.timeout:g}"
        return oneshot(self.channel, requests, deadline, number, limit, self._decode)

    def _decode(self, obj: dict[str, Any]) -> RewardReply:
        return decode_reply(obj, allow_judge_weight=self.allow_judge_weight)

    # --- persistent ----------------------------------------------------------------------

    def _persistent(self, requests: list[RewardRequest], number: int, deadline: float):
        try:
            if self._child is None:
                self._child = self.channel.start(number)
                self._handshake(self._child, number, deadline)
            else:
                self._check_quiet(self._child, number)
            return self._batch(self._child, requests, number, deadline)
        except BaseException:  # a failed (or interrupted) batch ends the worker
            child, self._child = self._child, None
            if child is not None:
                child.kill()
            raise

    def _handshake(self, child: Child, number: int, deadline: float) -> None:
        got: list[bytes] = []

        def on_line(raw: bytes) -> bool:
            if raw.strip():
                got.append(raw)
            return bool(got)

        status = child.exchange(HANDSHAKE, deadline, on_line)
        if status == DONE:
            try:
                if parse_object(got[0]) == PROTOCOL:
                    return
            except BadLine:
                pass
            what = f"the handshake reply must repeat {HANDSHAKE.decode().strip()}"
            raise self.channel.fail(what + ONESHOT_HINT, number, child, line=1, raw=got[0])
        raise self._ended(child, status, number, "during the handshake", hint=ONESHOT_HINT)

    def _check_quiet(self, child: Child, number: int) -> None:
        stray = child.stray()
        if stray.strip():
            what = f"extra output after batch {number - 1}'s end marker"
            raise self.channel.fail(what, number, child, raw=stray)

    def _batch(self, child: Child, requests: list[RewardRequest], number: int, deadline: float):
        n = len(requests)
        payload = b"".join(r.line(**{BATCH: number, INDEX: i}) for i, r in enumerate(requests))
        payload += b'{"%s":%d}\n' % (END.encode(), number)
        replies: list[RewardReply] = []
        line, last = 0, b""

        def on_line(raw: bytes) -> bool:
            nonlocal line, last
            line, last = line + 1, raw
            if not raw.strip():
                return False
            obj = parse_object(raw)
            if END in obj:
                if len(obj) != 1 or not _is(obj[END], number):
                    raise BadLine(f'the end marker must be {{"{END}": {number}}}')
                if len(replies) < n:
                    raise BadLine(f"end marker after {len(replies)} replies, expected {n}")
                return True
            if len(replies) == n:
                raise BadLine(f"extra line: all {n} replies came, the end marker was expected")
            for key, expected in ((BATCH, number), (INDEX, len(replies))):
                if key not in obj:
                    raise BadLine(f'missing "{key}" (persistent replies echo it)')
                if not _is(obj.pop(key), expected):
                    raise BadLine(f'"{key}" does not match: expected {expected}')
            replies.append(self._decode(obj))
            return False

        try:
            status = child.exchange(payload, deadline, on_line)
        except BadLine as exc:
            raise self.channel.fail(str(exc), number, child, line=line, raw=last) from None
        if status != DONE:
            got = f"after {len(replies)} of {n} replies"
            if len(replies) == n:
                got += " (the end marker is missing)"
            raise self._ended(child, status, number, got, line=line + 1)
        extra = child.stray()
        if extra.strip():
            raise self.channel.fail("extra line after the end marker", number, child, raw=extra)
        return replies

    def _ended(self, child: Child, status: str, number: int, when: str, *, line=None, hint=""):
        """The error for an exchange that ended on EOF, TIMEOUT or OVERFLOW."""
        if status == TIMEOUT:
            what = f"no reply within reward_timeout_seconds = {self.timeout:g} {when}"
        elif status == OVERFLOW:
            return self.channel.fail(f"a line over 8 MiB {when}", number, child, line=line)
        else:
            child.wait(time.monotonic() + GRACE_SECONDS)
            child.kill()
            what = f"the program ended ({child.status}) {when}"
        return self.channel.fail(what + hint, number, child)


def reward_program(section: Any, where: str = "[grpo]") -> RewardProgram:
    """The reward program of a [ppo] or [grpo] section; judge_weight replies are allowed only
    when the section has a judge."""
    return RewardProgram(
        section.reward_command,
        section.reward_mode,
        section.reward_timeout_seconds,
        allow_judge_weight=getattr(section, "judge", None) is not None,
        where=f"{where}.reward_command",
    )
