"""SFT datasets (formats.md §1.2, §1.4, §1.7-1.9): text or chat JSONL -> examples of ids + mask.

An `Example` holds at most `ctx` token ids and a mask: mask[i] = 1 when ids[i] is a trained
target, predicted from ids[:i]. Text files become one stream cut into windows of ctx tokens
that overlap by one token, so every token after the first is predicted exactly once. Chat and
tool records train only what the model writes (the tokenizer layer decides which tokens).

Files are read as strict UTF-8 (a leading byte-order mark is dropped); a bad byte is an error
naming its line. JSONL records end at "\n" only, never at the other characters Unicode calls
line breaks, which JSON strings may hold. An empty or all-whitespace text file is an error,
not windows of whitespace.

Decision (open in the spec): a record longer than ctx is truncated to its first ctx tokens,
like TRL's max_length; records left with no trained token are dropped. Both are counted and
reported. Knows tokenizers and chat formats, not models.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd import nesting
from retrograd.errors import DataError
from retrograd.text import is_text
from retrograd.tokenizer.records import validate_record

TEXT_EXTENSIONS = (".txt", ".md")
JSONL_EXTENSIONS = (".jsonl", ".json")
BOM = codecs.BOM_UTF8  # a byte-order mark some editors write first; never trained on


@dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]
    mask: tuple[int, ...]  # 1 where ids[i] is a trained target
    where: str  # "data.jsonl:17" or "data.txt:window 3"

    @property
    def n_targets(self) -> int:
        return sum(self.mask[1:])


@dataclass(frozen=True)
class SFTDataset:
    path: Path
    format: str  # "text" or "jsonl"
    examples: tuple[Example, ...]
    fingerprint: str  # sha256 of the file's bytes
    rows: int  # records (jsonl) or windows (text) read
    truncated: int  # records cut to ctx
    dropped: int  # records with nothing left to train

    @property
    def n_targets(self) -> int:
        return sum(e.n_targets for e in self.examples)

    def describe(self) -> str:
        out = (
            f"{self.path.name}: {self.format}, {len(self.examples)} examples, "
            f"{self.n_targets:,} trained tokens"
        )
        if self.truncated:
            out += f"; {self.truncated} longer than ctx were truncated"
        if self.dropped:
            out += f"; {self.dropped} dropped (nothing to train within ctx)"
        return out


def infer_format(path: Path, given: str | None = None) -> str:
    """formats.md §1.8: explicit, else by extension, else by the first non-empty line."""
    if given and given != "auto":
        if given not in ("text", "jsonl"):
            raise DataError(f"{path}: data format {given!r}: must be text or jsonl")
        return given
    suffix = path.suffix.lower()
    if suffix in JSONL_EXTENSIONS:
        return "jsonl"
    if suffix in TEXT_EXTENSIONS:
        return "text"
    with open(path, "rb") as f:  # bytes: a sniff must not fail on a bad byte further on
        for n, line in enumerate(f):
            line = line.removeprefix(BOM) if n == 0 else line
            if line.strip():
                return "jsonl" if line.lstrip().startswith(b"{") else "text"
    return "text"


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order of examples: a pure function of (seed, epoch) (formats.md §1.9)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def load_sft_data(
    path: str | Path, tokenizer, ctx: int, data_format: str | None = None, chat=None
) -> SFTDataset:
    """Read and tokenize a whole SFT file. `chat` is a ChatFormat (needed for JSONL)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    raw = path.read_bytes()
    fmt = infer_format(path, data_format)
    if fmt == "text":
        examples, rows, truncated, dropped = _text(path, raw, tokenizer, ctx), 0, 0, 0
        rows = len(examples)
    else:
        if chat is None:
            raise DataError(f"{path}: chat JSONL needs the model's chat format")
        examples, rows, truncated, dropped = _jsonl(path, raw, chat, ctx)
    if not examples:
        raise DataError(f"{path}: no example to train on")
    return SFTDataset(
        path, fmt, tuple(examples), hashlib.sha256(raw).hexdigest(), rows, truncated, dropped
    )


def _text(path: Path, raw: bytes, tokenizer, ctx: int) -> list[Example]:
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{path.name}:{line}: not valid UTF-8 (byte {column})") from None
    if not text.strip():
        raise DataError(f"{path}: no text to train on")
    ids = tokenizer.tokenize(text, add_bos=True, parse_special=False)
    out = []
    for n, start in enumerate(range(0, max(1, len(ids) - 1), ctx - 1)):
        window = tuple(ids[start : start + ctx])
        if len(window) >= 2:
            out.append(Example(window, (0,) + (1,) * (len(window) - 1), f"{path.name}:window {n}"))
    return out


def json_records(path: Path, raw: bytes) -> Iterator[tuple[str, object]]:
    """(place, decoded JSON value) of each non-blank line (jsonl_lines)."""
    for place, text in jsonl_lines(path, raw):
        yield place, json_line(text, place)


def json_line(text: str, place: str) -> object:
    """One JSONL line's value; DataError naming `place` for a line that is not valid JSON, is
    nested deeper than nesting.MAX_DEPTH, or holds a lone surrogate (a \\ud800 escape, which
    no template, tokenizer or file takes)."""
    try:
        value = nesting.loads(text)
    except json.JSONDecodeError as e:  # nested too deep (nesting.TooDeep) included
        raise DataError(f"{place}: invalid JSON ({e.msg} at column {e.colno})") from None
    if "\\u" in text and not is_text(json.dumps(value, ensure_ascii=False)):
        raise DataError(f"{place}: a lone surrogate (a \\ud800 escape), which is not text")
    return value


def jsonl_lines(path: Path, raw: bytes) -> Iterator[tuple[str, str]]:
    """(place "file.jsonl:LINE", text) of each non-blank line of a JSONL file.

    NOTE: records end at b"\n" only (a trailing "\r" is dropped). str.splitlines() would also
    cut at U+2028, U+2029, \x85, \x0c and others, which JSON allows unescaped inside strings.
    Each line is decoded on its own, strictly: a bad byte is an error naming its line, never
    a replacement character trained on.
    """
    if raw.removeprefix(BOM).lstrip()[:1] == b"[":
        out = f"{path.stem}{'-lines' if path.suffix == '.jsonl' else ''}.jsonl"
        raise DataError(
            f"{path}: a JSON array; JSONL is one JSON object per line "
            f"(convert it with: jq -c '.[]' {path.name} > {out})"
        )
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        where = f"{path.name}:{lineno}"
        line = line.removesuffix(b"\r")
        if lineno == 1:
            line = line.removeprefix(BOM)
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start + 1})") from None
        if text.strip():
            yield where, text


def _jsonl(path: Path, raw: bytes, chat, ctx: int) -> tuple[list[Example], int, int, int]:
    examples, rows, truncated, dropped = [], 0, 0, 0
    for where, line in jsonl_lines(path, raw):
        record = json_line(line, where)
        messages, tools = validate_record(record, where, chat.tool_format, require_assistant=True)
        enc = chat.encode(messages, tools or None)
        rows += 1
        ids, mask = list(enc.ids), list(enc.train_mask)
        if len(ids) > ctx:
            truncated += 1
            ids, mask = ids[:ctx], mask[:ctx]
        if sum(mask[1:]) == 0:
            dropped += 1
            continue
        examples.append(Example(tuple(ids), tuple(mask), where))
    return examples, rows, truncated, dropped
