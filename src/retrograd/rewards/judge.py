"""The command judge (formats.md §3.1): a program scores one group of answers per process.

It speaks the oneshot reward transport: one request line per member, stdin closed, one
`{"reward": x}` line per member back, exit 0. Replies are stricter than a reward program's:
any key besides "reward" is refused. How a verdict enters the reward (judge_weight, members of
weight 0 never sent, judge_failure) is the GRPO loop's business, not this module's.
`open_judge` opens either type of judge; both score a group with `score_group`, and groups
with `score_groups` (a ruler judge sends every group's requests at once).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from retrograd.errors import JudgeError
from retrograd.rewards.process import Channel
from retrograd.rewards.program import BadLine, RewardRequest, finite_number, oneshot


def judge_request(messages: Iterable[Mapping[str, Any]]) -> RewardRequest:
    """One trajectory as the judge sees it: the contents of all system and user messages joined
    with "\\n" as the prompt, those of all assistant messages as the completion; tool messages
    are left out, a missing content counts as ""."""
    parts: dict[str, list[str]] = {"system": [], "user": [], "assistant": []}
    for message in messages:
        side = parts.get(message.get("role", ""))
        if side is not None:
            side.append(message.get("content") or "")
    prompt = "\n".join(text for role in ("system", "user") for text in parts[role])
    return RewardRequest(prompt, "\n".join(parts["assistant"]))


class CommandJudge:
    """A `type = "command"` judge; `score` returns one verdict per member of a group."""

    def __init__(
        self,
        argv: list[str],
        timeout: float = 30.0,
        where: str = "[grpo.judge]",
        *,
        cwd: str | os.PathLike | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"judge timeout must be above 0, got {timeout}")
        self.timeout = timeout
        self.channel = Channel(argv, f"{where}.command", cwd=cwd, unit="group", error=JudgeError)
        self.groups = 0  # groups judged so far: the next group's number in messages

    def score(self, requests: list[RewardRequest]) -> list[float]:
        """Judge one group. Raises JudgeError (a RewardError) when the program fails."""
        if not requests:
            return []
        deadline = time.monotonic() + self.timeout
        number = self.groups
        self.groups += 1
        limit = f"timeout_secs = {self.timeout:g}"
        return oneshot(self.channel, requests, deadline, number, limit, _verdict)

    def score_group(
        self, candidates: Sequence[Any], group_id: int, rubric: str | None = None
    ) -> list[float]:
        """The RulerJudge interface: each candidate (ruler.prompt.Candidate) flattened with
        judge_request. A command judge has no rubric or final state to show; its program
        numbers groups itself, so `group_id` is unused."""
        return self.score([judge_request(c.messages) for c in candidates])

    def score_groups(
        self, jobs: Sequence[tuple[Sequence[Any], int, str | None]]
    ) -> list[list[float] | JudgeError]:
        """Groups one after the other (the program reads one group at a time): per group its
        scores, or the JudgeError it failed with."""
        out: list[list[float] | JudgeError] = []
        for job in jobs:
            try:
                out.append(self.score_group(*job))
            except JudgeError as e:
                out.append(e)
        return out

    def stats(self) -> dict[str, float]:
        """No judge/ metrics beyond those the loops count."""
        return {}


def _verdict(obj: dict[str, Any]) -> float:
    unknown = sorted(set(obj) - {"reward"})
    if unknown:
        raise BadLine(f'unknown key "{unknown[0]}" (a judge reply holds only "reward")')
    if "reward" not in obj:
        raise BadLine('missing "reward"')
    return finite_number(obj["reward"], "reward")


def command_judge(section: Any, where: str = "[grpo.judge]") -> CommandJudge:
    """The judge of a `type = "command"` [grpo.judge] or [agent.judge] section."""
    if getattr(section, "type", "command") != "command":
        raise ValueError(f"{where}: a {section.type} judge is not a command judge")
    return CommandJudge(section.command, section.timeout_secs, where)


def group_id(update: int, index: int) -> int:
    """The id a loop gives the judge for group `index` of `update`. It fixes a ruler judge's
    presentation order, so a resumed run that samples the group again sends the same prompt
    (and hits the cache). 2**20 groups an update is more than any run draws."""
    return update * (1 << 20) + index


def open_judge(section: Any, where: str, base_dir: str | os.PathLike):
    """The judge of a [grpo.judge] or [agent.judge] section: a RulerJudge for type = "ruler"
    (its cache_path already resolved against the run file's folder, `base_dir`), else a
    CommandJudge."""
    if section.type == "ruler":
        from retrograd.rewards.ruler.judge import RulerJudge

        return RulerJudge(section, where, Path(base_dir))
    return command_judge(section, where)
