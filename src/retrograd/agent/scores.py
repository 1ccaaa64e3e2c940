"""From an update's rolled trajectories to the records the loss reads (formats.md §4.4):
final rewards (the environment's, or the judge's when the environment does not grade the
group; never both), the group records (the shared prompt is the members' longest common
opening; only the policy's tokens train), truncation and drops, advantages with each token's
intermediate return, and the agent/ metrics. The loop (algorithms/agent_grpo.py) calls these
in that order; nothing here touches the model.
"""

from __future__ import annotations

import logging

import numpy as np

from retrograd.agent.rollout import AgentSample
from retrograd.data.prompts import Prompt
from retrograd.errors import JudgeError, TrainingError
from retrograd.observe import names
from retrograd.rewards.judge import group_id
from retrograd.rewards.ruler.prompt import Candidate
from retrograd.rollout.records import Group, Rollout
from retrograd.rollout.shaping import NOT_IN_BASELINE, assign_advantages, zero_signal

log = logging.getLogger(__name__)
AGENT_NOT_IN_BASELINE = (*NOT_IN_BASELINE, "truncated")
USABLE = (None, "zero_signal")  # scored and kept, though a group without signal trains nothing


def score_groups(
    cfg, arena, rolled: list[list[AgentSample]], update: int, first: int = 0
) -> dict[str, float]:
    """Final rewards: the environment's when it grades the group (verify or any step reward),
    else the judge's verdict; a group is scored by one or the other, never both. `first`: the
    update's index of the first group here (a rank's block)."""
    a = cfg.agent
    env = arena.environment
    stats = {"judged": 0, "dropped": 0, "degenerate": 0, "scores": []}
    judged, jobs = [], []  # groups sent to the judge, all at once
    for g, group in enumerate(rolled):
        scenario = group[0].traj.scenario
        live = [s for s in group if not s.traj.failed]
        by_env = (env is not None and env.grades(scenario)) or any(
            s.traj.step_rewards for s in live
        )
        if by_env or arena.judge is None:
            for s in live:
                if s.traj.final_reward is None:
                    s.traj.final_reward = 0.0  # graded by step rewards alone, or no verify
            continue
        candidates = [Candidate(list(s.traj.messages), s.traj.summary) for s in live]
        judged.append((g, group, live))
        jobs.append((candidates, group_id(update, first + g), _rubric(scenario)))
    stats["judged"] = len(jobs)
    verdicts_of = arena.judge.score_groups(jobs) if jobs else []
    for (g, group, live), verdicts in zip(judged, verdicts_of, strict=True):
        if isinstance(verdicts, JudgeError):
            if a.judge_failure == "fail":
                raise verdicts
            log.warning(
                "update %d, group %d: %s; the group is dropped", update, first + g, verdicts
            )
            stats["dropped"] += 1
            for s in group:
                s.traj.final_reward = None
                s.judge_dropped = True  # type: ignore[attr-defined]
            continue
        for s, v in zip(live, verdicts, strict=True):
            s.traj.final_reward = v
        stats["scores"] += verdicts
        if a.drop_degenerate_groups and zero_signal(np.array(verdicts)):
            stats["degenerate"] += 1
            for s in group:
                s.degenerate = True  # type: ignore[attr-defined]
    if arena.judge is None:
        return {}
    judged = max(1, stats["judged"])
    scores = np.array(stats["scores"], dtype=np.float64)
    return {  # the judge's own counts (requests, latency, budgets), then the loop's
        **arena.judge.stats(),
        names.JUDGE_DROPPED_FRACTION: stats["dropped"] / judged,
        names.JUDGE_DEGENERATE_FRACTION: stats["degenerate"] / judged,
        names.JUDGE_SCORE_MEAN: float(scores.mean()) if scores.size else 0.0,
        names.JUDGE_SCORE_STD: float(scores.std()) if scores.size else 0.0,
    }


def _rubric(scenario) -> str | None:
    """metadata.rubric, the scenario's own criteria (formats.md §1.6); the judge's otherwise."""
    rubric = scenario.metadata.get("rubric") if scenario is not None else None
    return rubric if isinstance(rubric, str) and rubric.strip() else None


def group_records(samples: list[AgentSample], update: int, index: int) -> Group:
    """The group's records: the shared prompt is the members' longest common opening."""
    first = samples[0]
    common = min(s.prompt_len for s in samples)
    for s in samples[1:]:
        k = 0
        while k < common and s.seq[k] == first.seq[k]:
            k += 1
        common = k
    scenario = first.traj.scenario
    prompt = Prompt(
        scenario.key,
        scenario.index,
        tuple(first.traj.messages[: len(scenario.opening())]),
        scenario.user,
        tuple(first.seq[:common]),
    )
    members = []
    for s in samples:
        traj = s.traj
        r = Rollout(
            prompt,
            update,
            index,
            traj.member,
            traj.seed,
            tuple(s.seq[common:]),
            traj.turns[-1].text if traj.turns else "",
            traj.truncated,
            np.asarray(s.logprobs[common:], dtype=np.float32),
        )
        r.token_mask = np.asarray(s.mask[common:], dtype=np.float32)
        r.reward_raw = traj.reward
        r.extra["sample"] = s
        r.extra["returns"] = token_returns(s, common)
        if traj.failed or getattr(s, "judge_dropped", False) or traj.reward is None:
            r.skip_reason = "judge_dropped" if getattr(s, "judge_dropped", False) else "unscored"
        members.append(r)
    return Group(prompt, update, index, members)


def token_returns(s: AgentSample, common: int) -> np.ndarray | None:
    """Per token after the shared prompt: the step rewards at or after its turn, mean-centred
    over the trajectory's policy tokens; None without step rewards."""
    if not s.reward_at:
        return None
    n = len(s.seq) - common
    out = np.zeros(n, dtype=np.float64)
    for at, reward in s.reward_at:
        out[: at - common + 1] += reward
    mask = np.asarray(s.mask[common:], dtype=bool)
    if mask.any():
        out -= out[mask].mean()
    out[~mask] = 0.0
    return out


def drop_and_advantage(cfg, groups: list[Group], update: int) -> dict[str, float]:
    """Truncation, survivors and the dropped fraction, then advantages (plus returns)."""
    a = cfg.agent
    requested = sum(len(g.members) for g in groups)
    for g in groups:
        # min_reward: the group's lowest total reward, the cut trajectory's own included (a
        # cut one never counts as better than the group's worst)
        scored = [r.reward for r in g.members if r.skip_reason is None and r.reward is not None]
        for r in g.members:
            if r.skip_reason is not None or not r.truncated:
                continue
            if a.truncation == "min_reward" and scored:
                r.reward_raw, r.judge_term = min(scored), None
            else:
                r.skip_reason = "truncated"
        if any(getattr(r.extra["sample"], "degenerate", False) for r in g.members):
            g.skip("zero_signal")
        survivors = [r for r in g.members if r.skip_reason is None]
        if len(survivors) < 2:
            for r in survivors:
                r.skip_reason = "unscored"
    lost = sum(1 for g in groups for r in g.members if r.skip_reason is not None)
    if lost / requested > a.max_dropped_fraction:
        raise TrainingError(
            f"update {update}: {lost} of {requested} trajectories were lost (truncated, failed "
            f"or unscored), more than [agent].max_dropped_fraction = {a.max_dropped_fraction}; "
            "see the agent/ metrics and the log for why"
        )
    stats = assign_advantages(groups, "mean", False, AGENT_NOT_IN_BASELINE)
    for g in groups:
        for r in g.members:
            if not r.eligible:
                continue
            returns = r.extra["returns"]
            if returns is not None:
                r.token_advantages = (r.advantage + returns).astype(np.float32)
    return {
        names.ZERO_STD_GROUP_FRACTION: stats["zero_std_group_fraction"],
        names.ADVANTAGE_ABS_MEAN: stats["advantage_abs_mean"],
        names.TRAINED_FRACTION: stats["trained_fraction"],
        names.AGENT_LOST_FRACTION: lost / requested,
    }


def agent_metrics(samples: list[AgentSample]) -> dict[str, float]:
    trajs = [s.traj for s in samples]
    n = len(trajs)
    rewards = np.array([t.reward for t in trajs if t.reward is not None], dtype=np.float64)
    turns = sum(len(t.turns) for t in trajs)
    calls = sum(len(turn.calls) for t in trajs for turn in t.turns)
    errors = sum(
        1 for t in trajs for turn in t.turns for o in turn.observations if o.get("is_error")
    )
    failed = [t for t in trajs if t.failed]
    policy = [t for t in failed if (t.failure or "").startswith(("the chat template", "turn "))]
    lengths = np.array([t.n_tokens for t in trajs], dtype=np.float64)
    return {
        names.REWARD_MEAN: float(rewards.mean()) if rewards.size else 0.0,
        names.REWARD_MIN: float(rewards.min()) if rewards.size else 0.0,
        names.REWARD_MAX: float(rewards.max()) if rewards.size else 0.0,
        names.REWARD_STD: float(rewards.std()) if rewards.size else 0.0,
        names.LENGTH_MEAN: float(lengths.mean()),
        names.TRUNCATION_FRACTION: sum(t.truncated for t in trajs) / n,
        names.AGENT_TRUNCATED_FRACTION: sum(t.truncated for t in trajs) / n,
        names.AGENT_FAILED_FRACTION: len(failed) / n,
        names.AGENT_FAILED_TOOL: (len(failed) - len(policy)) / n,
        names.AGENT_FAILED_POLICY: len(policy) / n,
        names.AGENT_TOOL_ERROR_FRACTION: errors / calls if calls else 0.0,
        names.AGENT_TURNS_MEAN: turns / n,
        names.AGENT_TOKENS_MEAN: float(lengths.mean()),
        names.AGENT_CALLS_PER_TURN: calls / turns if turns else 0.0,
    }
