"""A run's rollouts as the server shows them (formats.md §9.3, §6): updates, groups, members.

Read from the [observe] directory's `feed/` (observe/feed.py folds observe.jsonl into one
index and one file per update, replayed updates already dropped), never from the run's
process. Texts exist only for the updates `[observe].every` keeps; summaries for every
update. Nothing here writes, and nothing imports torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from retrograd.observe.feed import FEED, INDEX, unscript, update_file
from retrograd.server.problems import Problem, not_found

MEMBER_SUMMARY = (
    "member",
    "seed",
    "tokens",
    "truncated",
    "turns",
    "tool_calls",
    "tool_errors",
    "advantage",
    "reward",
    "reward_raw",
    "judge_term",
    "skip_reason",
    "trained",
)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return unscript(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None  # not written yet, or replaced between a listing and this read


def _missing(what: str, where: str) -> Problem:
    return not_found(f"no {what}", where)


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, int | float) and math.isfinite(v)]


def _members(view: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for g in view["groups"] for m in g["members"]]


def update_summary(view: dict[str, Any]) -> dict[str, Any]:
    members = _members(view)
    rewards = _finite(m.get("reward") for m in members)
    trained = [m.get("trained") for m in members]
    return {
        "update": view["update"],
        "segment": view.get("segment"),
        "status": view.get("status"),
        "time": view.get("time"),
        "metrics": view.get("metrics") or {},
        "groups": len(view["groups"]),
        "rollouts": len(members),
        "texts": any(m.get("completion") is not None or m.get("messages") for m in members),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "reward_min": min(rewards, default=None),
        "reward_max": max(rewards, default=None),
        "trained_fraction": (
            sum(t is True for t in trained) / len(trained) if view.get("outcome") and trained
            else None
        ),
    }  # fmt: skip


class Trajectories:
    """The feed of one observe directory."""

    def __init__(self, directory: Path):
        self.feed = Path(directory) / FEED

    def index(self) -> dict[str, Any]:
        return _read(self.feed / INDEX) or {"run": {"segments": []}, "updates": []}

    def update(self, update: int) -> dict[str, Any]:
        view = _read(self.feed / update_file(update))
        if view is None:
            raise _missing(f"update {update} in the run's rollouts", "update")
        return view

    def overview(self, every: int | None) -> dict[str, Any]:
        index = self.index()
        run = index["run"]
        updates = []
        for row in index["updates"]:
            view = _read(self.feed / update_file(row["update"]))
            if view is not None:
                updates.append(update_summary(view))
        return {
            "observed": True,
            "algorithm": run.get("algorithm"),
            "every": every,
            "model": run.get("model"),
            "segments": run.get("segments", []),
            "skipped": sum(u["status"] == "skipped" for u in updates),
            "updates": updates,
        }

    def groups(self, update: int, cursor: int, limit: int, preview_chars: int) -> dict[str, Any]:
        view = self.update(update)
        prompts = view.get("prompts", {})
        rows = []
        for g in view["groups"][cursor : cursor + limit]:
            rewards = _finite(m.get("reward") for m in g["members"])
            mean = sum(rewards) / len(rewards) if rewards else None
            spread = (
                math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else None
            )
            rows.append(
                {
                    "group": g["group"],
                    "prompt": _preview(prompts.get(g.get("prompt")), preview_chars),
                    "members": len(g["members"]),
                    "reward_mean": mean,
                    "reward_std": spread,
                    "trained": sum(m.get("trained") is True for m in g["members"]),
                }
            )
        out: dict[str, Any] = {"summary": update_summary(view), "groups": rows}
        if cursor + limit < len(view["groups"]):
            out["next_cursor"] = str(cursor + limit)
        return out

    def group(self, update: int, group: str, member: int | None) -> dict[str, Any]:
        view = self.update(update)
        groups = view["groups"]
        if group == "-":  # the single group of a PPO update
            if len(groups) != 1:
                raise _missing("single group in this update (name one)", "group")
            found = groups[0]
        else:
            found = next((g for g in groups if str(g["group"]) == group), None)
            if found is None:
                raise _missing(f"group {group} in update {update}", "group")
        members = found["members"]
        if member is not None:
            members = [m for m in members if m.get("member") == member]
            if not members:
                raise _missing(f"member {member} in group {group}", "member")
        key = found.get("prompt")
        return {
            "update": update,
            "group": found["group"],
            "prompt": {"key": key, "messages": view.get("prompts", {}).get(key)},
            "members": [_member(m) for m in members],
        }


def _member(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": {k: m.get(k) for k in MEMBER_SUMMARY}}
    if m.get("messages") is not None:
        out["conversation"] = {
            "messages": m["messages"],
            "step_rewards": m.get("step_rewards"),
            "terminal_reward_raw": m.get("terminal_reward_raw"),
        }
    elif m.get("completion") is not None:
        out["completion"] = m["completion"]
    return out


def _preview(messages: list[dict] | None, chars: int) -> str | None:
    """The prompt's last user message, cut to `chars` characters (0: whole)."""
    if not messages:
        return None
    users = [m for m in messages if m.get("role") == "user"] or messages
    text = str(users[-1].get("content") or "")
    return text if chars == 0 or len(text) <= chars else text[:chars] + "…"
