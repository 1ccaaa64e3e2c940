"""Scenario JSONL for agentic GRPO (formats.md §1.6): one task per line.

Strict: `id` (non-blank, unique), `user` (non-empty), optional `system`, optional `metadata`
(an object, copied onto every trajectory so it reaches the judge); any other key is refused,
and so is a lone surrogate anywhere (a `\\ud800` escape: no template, tokenizer or file takes it).
`metadata.env` declares a sandbox task (container and local environments): `files` (path ->
contents, written into the workspace), `setup` (shell commands run at reset), `verify`
(`{"command": [argv], "reward_on_success": 1.0}`), `summary` (argv whose output is the terminal
state a judge sees) and `toolset` (one of the selectable toolsets). The declaration is typed and
checked for every line before the model loads; a key it does not know is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrograd.data.sft import json_records
from retrograd.errors import DataError
from retrograd.text import is_text

KEYS = {"id", "user", "system", "metadata"}
ENV_KEYS = {"files", "setup", "verify", "summary", "toolset"}
VERIFY_KEYS = {"command", "reward_on_success"}


@dataclass(frozen=True)
class Verify:
    command: tuple[str, ...]
    reward_on_success: float = 1.0


@dataclass(frozen=True)
class EnvTask:
    """metadata.env: what a sandbox environment prepares, checks and shows for a scenario."""

    files: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    verify: Verify | None = None
    summary: tuple[str, ...] | None = None
    toolset: str | None = None


@dataclass(frozen=True)
class Scenario:
    key: str  # "scenarios.jsonl:3"
    index: int  # 0-based line among the scenarios
    id: str
    user: str
    system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    env: EnvTask | None = None

    def opening(self, system_suffix: str = "") -> list[dict]:
        """The messages every trajectory of this scenario starts from; system_suffix is
        appended to the system message, or makes one."""
        out = []
        system = (self.system or "") + system_suffix
        if system:
            out.append({"role": "system", "content": system})
        out.append({"role": "user", "content": self.user})
        return out

    def as_json(self) -> dict[str, Any]:
        """The scenario object as written in the file (what an HTTP environment's reset gets)."""
        out: dict[str, Any] = {"id": self.id, "user": self.user}
        if self.system is not None:
            out["system"] = self.system
        out["metadata"] = self.metadata
        return out


@dataclass(frozen=True)
class ScenarioFile:
    path: Path
    scenarios: tuple[Scenario, ...]
    fingerprint: str  # sha256 of the bytes

    def __len__(self) -> int:
        return len(self.scenarios)


def read_scenarios(path: str | Path, where: str = "[agent].scenarios") -> ScenarioFile:
    """Every line checked; DataError naming file and line on the first broken one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{where} = {path}: no such scenario file")
    raw = path.read_bytes()
    out: list[Scenario] = []
    seen: dict[str, str] = {}
    for place, record in json_records(path, raw):
        s = parse_scenario(record, place, len(out))
        if s.id in seen:
            raise DataError(f'{place}: id "{s.id}" is used by {seen[s.id]} already')
        seen[s.id] = place
        out.append(s)
    if not out:
        raise DataError(f"{where} = {path}: no scenario in the file")
    return ScenarioFile(path, tuple(out), hashlib.sha256(raw).hexdigest())


def parse_scenario(record: Any, place: str, index: int = 0) -> Scenario:
    if not isinstance(record, dict):
        raise DataError(f"{place}: a scenario must be a JSON object")
    if not is_text(json.dumps(record, ensure_ascii=False)):  # rendered, tokenized, written
        raise DataError(f"{place}: holds a lone surrogate (a \\ud800 escape), which is not text")
    extra = sorted(set(record) - KEYS)
    if extra:
        raise DataError(
            f'{place}: unknown key "{extra[0]}"; a scenario holds id, user, system and '
            "metadata (put anything else under metadata)"
        )
    sid = record.get("id")
    if not isinstance(sid, str) or not sid.strip():
        raise DataError(f'{place}: "id" must be a non-blank string')
    user = record.get("user")
    if not isinstance(user, str) or not user:
        raise DataError(f'{place}: "user" must be a non-empty string')
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f'{place}: "system" must be a string')
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DataError(f'{place}: "metadata" must be an object')
    env = _env(metadata["env"], f"{place}: metadata.env") if "env" in metadata else None
    return Scenario(place, index, sid, user, system, metadata, env)


def _strings(value: Any, where: str, allow_empty: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where} must be a list of strings")
    if not value and not allow_empty:
        raise DataError(f"{where} must not be empty")
    return tuple(value)


def _env(env: Any, where: str) -> EnvTask:
    if not isinstance(env, dict):
        raise DataError(f"{where} must be an object")
    extra = sorted(set(env) - ENV_KEYS)
    if extra:
        raise DataError(
            f'{where}: unknown key "{extra[0]}"; it holds {", ".join(sorted(ENV_KEYS))}'
        )
    files = env.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise DataError(f"{where}.files must be an object of path -> contents (strings)")
    for name in files:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise DataError(f'{where}.files: "{name}" must be a relative path inside the workspace')
    setup = _strings(env.get("setup", []), f"{where}.setup", allow_empty=True)
    verify = None
    if "verify" in env:
        v = env["verify"]
        if not isinstance(v, dict):
            raise DataError(f'{where}.verify must be an object {{"command": [...]}}')
        extra = sorted(set(v) - VERIFY_KEYS)
        if extra:
            raise DataError(f'{where}.verify: unknown key "{extra[0]}"')
        if "command" not in v:
            raise DataError(f'{where}.verify: missing "command"')
        reward = v.get("reward_on_success", 1.0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise DataError(f"{where}.verify.reward_on_success must be a number")
        verify = Verify(_strings(v["command"], f"{where}.verify.command"), float(reward))
    summary = None
    if "summary" in env:
        summary = _strings(env["summary"], f"{where}.summary")
    toolset = env.get("toolset")
    if toolset is not None and (not isinstance(toolset, str) or not toolset):
        raise DataError(f"{where}.toolset must be a toolset name")
    return EnvTask(dict(files), setup, verify, summary, toolset)


def scenario_json_lines(scenarios: list[dict]) -> bytes:
    """Scenario objects as JSONL bytes (what `scenarios generate` writes)."""
    return b"".join(json.dumps(s, ensure_ascii=False).encode() + b"\n" for s in scenarios)
