"""Prompt files of rollout algorithms (formats.md §1.3): chat JSONL whose every line ends with
a non-empty user message; the model writes the next assistant turn.

Read in two steps so that a malformed file fails before the model loads: `read_prompts`
validates every line (no tokenizer needed), `render_prompts` renders them through the chat
template with the assistant-generation prefix. No metadata reaches a reward program: it gets
the last user message's text. A line may carry `rubric` besides `messages` (for judges);
other keys are refused, as the reference's examples say, unless the run's rewards are Python
functions (`extra_keys`), which receive each prompt's whole line (`Prompt.record`), ground
truth and all. A prompt that leaves no room for an answer in [training].ctx is an error
naming its line, never cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd.data.sft import json_records
from retrograd.errors import DataError
from retrograd.tokenizer.records import validate_record

ALLOWED_KEYS = {"messages", "rubric"}


@dataclass(frozen=True)
class Prompt:
    """One line of the prompt file, rendered once."""

    key: str  # where it came from: "prompts.jsonl:3"
    index: int  # its 0-based position in the file
    messages: tuple[dict, ...]  # the conversation, ending with a user message
    text: str  # the last user message's content: what a reward program receives
    ids: tuple[int, ...]  # the rendered prompt with the assistant-generation prefix
    rubric: str | None = None  # the line's own judge criteria, else the judge's rubric
    record: dict[str, Any] | None = None  # the whole JSON line, for reward functions


@dataclass(frozen=True)
class PromptLine:
    key: str  # "prompts.jsonl:3"
    index: int
    messages: tuple[dict, ...]
    rubric: str | None
    record: dict[str, Any] | None = None  # the whole JSON line, as parsed


@dataclass(frozen=True)
class PromptFile:
    path: Path
    lines: tuple[PromptLine, ...]
    fingerprint: str  # sha256 of the file's bytes

    def __len__(self) -> int:
        return len(self.lines)


def read_prompts(
    path: str | Path, where: str = "[grpo].prompts", *, extra_keys: bool = False
) -> PromptFile:
    """Every line validated; DataError naming file and line on the first broken one.
    `extra_keys`: keys besides messages and rubric are kept for reward functions (in the
    line's `record`) instead of refused."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{where} = {path}: no such prompt file")
    raw = path.read_bytes()
    lines = []
    for place, record in json_records(path, raw):
        if not isinstance(record, dict):
            raise DataError(f"{place}: a prompt line must be a JSON object")
        extra = sorted(set(record) - ALLOWED_KEYS)
        if extra and not extra_keys:
            raise DataError(
                f'{place}: unknown key {extra[0]!r}; a prompt line holds "messages" (and '
                'optionally "rubric"): put what the reward program needs in the user message'
            )
        if "tools" in record:
            raise DataError(f"{place}: prompt files hold no tool records")
        messages, _ = validate_record(record, place)
        last = messages[-1]
        if last["role"] != "user" or not str(last.get("content", "")).strip():
            raise DataError(f"{place}: a prompt must end with a non-empty user message")
        if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            raise DataError(f"{place}: prompt files hold no tool calls or tool results")
        rubric = record.get("rubric")
        if rubric is not None and not isinstance(rubric, str):
            raise DataError(f'{place}: "rubric" must be a string')
        lines.append(PromptLine(place, len(lines), tuple(messages), rubric, record))
    if not lines:
        raise DataError(f"{where} = {path}: no prompt in the file")
    return PromptFile(path, tuple(lines), hashlib.sha256(raw).hexdigest())


def render_prompts(file: PromptFile, chat, ctx: int) -> list[Prompt]:
    """The prompts rendered with the assistant-generation prefix, as the sampler continues
    them. A prompt of ctx tokens or more leaves no room for an answer: DataError."""
    out = []
    for line in file.lines:
        ids = chat.prompt_ids([dict(m) for m in line.messages])
        if len(ids) >= ctx:
            raise DataError(
                f"{line.key}: the prompt renders to {len(ids)} tokens, which leaves no room "
                f"for an answer in [training].ctx = {ctx}; shorten it or raise ctx"
            )
        text = str(line.messages[-1].get("content", ""))
        out.append(
            Prompt(line.key, line.index, line.messages, text, tuple(ids), line.rubric, line.record)
        )
    return out
