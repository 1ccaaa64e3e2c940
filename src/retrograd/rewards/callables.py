"""Reward functions in Python, in TRL's shape, beside a reward program: the `score` / `close`
interface the loops call on a RewardProgram, and formats.md §2's rules on failure.

A reward function is called once per batch, with keyword arguments:

    fn(prompts=[record, ...], completions=[text, ...], **columns) -> one number per completion

`prompts[i]` is the i-th answer's prompt line as the prompt file holds it (a dict with its
"messages", and any other key; a fresh copy, which the function may change), `completions[i]`
the answer's text. Every other key of the lines arrives as a column, one value per answer (None
where a line lacks it), as TRL hands a dataset's columns over: a function names the ones it
reads and takes **kwargs for the rest. It returns a list (or tuple, or numpy/torch vector) of
finite numbers; None abstains for that answer (a function among several, or beside a
program, that does not score it), but every answer needs a score from some part.

An answer's reward is the program's (when there is one) plus each function's value times its
weight (1 unless given, as TRL's reward_weights); a program's judge_weight reply stays as it is.

A function that raises, returns the wrong count, something that is not a number (a boolean
is not one) or a value that is not finite fails the batch as a failing reward program does:
RewardError naming the function, its place and the batch (the exception it raised chained as
the cause); the batch is not retried, and the run ends with the message, not a traceback of the
loop. Functions run in the trainer's process and the loop's thread, with no deadline:
reward_timeout_seconds is the program's, and a function that never returns holds the run.
Knows no model and no loop.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from retrograd.errors import ConfigError, RewardError
from retrograd.rewards.program import (
    RewardProgram,
    RewardReply,
    RewardRequest,
    finite_float,
    reward_program,
)

RESERVED = ("prompts", "completions")  # the two keyword arguments every function gets
RewardFunction = Callable[..., Any]


class _Bad(Exception):
    """A function's answer is wrong; the caller adds the place."""


class RewardFunctions:
    """Python reward functions as one reward part: `values(requests)` gives, per request,
    the weighted sum of the functions that scored it, or None when none did."""

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        weights: Sequence[float] | None = None,
        *,
        where: str = "rewards",
    ) -> None:
        self.functions = list(functions)
        self.where = where
        for i, fn in enumerate(self.functions):
            if not callable(fn):
                raise ConfigError(f"{where}[{i}] = {fn!r:.80}: not a function")
        self.weights = _weights(weights, len(self.functions), where)
        self.batches = 0  # batches scored so far: the next batch's number

    def name(self, i: int) -> str:
        """`reward function plural_ok (rewards[0])`: how an error names function i."""
        fn = self.functions[i]
        label = getattr(fn, "__name__", None) or type(fn).__name__
        return f"reward function {label} ({self.where}[{i}])"

    def values(self, requests: Sequence[RewardRequest]) -> list[float | None]:
        """Each request's weighted sum over the functions that scored it (None: none did).
        Raises RewardError for a failing function."""
        number, self.batches = self.batches, self.batches + 1
        totals: list[float | None] = [None] * len(requests)
        for i, fn in enumerate(self.functions):
            for k, value in enumerate(self._call(i, fn, requests, number)):
                if value is not None:
                    totals[k] = (totals[k] or 0.0) + self.weights[i] * value
        return totals

    def _call(
        self, i: int, fn: RewardFunction, requests: Sequence[RewardRequest], number: int
    ) -> list[float | None]:
        place = f"{self.name(i)}: batch {number}"
        try:
            out = fn(**arguments(requests))
        except Exception as error:
            raise RewardError(f"{place}: raised {type(error).__name__}: {error}") from error
        try:
            return checked(out, len(requests))
        except _Bad as bad:
            raise RewardError(f"{place}: {bad}") from None


def arguments(requests: Sequence[RewardRequest]) -> dict[str, Any]:
    """The keyword arguments of one call: prompts, completions and the lines' other keys."""
    records = [_record(r) for r in requests]
    columns: dict[str, None] = {}  # every line's keys, in first-seen order
    for record in records:
        columns.update(dict.fromkeys(record))
    kwargs: dict[str, Any] = {
        name: [record.get(name) for record in records]
        for name in columns
        if name not in RESERVED and name != "messages"  # the prompt itself is `prompts`
    }
    return {"prompts": records, "completions": [r.completion for r in requests], **kwargs}


def _record(request: RewardRequest) -> dict[str, Any]:
    """A fresh copy of the request's prompt line; a request without one (a prompt made
    elsewhere) gets the line its last user message would make."""
    if request.record is not None:
        return copy.deepcopy(dict(request.record))
    return {"messages": [{"role": "user", "content": request.prompt}]}


def checked(out: Any, n: int) -> list[float | None]:
    """A function's answer as n floats (None kept); _Bad says what is wrong with it."""
    if inspect.isawaitable(out):
        close = getattr(out, "close", None)
        if close is not None:
            close()  # never awaited: no "coroutine was never awaited" warning later
        raise _Bad("returned an awaitable: async reward functions are not supported")
    if hasattr(out, "tolist"):  # a numpy or torch vector
        out = out.tolist()
    if isinstance(out, str | bytes | Mapping) or not isinstance(out, Iterable):
        raise _Bad(f"returned {type(out).__name__}, not a list of numbers")
    values = list(out)
    if len(values) != n:
        raise _Bad(f"returned {len(values)} values for {n} completions")
    return [_number(v, k) for k, v in enumerate(values)]


def _number(value: Any, k: int) -> float | None:
    if value is None:
        return None
    try:
        return finite_float(value)
    except TypeError:
        raise _Bad(f"value {k} is {type(value).__name__} {value!r:.80}, not a number") from None
    except ValueError:
        raise _Bad(f"value {k} is not finite ({value!r:.80})") from None


def _weights(weights: Sequence[float] | None, n: int, where: str) -> list[float]:
    if weights is None:
        return [1.0] * n
    weights = list(weights)
    if len(weights) != n:
        raise ConfigError(f"{where}: {len(weights)} weights for {n} reward functions")
    out = []
    for i, w in enumerate(weights):
        try:
            out.append(finite_float(w))
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where} weight [{i}] = {w!r:.80}: must be a finite number"
            ) from None
    return out


class Rewards:
    """The run's reward: its program, its Python functions, or both, summed. `score` and
    `close` as RewardProgram's, so a loop holds either."""

    def __init__(
        self, program: RewardProgram | None, functions: RewardFunctions | None = None
    ) -> None:
        if program is None and (functions is None or not functions.functions):
            raise ConfigError("no reward program and no reward function: give one or both")
        self.program, self.functions = program, functions

    def score(self, requests: list[RewardRequest]) -> list[RewardReply]:
        """One reply per request, in order. Raises RewardError; the batch is not retried."""
        if not requests:
            return []
        replies = self.program.score(requests) if self.program is not None else None
        if self.functions is None:
            return replies  # type: ignore[return-value]
        extra = self.functions.values(requests)
        out = []
        for k, value in enumerate(extra):
            reply = replies[k] if replies is not None else None
            if reply is None and value is None:
                number = self.functions.batches - 1
                raise RewardError(
                    f"{self.functions.where}: batch {number}: no reward function scored "
                    f"completion {k} (every one returned None for it)"
                )
            reward = (reply.reward if reply else 0.0) + (value or 0.0)
            if not math.isfinite(reward):  # each part was finite: their weighted sum overflowed
                number = self.functions.batches - 1
                raise RewardError(
                    f"{self.functions.where}: batch {number}: completion {k}: the reward "
                    f"({reply.reward if reply else 0.0!r} from the program + {value!r} from the "
                    f"functions) is {reward}: scale the rewards down"
                )
            out.append(RewardReply(reward, reply.judge_weight if reply else None))
        return out

    def close(self) -> None:
        if self.program is not None:
            self.program.close()

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_rewards(
    section: Any,
    where: str = "[grpo]",
    functions: Sequence[RewardFunction] = (),
    weights: Sequence[float] | None = None,
) -> Rewards:
    """The rewards of a [grpo] or [ppo] section: its reward_command's program (when set) and
    the Python `functions` (weighted by `weights`), summed per answer."""
    program = reward_program(section, where) if section.reward_command is not None else None
    python = RewardFunctions(functions, weights) if functions else None
    return Rewards(program, python)
