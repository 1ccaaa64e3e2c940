"""`retrograd judge eval` (formats.md §3.6): how well a judge orders answers whose quality is known.

A fixture line holds one scenario: its shared opening (`context`), its candidates each with a
`label`, an optional `rubric` and each candidate's optional `env_state`. The judge scores every
fixture twice; each pass is compared with the labels and the two passes with each other
(self-consistency), by Kendall's tau and Spearman's rho. Only the ordering counts: labels and
verdicts may be on any scale. This module knows nothing of models or endpoints: it reads the
fixtures, drives a judge's `score_group` and renders what it found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd.data.sft import json_records
from retrograd.errors import DataError, JudgeError

FIXTURE_KEYS = {"scenario_id", "rubric", "context", "candidates"}
CANDIDATE_KEYS = {"messages", "label", "env_state"}
ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class FixtureCandidate:
    messages: tuple[dict, ...]  # what follows the fixture's context
    label: float
    env_state: str | None = None


@dataclass(frozen=True)
class Fixture:
    key: str  # "fixtures.jsonl:3"
    scenario_id: str
    context: tuple[dict, ...]
    candidates: tuple[FixtureCandidate, ...]
    rubric: str | None = None


def read_fixtures(path: str | Path) -> list[Fixture]:
    """Every line validated; DataError naming file and line on the first broken one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--fixtures {path}: no such file")
    fixtures: list[Fixture] = []
    seen: dict[str, str] = {}
    for place, record in json_records(path, path.read_bytes()):
        fixture = _fixture(record, place)
        if fixture.scenario_id in seen:
            raise DataError(
                f'{place}: scenario_id "{fixture.scenario_id}" was already used at '
                f"{seen[fixture.scenario_id]}"
            )
        seen[fixture.scenario_id] = place
        fixtures.append(fixture)
    if not fixtures:
        raise DataError(f"--fixtures {path}: no fixture in the file")
    return fixtures


def _fixture(record: Any, place: str) -> Fixture:
    if not isinstance(record, dict):
        raise DataError(f"{place}: a fixture line must be a JSON object")
    _known_keys(record, FIXTURE_KEYS, place, "a fixture")
    sid = record.get("scenario_id")
    if not isinstance(sid, str) or not sid.strip():
        raise DataError(f'{place}: "scenario_id" must be a non-empty string')
    rubric = record.get("rubric")
    if rubric is not None and (not isinstance(rubric, str) or not rubric.strip()):
        raise DataError(f'{place}: "rubric" must be a non-empty string')
    context = _messages(record.get("context", []), f"{place}: context", allow_empty=True)
    raw = record.get("candidates")
    if not isinstance(raw, list) or len(raw) < 2:
        raise DataError(f'{place}: "candidates" must be a list of at least 2 (a ranking needs two)')
    candidates = tuple(_candidate(c, f"{place}: candidates[{i}]") for i, c in enumerate(raw))
    return Fixture(place, sid, context, candidates, rubric)


def _candidate(obj: Any, where: str) -> FixtureCandidate:
    if not isinstance(obj, dict):
        raise DataError(f"{where} must be a JSON object")
    _known_keys(obj, CANDIDATE_KEYS, where, "a candidate")
    label = obj.get("label")
    if isinstance(label, bool) or not isinstance(label, int | float) or not math.isfinite(label):
        raise DataError(f'{where}: "label" must be a finite number, got {label!r}')
    state = obj.get("env_state")
    if state is not None and not isinstance(state, str):
        raise DataError(f'{where}: "env_state" must be a string')
    messages = _messages(obj.get("messages"), f"{where}: messages", allow_empty=False)
    return FixtureCandidate(messages, float(label), state)


def _messages(value: Any, where: str, allow_empty: bool) -> tuple[dict, ...]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise DataError(f"{where} must be a {'' if allow_empty else 'non-empty '}list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}[{i}] must be an object whose role is one of {sorted(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise DataError(f'{where}[{i}]: "content" must be a string')
    return tuple(value)


def _known_keys(obj: dict, allowed: set[str], where: str, what: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise DataError(f"{where}: unknown key {extra[0]!r} ({what} holds {sorted(allowed)})")


# -- judging and the report ------------------------------------------------------------------


@dataclass
class Row:
    """One fixture's outcome: its two passes, or the error that stopped it."""

    fixture: Fixture
    first: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)
    error: str | None = None

    def correlations(self) -> dict[str, float | None]:
        """tau and rho of the first pass against the labels and against the second pass;
        None where undefined (a failed fixture, or labels or verdicts all equal)."""
        labels = [c.label for c in self.fixture.candidates]
        out: dict[str, float | None] = {}
        for name, ref in (("labels", labels), ("repeat", self.second)):
            ok = self.error is None and _varies(ref) and _varies(self.first)
            out[f"tau_{name}"] = _finite(kendall(self.first, ref)) if ok else None
            out[f"rho_{name}"] = _finite(spearman(self.first, ref)) if ok else None
        return out


COLUMNS = ("tau_labels", "rho_labels", "tau_repeat", "rho_repeat")


def evaluate(judge, fixtures: Sequence[Fixture]) -> list[Row]:
    """Score every fixture twice. The second pass uses other group ids, so a ruler judge
    presents the candidates in another order: the repeat measures position bias and sampling
    noise together. A JudgeError marks its fixture failed; the others go on."""
    from retrograd.rewards.ruler.prompt import Candidate

    groups = [
        [Candidate([*fx.context, *c.messages], c.env_state) for c in fx.candidates]
        for fx in fixtures
    ]
    n = len(fixtures)
    jobs = [(groups[i], i, fx.rubric) for i, fx in enumerate(fixtures)]
    jobs += [(groups[i], n + i, fx.rubric) for i, fx in enumerate(fixtures)]
    results = judge.score_groups(jobs)  # every request at once, max_concurrency in flight
    rows = []
    for i, fx in enumerate(fixtures):
        row = Row(fx)
        first, second = results[i], results[n + i]
        failed = next((r for r in (first, second) if isinstance(r, JudgeError)), None)
        if failed is not None:
            row.error = str(failed)
        else:
            row.first, row.second = list(first), list(second)
        rows.append(row)
    return rows


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Means of each correlation over the fixtures where it is defined, with their counts."""
    out: dict[str, Any] = {"fixtures": len(rows), "failed": sum(r.error is not None for r in rows)}
    values = [r.correlations() for r in rows]
    for col in COLUMNS:
        defined = [v[col] for v in values if v[col] is not None]
        out[col] = sum(defined) / len(defined) if defined else None
        out[f"{col}_count"] = len(defined)
    return out


def report_json(rows: Sequence[Row]) -> dict[str, Any]:
    return {
        "summary": summary(rows),
        "fixtures": [
            {
                "scenario_id": r.fixture.scenario_id,
                "line": r.fixture.key,
                "labels": [c.label for c in r.fixture.candidates],
                "scores": r.first,
                "repeat": r.second,
                "error": r.error,
                **r.correlations(),
            }
            for r in rows
        ],
    }


def render(rows: Sequence[Row]) -> str:
    """A table, one fixture per line and the means last; '-' where a value is undefined."""
    head = ("scenario", "n", "tau/labels", "rho/labels", "tau/repeat", "rho/repeat")
    body = [
        (r.fixture.scenario_id, str(len(r.fixture.candidates)), *_cells(r.correlations()))
        for r in rows
    ]
    s = summary(rows)
    foot = ("mean", str(sum(len(r.fixture.candidates) for r in rows)), *_cells(s))
    widths = [max(len(line[i]) for line in (head, *body, foot)) for i in range(len(head))]

    def fmt(line: Sequence[str]) -> str:
        cells = [line[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [fmt(head), rule, *map(fmt, body), rule, fmt(foot)]
    for r in rows:
        if r.error is not None:
            lines.append(f"{r.fixture.key} ({r.fixture.scenario_id}): judge failed: {r.error}")
    lines.append(
        f"{len(rows)} fixture{'s' * (len(rows) != 1)}, {s['failed']} failed; labels vs the "
        f"first pass over "
        f"{s['tau_labels_count']}, the two passes over {s['tau_repeat_count']} "
        "(fixtures whose labels or verdicts are all equal have no ordering to compare)"
    )
    return "\n".join(lines)


def _cells(values: dict[str, Any]) -> list[str]:
    return ["-" if values[c] is None else f"{values[c]:+.3f}" for c in COLUMNS]


def _varies(xs: Sequence[float]) -> bool:
    return len(xs) > 1 and len(set(xs)) > 1


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def kendall(x: Sequence[float], y: Sequence[float]) -> float:
    from retrograd.rewards.ruler.strategy import kendall_tau

    return kendall_tau(list(x), list(y))


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    from retrograd.rewards.ruler.strategy import spearman_rho

    return spearman_rho(list(x), list(y))
