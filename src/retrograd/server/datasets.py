"""Uploaded datasets (formats.md §9.3): stored by content, checked line by line, measured.

A dataset is its bytes: its id is `ds_` + their sha256, so the same upload twice is one dataset.
It lives in `<state_dir>/datasets/<id>/` as `data.jsonl` or `data.txt` beside `dataset.json`
(its view), both written through temporary names. Formats: `text`, `chat-jsonl` (records with
`messages`, §1.2) and `preference-jsonl` (prompt, chosen, rejected, §1.5; never inferred, as the
reference says). Examples are the records, or the non-empty lines of a text. Token statistics
need a model's tokenizer (`tokenize`); nothing here imports torch or knows about runs, which
name a dataset by its id in place of a path (documents.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrograd import nesting
from retrograd.server.guard import refuse_unwritable
from retrograd.server.problems import FieldError, Problem, not_found, pointer, too_deep
from retrograd.server.store import iso, now_ms, write_atomic
from retrograd.text import json_dumps, newline_split

FORMATS = ("auto", "text", "jsonl", "preference-jsonl")
_ID = re.compile(r"ds_[0-9a-f]{64}")  # a dataset's id: its bytes' sha256
CTX_MARKS = (128, 256, 512, 1024, 2048, 4096, 8192)  # truncation reported at these contexts
_MAX_SHOWN = 5  # bad lines reported in one answer


@dataclass(frozen=True)
class Parsed:
    format: str
    examples: list[Any]  # records (jsonl) or lines (text)
    suffix: str
    content: bytes  # what is stored: the body, or a JSON array's records as JSON lines


def check_format(fmt: str) -> None:
    """Problem (invalid-request) unless `fmt` is one of FORMATS."""
    if fmt not in FORMATS:
        raise Problem(
            "invalid-request",
            f"format = {fmt!r}: must be one of {', '.join(FORMATS)}",
            [FieldError("/query/format", "invalid_value", f"must be one of {', '.join(FORMATS)}")],
        )


def _kind(media: str, fmt: str) -> str:
    """What an upload of `media` asked as `fmt` is: text, chat-jsonl or preference-jsonl."""
    if fmt == "text" or (fmt == "auto" and media == "text/plain"):
        return "text"
    return "preference-jsonl" if fmt == "preference-jsonl" else "chat-jsonl"


def parse(body: bytes, media: str, fmt: str) -> Parsed:
    """Check an upload; Problem (invalid-request) naming the lines that are wrong."""
    check_format(fmt)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _bad("", f"not UTF-8 text ({error})") from None
    kind = _kind(media, fmt)
    if kind == "text":
        lines = [line for line in newline_split(text) if line.strip()]
        if not lines:
            raise _bad("", "the text is empty")
        return Parsed("text", lines, ".txt", body)
    records = _records(text, media)
    check = _preference if kind == "preference-jsonl" else _chat
    errors = [e for i, r in enumerate(records) if (e := check(i, r))]
    if errors:
        raise Problem(
            "invalid-request",
            f"{len(errors)} of {len(records)} records are not {kind} records",
            errors[:_MAX_SHOWN],
        )
    content = body
    if media == "application/json":
        content = "".join(json_dumps(r) + "\n" for r in records).encode()
    return Parsed(kind, records, ".jsonl", content)


def _bad(where: str, message: str) -> Problem:
    return Problem("invalid-request", message, [FieldError(where, "unsupported_format", message)])


def _records(text: str, media: str) -> list[Any]:
    if media == "application/json":
        try:
            records = nesting.loads(text)
        except nesting.TooDeep as error:
            raise too_deep(error, f"the body is {error}") from None
        except json.JSONDecodeError as error:
            raise _bad("", f"not JSON: {error}") from None
        if not isinstance(records, list) or not records:
            raise _bad("", "a JSON body must be a non-empty array of records")
        refuse_unwritable(records)
        return records
    records = [_record(line, n) for n, line in enumerate(newline_split(text), 1) if line.strip()]
    if not records:
        raise _bad("", "no records")
    return records


def _record(line: str, n: int) -> Any:
    """Line `n` of a JSON-lines upload, parsed; Problem naming the line when it is not JSON,
    is nested too deep or holds what no JSON answer carries."""
    try:
        record = nesting.loads(line)
    except nesting.TooDeep as error:
        raise too_deep(error, f"line {n}: {error.msg}", f"/line/{n}") from None
    except json.JSONDecodeError as error:
        raise _bad(f"/line/{n}", f"line {n}: not JSON ({error.msg})") from None
    refuse_unwritable(record, f"/line/{n}")
    return record


@dataclass(frozen=True)
class Scanned:
    """An upload spooled to a file, checked: its format, examples and sha256."""

    format: str
    examples: int
    sha256: str


def scan(path: Path, media: str, fmt: str) -> Scanned:
    """Check an upload of JSON lines or text that was spooled to `path`, reading it one line
    at a time (never the whole of it in memory) while hashing it; the same Problems as
    `parse`."""
    check_format(fmt)
    kind = _kind(media, fmt)
    check = _preference if kind == "preference-jsonl" else _chat
    digest, n, examples, bad, shown = hashlib.sha256(), 0, 0, 0, []
    with open(path, "rb") as f:
        for raw in f:
            digest.update(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _bad("", f"not UTF-8 text (line {n + 1}: {error})") from None
            for line in newline_split(text.removesuffix("\n")):
                n += 1
                if not line.strip():
                    continue
                if kind != "text" and (found := check(examples, _record(line, n))):
                    bad += 1
                    shown += [found][: _MAX_SHOWN - len(shown)]
                examples += 1
    if not examples:
        raise _bad("", "the text is empty" if kind == "text" else "no records")
    if bad:
        message = f"{bad} of {examples} records are not {kind} records"
        raise Problem("invalid-request", message, shown)
    return Scanned(kind, examples, digest.hexdigest())


def _messages_problem(value: Any, name: str) -> str | None:
    if not isinstance(value, list) or not value:
        return f"{name} must be a non-empty list of messages"
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{name}: every message needs a role"
    return None


def _chat(i: int, record: Any) -> FieldError | None:
    if not isinstance(record, dict) or "messages" not in record:
        hint = " (preference pairs are uploaded with format=preference-jsonl)"
        pairs = isinstance(record, dict) and {"prompt", "chosen", "rejected"} <= set(record)
        return FieldError(pointer(i), "unsupported_format", "no messages" + (hint if pairs else ""))
    problem = _messages_problem(record["messages"], "messages")
    return FieldError(pointer(i, "messages"), "invalid_value", problem) if problem else None


def _preference(i: int, record: Any) -> FieldError | None:
    if not isinstance(record, dict):
        return FieldError(pointer(i), "unsupported_format", "must be an object")
    for name in ("prompt", "chosen", "rejected"):
        problem = _messages_problem(record.get(name), name)
        if problem:
            return FieldError(pointer(i, name), "invalid_value", problem)
    if record["chosen"] == record["rejected"]:
        return FieldError(pointer(i, "rejected"), "invalid_value", "chosen and rejected are equal")
    return None


def percentile(sorted_values: list[int], q: float) -> int:
    """The nearest-rank percentile of sorted values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def token_stats(lengths: list[int]) -> dict[str, Any]:
    values = sorted(lengths)
    return {
        "measured": True,
        "total_tokens": sum(values),
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
        "max": values[-1],
    }


class Datasets:
    """The uploaded datasets of one state directory."""

    def __init__(self, root: Path, max_bytes: int, max_total: int):
        self.root = Path(root)
        self.max_bytes, self.max_total = max_bytes, max_total
        self.lock = threading.Lock()

    def folder(self, dataset_id: str) -> Path:
        return self.root / dataset_id

    def add(self, body: bytes, media: str, fmt: str, name: str | None) -> tuple[dict, bool]:
        """(view, created): the dataset of these bytes, stored unless it already was."""
        parsed = parse(body, media, fmt)
        content = parsed.content
        dataset_id = "ds_" + hashlib.sha256(content).hexdigest()

        def write(data: Path) -> None:
            tmp = data.with_name(f".{data.name}.tmp")
            tmp.write_bytes(content)
            tmp.replace(data)

        shape = (parsed.format, parsed.suffix, len(parsed.examples), len(content))
        return self._store(dataset_id, shape, name, write)

    def spool_path(self) -> Path:
        """A new temporary file's name in the datasets' folder, for an upload as it arrives."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".upload-{secrets.token_hex(8)}.tmp"

    def add_file(self, path: Path, media: str, fmt: str, name: str | None) -> tuple[dict, bool]:
        """(view, created): the dataset of an upload spooled to `path` (JSON lines or text),
        checked a line at a time and moved into place: the upload is never in memory whole.
        `path` is gone or left for the caller to remove."""
        scanned = scan(path, media, fmt)
        suffix = ".txt" if scanned.format == "text" else ".jsonl"
        shape = (scanned.format, suffix, scanned.examples, path.stat().st_size)
        return self._store("ds_" + scanned.sha256, shape, name, path.replace)

    def _store(
        self, dataset_id: str, shape: tuple[str, str, int, int], name: str | None, write
    ) -> tuple[dict, bool]:
        """Store a checked dataset (`shape`: format, suffix, examples, bytes) unless it is
        known; `write(data_path)` puts its bytes in place."""
        kind, suffix, examples, size = shape
        with self.lock:
            known = self.view(dataset_id)
            if known is not None:
                return known, False
            used = sum(v["bytes"] for v in self.all())
            if used + size > self.max_total:
                raise Problem(
                    "payload-too-large",
                    f"the datasets would take {used + size} bytes, over "
                    f"max_datasets_bytes ({self.max_total}); delete some first",
                    meta={"max_datasets_bytes": self.max_total, "used_bytes": used},
                )
            folder = self.folder(dataset_id)
            folder.mkdir(parents=True, exist_ok=True)
            write(folder / f"data{suffix}")
            view = {
                "id": dataset_id,
                "sha256": dataset_id[3:],
                "format": kind,
                "bytes": size,
                "examples": examples,
                "created_at": iso(now_ms()),
                "name": name,
                "stats": {"measured": False},
            }
            write_atomic(folder / "dataset.json", json.dumps(view, indent=1))
            return view, True

    def view(self, dataset_id: str) -> dict | None:
        """The dataset's view; None when `dataset_id` is not the id of one stored here (only
        `ds_` + a sha256 is: a run document's "ds_<id>/../x" names no dataset)."""
        path = self.folder(dataset_id) / "dataset.json"
        if not _ID.fullmatch(dataset_id) or not path.is_file():
            return None
        return json.loads(path.read_text(encoding="utf-8"))

    def need(self, dataset_id: str) -> dict:
        found = self.view(dataset_id)
        if found is None:
            raise not_found(f"no dataset {dataset_id!r}")
        return found

    def all(self) -> list[dict]:
        """Every dataset, newest first."""
        if not self.root.is_dir():
            return []
        views = [self.view(p.name) for p in self.root.iterdir() if p.is_dir()]
        return sorted((v for v in views if v), key=lambda v: (v["created_at"], v["id"]))[::-1]

    def data_path(self, dataset_id: str) -> Path:
        view = self.need(dataset_id)
        suffix = ".txt" if view["format"] == "text" else ".jsonl"
        return self.folder(dataset_id) / f"data{suffix}"

    def examples(self, dataset_id: str, limit: int | None = None) -> list[Any]:
        """The first `limit` examples (all without one), the file read only as far as they
        reach, a line at a time."""
        view = self.need(dataset_id)
        found: list[Any] = []
        with open(self.data_path(dataset_id), encoding="utf-8") as f:
            n = 0
            for raw in f:
                for line in newline_split(raw.removesuffix("\n")):
                    n += 1
                    if line.strip():
                        found.append(line if view["format"] == "text" else _record(line, n))
                if limit is not None and len(found) >= limit:
                    return found[:limit]
        return found

    def delete(self, dataset_id: str) -> None:
        self.need(dataset_id)
        shutil.rmtree(self.folder(dataset_id), ignore_errors=True)

    def tokenize(self, dataset_id: str, model: Path) -> dict[str, Any]:
        """Token counts per example with `model`'s tokenizer (and chat template), stored in the
        dataset's view; the share of examples longer than each of CTX_MARKS."""
        from retrograd.gguf import GGUFFile
        from retrograd.tokenizer import ChatFormat, Tokenizer, chat_template

        view = self.need(dataset_id)
        gguf = GGUFFile(model)
        tokenizer = Tokenizer.from_gguf(gguf)
        chat = None
        if view["format"] != "text":  # NOTE: a model without a template fails here, not on text
            chat = ChatFormat(tokenizer, chat_template(tokenizer, gguf.metadata, {}))
        lengths = [_length(view["format"], e, tokenizer, chat) for e in self.examples(dataset_id)]
        stats = token_stats(lengths)
        truncation = {str(c): sum(n > c for n in lengths) / len(lengths) for c in CTX_MARKS}
        view["stats"] = stats
        write_atomic(self.folder(dataset_id) / "dataset.json", json.dumps(view, indent=1))
        name = str(gguf.get("general.name") or model.name)
        return {"id": dataset_id, "tokenizer": name, "stats": stats, "truncation": truncation}


def _length(fmt: str, example: Any, tokenizer, chat) -> int:
    if fmt == "text":
        return len(tokenizer.tokenize(example, add_bos=True))
    if fmt == "chat-jsonl":
        return len(chat.encode(example["messages"], example.get("tools")).ids)
    prompt, tools = example["prompt"], example.get("tools")
    return max(len(chat.encode(prompt + example[k], tools).ids) for k in ("chosen", "rejected"))
