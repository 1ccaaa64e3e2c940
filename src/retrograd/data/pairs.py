"""Preference pair files (formats.md §1.5): one JSON object a line with `prompt`, `chosen` and
`rejected`, each a list of chat messages, an optional `tools` catalogue offered to both answers
and an optional `metadata`, kept and never read.

`read_pairs` validates every line before any model loads, and refuses with the file and line
(`pairs.jsonl:17: missing "chosen"`). The rules, on top of those of chat and tool records
(§1.2, §1.4) that prompt + chosen and prompt + rejected must each keep as one conversation:

- the prompt ends on a user turn or on tool observations answering its last call; a system
  message may only open it; its assistant turns are context;
- each answer starts with an assistant turn, ends on an assistant turn or on the results of its
  calls, and may span several turns; chosen and rejected differ.

Decisions where the spec is silent: other top-level keys are ignored (only the scenario format
is said to be strict); a message number in an error counts from the prompt's first message,
as the conversation "prompt + chosen" reads.

`tokenize_pairs` is the second step, once a chat format is known (the tokenizer and template
come from the GGUF's metadata, so it still runs before the weights load): the prompt is
rendered once with the generation prompt, each answer after it; both renderings must start
with the prompt's ids exactly, and a pair longer than [training].ctx is refused, never cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.data.sft import json_records
from retrograd.errors import DataError
from retrograd.tokenizer.records import validate_record

SIDES = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One line, normalized as `validate_record` leaves messages (call ids named, JSON-string
    arguments decoded, failed observations prefixed)."""

    key: str  # "pairs.jsonl:3"
    index: int
    prompt: tuple[dict, ...]
    chosen: tuple[dict, ...]
    rejected: tuple[dict, ...]
    tools: tuple[dict, ...]  # OpenAI function shape; () without a catalogue
    metadata: Any = None


@dataclass(frozen=True)
class PairFile:
    path: Path
    pairs: tuple[Pair, ...]
    fingerprint: str  # sha256 of the file's bytes

    def __len__(self) -> int:
        return len(self.pairs)


def read_pairs(path: str | Path, where: str = "[preference].data") -> PairFile:
    """Every line validated; DataError naming file and line on the first broken one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{where} = {path}: no such pair file")
    raw = path.read_bytes()
    pairs = []
    for place, record in json_records(path, raw):
        pairs.append(read_pair(record, place, len(pairs)))
    if not pairs:
        raise DataError(f"{where} = {path}: no pair in the file")
    return PairFile(path, tuple(pairs), hashlib.sha256(raw).hexdigest())


def read_pair(record: Any, place: str, index: int = 0) -> Pair:
    """One decoded line as a Pair, or DataError naming `place`."""
    if not isinstance(record, dict):
        raise DataError(
            f'{place}: a pair must be a JSON object with "prompt", "chosen", "rejected"'
        )
    for side in SIDES:
        if side not in record:
            raise DataError(f'{place}: missing "{side}"')
        if not isinstance(record[side], list) or not record[side]:
            raise DataError(f'{place}: "{side}" must be a non-empty list of messages')
    _check_roles(record, place)
    n = len(record["prompt"])
    answers = {}
    for side in ("chosen", "rejected"):
        conversation = {"messages": record["prompt"] + record[side], "tools": record.get("tools")}
        messages, tools = validate_record(conversation, f"{place}: prompt + {side}")
        answers[side] = messages[n:]
    if answers["chosen"] == answers["rejected"]:
        raise DataError(f'{place}: "chosen" and "rejected" are the same answer')
    return Pair(
        place,
        index,
        tuple(messages[:n]),
        tuple(answers["chosen"]),
        tuple(answers["rejected"]),
        tuple(tools),
        record.get("metadata"),
    )


@dataclass(frozen=True)
class TokenPair:
    """A pair as ids: the prompt once, then each answer's ids after it with its train mask
    (1 where the model writes; trailing template framing is dropped)."""

    key: str  # "pairs.jsonl:3"
    index: int
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    chosen_mask: tuple[int, ...]
    rejected: tuple[int, ...]
    rejected_mask: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        """The pair's tokens, the prompt counted once (what its packed pass holds)."""
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


def tokenize_pairs(
    file: PairFile, chat, ctx: int, where: str = "[training].ctx"
) -> list[TokenPair]:
    """Every pair of the file as ids; DataError naming the line of a pair whose template
    rewrites the prompt once an answer follows, or whose tokens exceed ctx."""
    out = []
    for pair in file.pairs:
        tools = [dict(t) for t in pair.tools] or None
        prompt = chat.prompt_ids([dict(m) for m in pair.prompt], tools)
        sides = {s: _answer(pair, s, chat, prompt, tools) for s in ("chosen", "rejected")}
        tp = TokenPair(pair.key, pair.index, tuple(prompt), *sides["chosen"], *sides["rejected"])
        if tp.n_tokens > ctx:
            raise DataError(
                f"{pair.key}: the pair renders to {tp.n_tokens} tokens (prompt {len(prompt)}, "
                f"chosen {len(tp.chosen)}, rejected {len(tp.rejected)}), more than {where} = "
                f"{ctx}; pairs are never cut: shorten it or raise ctx"
            )
        out.append(tp)
    return out


def _answer(pair: Pair, side: str, chat, prompt: list[int], tools) -> tuple[tuple, tuple]:
    """(ids, mask) of one answer after the prompt's ids."""
    messages = [dict(m) for m in pair.prompt + getattr(pair, side)]
    enc = chat.encode(messages, tools)
    ids, mask = list(enc.ids), list(enc.train_mask)
    n = len(prompt)
    # the prompt's own assistant turns (few-shot examples) are context: only its ids must agree
    if ids[:n] != prompt:
        at = next((i for i, (a, b) in enumerate(zip(ids, prompt, strict=False)) if a != b), n)
        raise DataError(
            f"{pair.key}: the chat template renders the prompt differently once the {side} "
            f"answer follows (the ids differ from token {at} of {n}); both answers must share "
            "the prompt token for token, so this template cannot train preference pairs"
        )
    ids, mask = ids[n:], mask[n:]
    while mask and not mask[-1]:  # framing after the last written token: never scored
        ids.pop()
        mask.pop()
    if not mask:
        raise DataError(f'{pair.key}: "{side}" has no model-written token to score')
    return tuple(ids), tuple(mask)


def _check_roles(record: dict, place: str) -> None:
    """Where the prompt ends and the answers start and end; checked before the conversation
    rules, which would name the same mistake less plainly ("two consecutive assistant
    messages"). A message without a valid role is left to those rules."""
    last = _role(record["prompt"][-1])
    if last in ("assistant", "system"):
        raise DataError(
            f'{place}: the prompt ends on a message of role "{last}"; it must end on a user '
            "turn or on tool observations"
        )
    for side in ("chosen", "rejected"):
        first, last = _role(record[side][0]), _role(record[side][-1])
        if first in ("system", "user", "tool"):
            raise DataError(
                f'{place}: "{side}" starts with a message of role "{first}"; it must start '
                "with an assistant turn"
            )
        if last in ("system", "user"):
            raise DataError(
                f'{place}: "{side}" ends on a message of role "{last}"; it must end on an '
                "assistant turn or on the results of its calls"
            )


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None
