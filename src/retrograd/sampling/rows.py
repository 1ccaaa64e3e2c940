"""One answer being generated: its settings, its own random numbers, its tokens and text.

A row takes one decided token at a time (`advance`) and knows when it is finished: an
end-of-generation id, a stop string or its token budget. `completion` turns it into the
frozen record callers get. Rows are the same whether the answer is part of one
`Sampler.generate` call or joins a live batch mid-way (`batch.py`). Knows nothing about
tensors beyond owning a generator, nor about the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from retrograd.sampling.constrain import Constraint
from retrograd.sampling.params import FINISH_LENGTH, FINISH_STOP, Completion
from retrograd.sampling.stops import AnswerText


@dataclass(eq=False)
class Row:
    """One answer being generated. `entry`: the request it answers; `answer`: its number there."""

    entry: object
    answer: int
    prompt_len: int
    max_new: int
    temperature: float  # 0: greedy (tiny temperatures are made 0 by the sampler)
    top_p: float
    stop_ids: frozenset[int]
    generator: torch.Generator
    text: AnswerText
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    stopped_by: int | str | None = None
    constraint: Constraint | None = None  # the grammar its text follows, if any

    @property
    def remaining(self) -> int:
        """Tokens this row may still choose."""
        return self.max_new - len(self.ids)


def advance(row: Row, tok: int, logprob: float) -> None:
    """Append a decided token; set `finish` when it ends the answer (an ending id, a stop
    string, a grammar that admits nothing more, the token budget)."""
    row.ids.append(tok)
    row.logprobs.append(logprob)
    if row.constraint is not None and tok not in row.stop_ids:
        row.constraint.push(tok)
    if tok in row.stop_ids:
        row.finish, row.stopped_by = FINISH_STOP, tok
    elif row.text.push(tok) or (row.constraint is not None and row.constraint.done):
        row.finish, row.stopped_by = FINISH_STOP, row.text.stopped_by
    elif len(row.ids) >= row.max_new:
        row.finish = FINISH_LENGTH
    if row.finish is not None:
        row.text.finish()


def completion(row: Row) -> Completion:
    return Completion(
        tuple(row.ids),
        tuple(row.logprobs),
        row.finish or FINISH_LENGTH,
        row.text.text,
        row.prompt_len,
        row.stopped_by,
    )
