"""The viewer's data: `feed/`, rebuilt from observe.jsonl's records (formats.md §6).

The static viewer opens as a file:// page, where Chromium refuses fetch() of JSON: every feed
file is therefore a script that hands one JSON value to `retrogradFeed(...)`. `index.js` holds
the run, its segments and one summary row per update (the curves and the list); each
`update-NNNNNN.js` holds one update's groups, members, texts and the prompts they answer.

A resumed run appends a `run` record with a later segment: updates after its
`resumed_from_update` are replayed, so the earlier segment's rows and files for them go (the
log keeps them). This module knows records only as JSON values, never the training loop's
objects; files are written under a temporary name and renamed over the old ones.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from retrograd.gguf.writer import temporary_name

FEED = "feed"
INDEX = "index.js"
CALLBACK = "retrogradFeed"

# Curves the viewer draws: the metric the loop logged (formats.md §7.2), else a value computed
# from the update's rollout records, else none.
CURVES = {
    "reward": "reward/mean",
    "trained": "batch/trained_fraction",
    "length": "completions/length_mean",
    "kl": "policy/kl",
}
MEMBER_FIELDS = (
    "member",
    "seed",
    "completion",
    "tokens",
    "truncated",
    "reward",
    "advantage",
    "trained",
    "skip_reason",
    "reward_raw",
    "judge_term",
    # agentic trajectories
    "messages",
    "step_rewards",
    "terminal_reward_raw",
    "turns",
    "tool_calls",
    "tool_errors",
    "finish",
    "failure",
)


def update_file(update: int) -> str:
    return f"update-{update:06d}.js"


def script(payload: dict[str, Any]) -> str:
    # NOTE: ASCII only: a classic script is decoded in the page's charset, whatever it holds.
    return f"{CALLBACK}({json.dumps(payload, separators=(',', ':'))});\n"


def unscript(text: str) -> dict[str, Any]:
    """The payload of a feed file (`script`'s inverse)."""
    return json.loads(text.strip().removeprefix(f"{CALLBACK}(").removesuffix(");"))


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` under a temporary name, then rename it into place.

    NOTE: not fsync'd: a feed file is derived from observe.jsonl and rebuilt when a run
    reopens the directory; the rename alone keeps a reader from seeing half a file.
    """
    tmp = temporary_name(path)
    try:
        tmp.write_text(text, encoding="ascii")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of an observe.jsonl, skipping a line a killed writer left unfinished."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


class Feed:
    """Folds records into the viewer's files. `add` each record, then `write` the changes.

    Only the updates still open (no `update` record yet) and the newest one stay in memory
    with their texts; an older update's late record reads its file back.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory) / FEED
        self.run: dict[str, Any] = {"segments": []}
        self.rows: dict[int, dict[str, Any]] = {}  # update -> summary row of index.js
        self.views: dict[int, dict[str, Any]] = {}  # update -> its groups, in memory
        self.prompts: dict[str, list] = {}
        self.generation = 0  # bumped by each write that changes something
        self._changed: set[int] = set()
        self._removed: set[int] = set()
        self._index_changed = False

    @classmethod
    def rebuild(cls, directory: str | Path, log: str | Path) -> Feed:
        """A feed made from every record of `log`; files of updates it lacks are removed."""
        feed = cls(directory)
        for record in read_records(Path(log)):
            feed.add(record)
            if record.get("type") == "update":
                feed.write()  # keeps only recent updates in memory
        feed.write(force_index=True)
        if feed.dir.exists():
            keep = {INDEX} | {update_file(u) for u in feed.rows}
            for path in feed.dir.iterdir():
                if path.name not in keep and path.name.endswith(".js"):
                    path.unlink()
        return feed

    # Folding records

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "run":
            self._run(record)
        elif kind == "prompt":
            self.prompts[record["key"]] = record["messages"]
        elif kind == "rollout":
            self._rollout(record)
        elif kind == "outcome":
            self._outcome(record)
        elif kind == "update":
            self._update(record)

    def _run(self, record: dict[str, Any]) -> None:
        replayed_after = record.get("resumed_from_update") or 0
        for update in [u for u in self.rows if u > replayed_after]:
            del self.rows[update]
            self.views.pop(update, None)
            self._changed.discard(update)
            self._removed.add(update)
        for key in ("algorithm", "model", "params"):
            self.run[key] = record.get(key)
        self.run["segments"].append(
            {
                "segment": record.get("segment"),
                "time": record.get("time"),
                "resumed_from_update": record.get("resumed_from_update"),
            }
        )
        self._index_changed = True

    def _view(self, update: int, record: dict[str, Any]) -> dict[str, Any]:
        view = self.views.get(update)
        if view is None:
            path = self.dir / update_file(update)
            if update in self.rows and path.exists():
                view = unscript(path.read_text(encoding="ascii"))
                view["groups"] = {
                    g["group"]: g | {"members": {m["member"]: m for m in g["members"]}}
                    for g in view["groups"]
                }
            else:
                view = {"update": update, "status": None, "metrics": {}, "groups": {}}
            self.views[update] = view
        view["segment"] = record.get("segment")
        view["time"] = record.get("time")
        self._changed.add(update)
        self._removed.discard(update)
        return view

    def _rollout(self, record: dict[str, Any]) -> None:
        view = self._view(record["update"], record)
        group = view["groups"].setdefault(
            record["group"], {"group": record["group"], "prompt": record.get("prompt")}
        )
        members = group.setdefault("members", {})
        members[record["member"]] = {k: record.get(k) for k in MEMBER_FIELDS}

    def _outcome(self, record: dict[str, Any]) -> None:
        view = self._view(record["update"], record)
        for entry in record.get("entries", []):
            group = view["groups"].get(entry.get("group"), {})
            member = group.get("members", {}).get(entry.get("member"))
            if member is not None:  # its rollout record may have been dropped
                member["trained"] = entry.get("trained")
                member["skip_reason"] = entry.get("skip_reason")
        view["outcome"] = True

    def _update(self, record: dict[str, Any]) -> None:
        view = self._view(record["update"], record)
        view["status"] = record.get("status")
        view["metrics"] = record.get("metrics") or {}

    # Summaries and files

    def summary(self, view: dict[str, Any]) -> dict[str, Any]:
        """One row of the update list: status, sizes, and the four curves' values."""
        members = [m for g in view["groups"].values() for m in g.get("members", {}).values()]
        computed = {
            "reward": mean(m["reward"] for m in members),
            "trained": (
                sum(m["trained"] is True for m in members) / len(members)
                if members and view.get("outcome")
                else None
            ),
            "length": mean(m["tokens"] for m in members),
            "kl": None,
        }
        metrics = view["metrics"]
        curves = {c: metrics.get(name, computed[c]) for c, name in CURVES.items()}
        return {
            "update": view["update"],
            "segment": view.get("segment"),
            "time": view.get("time"),
            "status": view["status"],
            "groups": len(view["groups"]),
            "members": len(members),
            "texts": any(m["completion"] is not None for m in members),
            "rev": self.generation,
            **curves,
        }

    def payload(self, view: dict[str, Any]) -> dict[str, Any]:
        groups = []
        for g in sorted(view["groups"].values(), key=lambda g: g["group"]):
            members = sorted(g.get("members", {}).values(), key=lambda m: m["member"])
            groups.append(g | {"members": members})
        keys = {g["prompt"] for g in groups}
        prompts = {k: self.prompts[k] for k in sorted(keys) if k in self.prompts}
        return view | {"rev": self.generation, "groups": groups, "prompts": prompts}

    def write(self, *, force_index: bool = False) -> None:
        """Write what changed since the last call: update files, then the index."""
        if not (self._changed or self._removed or self._index_changed or force_index):
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.generation += 1
        for update in sorted(self._changed):
            view = self.views[update]
            self.rows[update] = self.summary(view)
            replace_text(self.dir / update_file(update), script(self.payload(view)))
        for update in self._removed:
            (self.dir / update_file(update)).unlink(missing_ok=True)
        index = {
            "kind": "index",
            "generation": self.generation,
            "run": self.run,
            "updates": [self.rows[u] for u in sorted(self.rows)],
        }
        replace_text(self.dir / INDEX, script(index))
        self._changed.clear()
        self._removed.clear()
        self._index_changed = False
        self._evict()

    def _evict(self) -> None:
        newest = max(self.views, default=0)
        for update in [u for u, v in self.views.items() if v["status"] and u != newest]:
            del self.views[update]
