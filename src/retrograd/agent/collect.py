"""`retrograd collect` after the rollouts (formats.md §4.5): which traces of each scenario are
written, as tool records (§1.4) or as preference pairs (§1.5), and the counters of the rest.

Per scenario, each trace meets the filters in this order and is counted under the first it
fails: truncated, unscored (no reward: the environment failed it, or nothing graded it),
invalid_turns (a malformed call, or a call of an unknown tool), below_min_reward, unverified
(with require_verified). The traces that pass are sorted by total reward (highest first), then
policy tokens (fewest first), then member; a trace whose assistant and tool turns repeat a kept
one's is a duplicate; the first `keep` that can be written are kept (over_keep for the rest). A
record that `validate_record` (and the optional `check`: the student's chat format rendering
and parsing it back) refuses is unexportable and leaves its place to the next one.

Pairs: the best trace that passes the filters is chosen, the worst complete one that can be
written is rejected; the prompt is the opening the two share. A scenario gives no pair when no
trace passes, when nothing else can be rejected, or when the rewards differ by less than
min_gap. Knows trajectories and records, not models or environments.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd.agent.trajectory import Trajectory
from retrograd.agent.types import ERROR_PREFIX
from retrograd.data.pairs import read_pair
from retrograd.errors import ConfigError, DataError, RetrogradError
from retrograd.text import json_dumps
from retrograd.tokenizer.records import validate_record

REJECTIONS = (
    "truncated",
    "unscored",
    "invalid_turns",
    "below_min_reward",
    "unverified",
    "duplicate",
    "over_keep",
    "unexportable",
)
NO_PAIR = ("no_passing", "no_rejected", "below_min_gap")

Check = Callable[[dict], None]  # raises a RetrogradError when a record cannot be trained on


@dataclass(frozen=True)
class CollectOptions:
    keep: int = 1
    min_reward: float | None = None
    require_verified: bool = False
    raw: bool = False  # assistant turns verbatim (Trajectory.raw_messages)
    pairs: bool = False
    min_gap: float = 0.5


@dataclass
class ScenarioStats:
    id: str
    attempted: int = 0
    passed: int = 0  # traces through every filter
    kept: int = 0  # records (or pairs) written

    @property
    def pass_rate(self) -> float:
        return self.passed / self.attempted if self.attempted else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "attempted": self.attempted,
            "passed": self.passed,
            "kept": self.kept,
            "pass_rate": self.pass_rate,
        }


@dataclass
class CollectStats:
    pairs: bool = False
    attempted: int = 0
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))
    no_pair: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NO_PAIR, 0))
    scenarios: list[ScenarioStats] = field(default_factory=list)
    interrupted: bool = False
    first_unexportable: str | None = None  # why the first unexportable record was refused

    def as_json(self) -> dict[str, Any]:
        """The --report document."""
        out: dict[str, Any] = {
            "attempted": self.attempted,
            "kept": self.kept,
            "rejected": dict(self.rejected),
            "scenarios": [s.as_json() for s in self.scenarios],
            "interrupted": self.interrupted,
        }
        if self.pairs:
            out["no_pair"] = dict(self.no_pair)
        return out

    def summary(self) -> str:
        """The lines printed at the end of a collection."""
        what = "pairs" if self.pairs else "traces"
        passed = sum(s.passed for s in self.scenarios)
        lines = [
            f"{len(self.scenarios)} scenarios, {self.attempted} traces, {passed} passed the "
            f"filters, {self.kept} {what} written" + (" (interrupted)" if self.interrupted else "")
        ]
        rejected = ", ".join(f"{k} {v}" for k, v in self.rejected.items() if v)
        lines.append(f"rejected: {rejected or 'none'}")
        if self.first_unexportable:
            lines.append(f"first unexportable: {self.first_unexportable}")
        if self.pairs:
            missing = ", ".join(f"{k} {v}" for k, v in self.no_pair.items() if v)
            lines.append(f"scenarios without a pair: {missing or 'none'}")
        return "\n".join(lines)


# -- filters and order -----------------------------------------------------------------------


def rejection(t: Trajectory, opts: CollectOptions) -> str | None:
    """The first filter `t` fails, or None when it passes them all."""
    if t.truncated:
        return "truncated"
    if t.failed or t.reward is None:
        return "unscored"
    if t.invalid_turns:
        return "invalid_turns"
    if opts.min_reward is not None and t.reward < opts.min_reward:
        return "below_min_reward"
    if opts.require_verified and not (t.verification and t.verification.passed):
        return "unverified"
    return None


def rank(t: Trajectory) -> tuple:
    """Sort key: highest reward, then fewest policy tokens, then member."""
    return (-(t.reward or 0.0), t.n_tokens, t.member)


def fingerprint(t: Trajectory) -> str:
    """sha256 of the assistant and tool turns (prose, call names and arguments, observations);
    call ids and the opening are left out, so two traces that did the same thing match."""
    rows = []
    for m in t.messages:
        if m["role"] == "assistant":
            calls = [
                [c["function"]["name"], c["function"].get("arguments")]
                for c in m.get("tool_calls") or []
            ]
            rows.append(["assistant", m.get("content") or "", calls])
        elif m["role"] == "tool":
            rows.append(["tool", m.get("content") or "", bool(m.get("is_error"))])
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


# -- records ---------------------------------------------------------------------------------


def record_messages(t: Trajectory, raw: bool) -> list[dict]:
    """The conversation in tool-record shape. NOTE: a failed call's tool message keeps
    `is_error` and its content without the "ERROR: " prefix, which the record readers add;
    a prefix already there is removed so that it is not shown twice."""
    out = []
    for m in t.raw_messages() if raw else t.messages:
        m = dict(m)
        if m["role"] == "tool" and m.get("is_error"):
            m["content"] = (m.get("content") or "").removeprefix(ERROR_PREFIX)
        out.append(m)
    return out


def trace_metadata(t: Trajectory, form: str, pass_rate: float) -> dict[str, Any]:
    v = t.verification
    return {
        "scenario_id": t.scenario.id,
        "seed": t.seed,
        "member": t.member,
        "reward": t.reward,
        "verification": None if v is None else {"reward": v.reward, "passed": v.passed},
        "turns": len(t.turns),
        "generator": t.generator,
        "form": form,
        "pass_rate": pass_rate,
    }


def tool_record(t: Trajectory, raw: bool, pass_rate: float) -> dict[str, Any]:
    form = "raw" if raw else "structured"
    return {
        "tools": t.tools,
        "messages": record_messages(t, raw),
        "metadata": trace_metadata(t, form, pass_rate),
    }


def unexportable(record: dict, where: str, check: Check | None) -> str | None:
    """Why SFT could not read the record (the record rules, then the optional chat check), or
    None when it can."""
    try:
        validate_record(record, where, require_assistant=True)
        if check is not None:
            check(record)
    except RetrogradError as e:
        return str(e)
    return None


def chat_check(chat) -> Check:
    """A check for a ChatFormat: the record rules with its tool-call parser (raw turns must
    hold exactly their calls), the render, and each structured turn parsed back from its
    rendering to exactly the calls it declares."""

    def check(record: dict) -> None:
        md = record.get("metadata") or {}
        where = f"scenario {md.get('scenario_id')} member {md.get('member')}"
        messages, tools = validate_record(record, where, chat.tool_format, require_assistant=True)
        chat.encode(messages, tools or None)
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and not m.get("raw"):
                _parse_back(chat, messages, i, tools or None, where)

    return check


def _parse_back(chat, messages: list[dict], i: int, tools, where: str) -> None:
    prompt = chat.render(messages[:i], tools, add_generation_prompt=True)
    turn = chat.render(messages[: i + 1], tools)
    n = next((k for k, (a, b) in enumerate(zip(prompt, turn, strict=False)) if a != b), None)
    parsed = chat.parse(turn[len(prompt) if n is None else n :])
    want = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in messages[i].get("tool_calls") or []
    ]
    got = [(c.name, c.arguments) for c in parsed.calls]
    if parsed.errors or got != want:
        raise DataError(
            f"{where}: message {i}: the {chat.tool_format.name} parser reads "
            f"{[g[0] for g in got]} back from the rendered turn, not {[w[0] for w in want]}"
        )


# -- one scenario ----------------------------------------------------------------------------


def select_traces(
    group: list[Trajectory], opts: CollectOptions, stats: CollectStats, check: Check | None = None
) -> list[dict]:
    """The tool records to write for one scenario's traces; counts everything in `stats`."""
    sc = _scenario_stats(group, opts, stats)
    passing = sorted((t for t in group if rejection(t, opts) is None), key=rank)
    out: list[dict] = []
    seen: set[str] = set()
    for t in passing:
        fp = fingerprint(t)
        if fp in seen:
            stats.rejected["duplicate"] += 1
            continue
        if len(out) == opts.keep:
            stats.rejected["over_keep"] += 1
            continue
        record = tool_record(t, opts.raw, sc.pass_rate)
        if not _writable(t, record, check, stats):
            continue
        seen.add(fp)
        out.append(record)
    sc.kept = len(out)
    stats.kept += len(out)
    return out


def select_pair(
    group: list[Trajectory], opts: CollectOptions, stats: CollectStats, check: Check | None = None
) -> dict | None:
    """The preference pair of one scenario, or None (counted in stats.no_pair)."""
    sc = _scenario_stats(group, opts, stats)
    passing = sorted((t for t in group if rejection(t, opts) is None), key=rank)
    chosen = next(
        (t for t in passing if _writable(t, tool_record(t, opts.raw, 0.0), check, stats)), None
    )
    if chosen is None:
        stats.no_pair["no_passing"] += 1
        return None
    complete = [t for t in group if t.complete and t.reward is not None and t is not chosen]
    fp = fingerprint(chosen)
    pair = None
    for rejected in sorted(complete, key=rank, reverse=True):  # the worst first
        if fingerprint(rejected) == fp:
            continue
        record = tool_record(rejected, opts.raw, 0.0)
        if unexportable(record, _where(rejected), check) is not None:
            continue  # not counted: it is not a trace the filters passed
        pair = _pair(chosen, rejected, opts, sc.pass_rate)
        if pair is not None:
            break
    if pair is None:
        stats.no_pair["no_rejected"] += 1
        return None
    if pair["metadata"]["gap"] < opts.min_gap:
        stats.no_pair["below_min_gap"] += 1
        return None
    sc.kept = 1
    stats.kept += 1
    return pair


def _scenario_stats(group: list[Trajectory], opts: CollectOptions, stats: CollectStats):
    sc = ScenarioStats(group[0].scenario.id if group else "?", attempted=len(group))
    for t in group:
        why = rejection(t, opts)
        if why is None:
            sc.passed += 1
        else:
            stats.rejected[why] += 1
    stats.attempted += len(group)
    stats.scenarios.append(sc)
    return sc


def _writable(t: Trajectory, record: dict, check: Check | None, stats: CollectStats) -> bool:
    """Whether a passing trace's record can be written; counted (and the first reason kept)
    when it cannot."""
    why = unexportable(record, _where(t), check)
    if why is not None:
        stats.rejected["unexportable"] += 1
        stats.first_unexportable = stats.first_unexportable or why
    return why is None


def _where(t: Trajectory) -> str:
    return f"scenario {t.scenario.id} member {t.member}"


def _pair(chosen: Trajectory, rejected: Trajectory, opts, pass_rate: float) -> dict | None:
    """prompt = the shared messages up to the first assistant turn; None when the two traces
    do not share an opening that ends on a user or tool message."""
    a, b = record_messages(chosen, opts.raw), record_messages(rejected, opts.raw)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and a[n]["role"] != "assistant":
        n += 1
    if n == 0 or a[n - 1]["role"] not in ("user", "tool"):
        return None
    form = "raw" if opts.raw else "structured"
    pair = {
        "prompt": a[:n],
        "chosen": a[n:],
        "rejected": b[n:],
        "tools": chosen.tools,
        "metadata": {
            "scenario_id": chosen.scenario.id,
            "chosen": trace_metadata(chosen, form, pass_rate),
            "rejected": trace_metadata(rejected, form, pass_rate),
            "gap": (chosen.reward or 0.0) - (rejected.reward or 0.0),
            "pass_rate": pass_rate,
        },
    }
    try:
        read_pair(pair, f"{chosen.scenario.id} pair")
    except DataError:
        return None
    return pair


# -- the whole collection --------------------------------------------------------------------


def collect(
    groups: Iterable[list[Trajectory]],
    opts: CollectOptions,
    writer: RecordWriter,
    check: Check | None = None,
    stats: CollectStats | None = None,
) -> CollectStats:
    """Select from each scenario's traces as they come and write them. A KeyboardInterrupt
    marks the stats interrupted and propagates; the writer keeps what it had (the .tmp)."""
    stats = stats or CollectStats(pairs=opts.pairs)
    try:
        for group in groups:
            if opts.pairs:
                pair = select_pair(group, opts, stats, check)
                records = [pair] if pair is not None else []
            else:
                records = select_traces(group, opts, stats, check)
            for r in records:
                writer.write(r)
    except KeyboardInterrupt:
        stats.interrupted = True
        raise
    return stats


class RecordWriter:
    """JSONL written to FILE.tmp line by line (flushed) and renamed to FILE by `commit`;
    a writer closed without commit leaves the .tmp with what it has."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.count = 0
        self._f = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed in commit/close)

    def write(self, record: dict) -> None:
        self._f.write(json_dumps(record) + "\n")  # a lone surrogate stays, escaped
        self._f.flush()
        self.count += 1

    def commit(self) -> Path:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        return self.path

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def check_outputs(out: Path, force: bool, report: Path | None, inputs: dict[str, Path]) -> None:
    """Refuse, before anything loads, an --out that exists (without --force) or that would
    overwrite an input, and a --report that would overwrite an input or --out."""
    outputs = {"--out": out} | ({"--report": report} if report is not None else {})
    for flag, path in outputs.items():
        for name, src in inputs.items():
            if _same(path, src):
                raise ConfigError(f"{flag} {path}: is the {name}; write the output elsewhere")
    if report is not None and _same(report, out):
        raise ConfigError(f"--report {report}: is the --out file; name another file")
    if out.exists() and not force:
        raise ConfigError(f"--out {out}: exists; pass --force to overwrite it")
    if out.is_dir() or (report is not None and report.is_dir()):
        raise ConfigError(f"--out {out}: is a directory; name a file")


def _same(a: Path, b: Path) -> bool:
    return Path(os.path.abspath(a)) == Path(os.path.abspath(b)) or (
        a.exists() and b.exists() and os.path.samefile(a, b)
    )
