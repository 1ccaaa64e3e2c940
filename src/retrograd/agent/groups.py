"""An update's groups of trajectories: rolled in waves (whole groups, at most
generation_concurrency trajectories at once), each rank rolling and scoring a block of the
scenarios (rollout/spread.py), every rank holding all the records; and the held-out
trajectories an evaluation rolls. The loop (algorithms/agent_grpo.py) and `retrograd collect`
use these; the rolling itself is rollout.py's, the scoring scores.py's.

Every random choice is a pure function of [agent].seed: trajectory j of the scenario drawn at
cursor c in update u is sampled from derive_seed(seed, "sample", u, c, j); held-out scenario i
from derive_seed(seed, "evaluate", 0, i), the same for the whole run.
"""

from __future__ import annotations

import time

from retrograd.agent.rollout import AgentRoller, AgentSample
from retrograd.agent.scenarios import Scenario
from retrograd.agent.scores import agent_metrics, group_records, score_groups
from retrograd.observe import names
from retrograd.rollout import spread
from retrograd.rollout.sample import held_out
from retrograd.seeds import SAMPLE, derive_seed

EVALUATE = "evaluate"


def seeds(agent, update: int, cursor: int, k: int) -> list[int]:
    """The k trajectories' seeds of the scenario drawn at `cursor` in `update`."""
    return [derive_seed(agent.seed, SAMPLE, update, cursor, j) for j in range(k)]


def concurrency(cfg) -> int:
    """Trajectories sampled at once: [training].generation_concurrency, else an update's
    (every trajectory of it, up to 256); the sampler's generation batch derives from it."""
    t, a = cfg.training, cfg.agent
    return t.generation_concurrency or min(a.scenarios_per_update * a.group_size, 256)


def roll_waves(cfg, roller: AgentRoller, wanted: list[tuple[Scenario, list[int]]]):
    """Groups rolled in waves of at most generation_concurrency trajectories (whole groups)."""
    t = cfg.training
    size = max(len(s) for _, s in wanted)
    concurrency = t.generation_concurrency or min(len(wanted) * size, 256)
    env = cfg.agent.environment
    if env is not None and env.type == "container":  # a wave holds its containers throughout
        concurrency = min(concurrency, env.pool.max_live)
    per_wave = max(1, concurrency // size)
    out: list[list[AgentSample]] = []
    for w in range(0, len(wanted), per_wave):
        out += roller.roll(wanted[w : w + per_wave])
    return out


def roll_and_score(cfg, roller, arena, batch, update, ranks):
    """The update's groups and trajectories and their metrics: each rank rolls out and scores
    a block of the scenarios; every rank gets all the groups (the trajectories ride in their
    records). Timings, the judge's counters and the environment's metrics are this rank's."""
    a = cfg.agent
    t0 = time.perf_counter()
    gen0, tool0 = roller.generation_seconds, roller.tool_seconds
    pre0, reuse0 = roller.decoder.prefilled, roller.decoder.reused
    judged: dict = {}
    judge_seconds = 0.0

    def roll(part, lo):
        nonlocal judge_seconds
        wanted = [(s, seeds(a, update, c, a.group_size)) for c, s in part]
        rolled = roll_waves(cfg, roller, wanted) if wanted else []
        t1 = time.perf_counter()
        judged.update(score_groups(cfg, arena, rolled, update, first=lo))
        judge_seconds = time.perf_counter() - t1
        return [group_records(samples, update, lo + g) for g, samples in enumerate(rolled)]

    groups = spread.spread(batch, roll, ranks)
    rollout_seconds = time.perf_counter() - t0 - judge_seconds
    samples = [r.extra["sample"] for grp in groups for r in grp.members]
    prefilled = roller.decoder.prefilled - pre0
    reused = roller.decoder.reused - reuse0
    values = agent_metrics(samples)
    values.update(
        {
            names.ROLLOUT_SECONDS: rollout_seconds,
            names.GENERATION_SECONDS: roller.generation_seconds - gen0,
            names.TOOL_SECONDS: roller.tool_seconds - tool0,
            names.JUDGE_SECONDS: judge_seconds,
            names.GENERATION_PREFILLED_TOKENS: float(prefilled),
            names.GENERATION_PREFILL_REUSE: reused / max(1, reused + prefilled),
        }
    )
    values.update(judged)
    env = arena.environment
    if env is not None:
        values.update(env.metrics())
    return groups, samples, values


def held_rewards(cfg, roller, held_file) -> list[float]:
    """One trajectory per held-out scenario, seeds fixed for the run: their rewards, each
    rank rolling out a block of the scenarios."""
    scenarios = held_out(list(held_file.scenarios), cfg.evaluation.max_examples)

    def roll(part, lo):
        drawn = [derive_seed(cfg.agent.seed, EVALUATE, 0, lo + i) for i in range(len(part))]
        wanted = [(s, [seed]) for s, seed in zip(part, drawn, strict=True)]
        return [(s.traj.reward or 0.0) for [s] in roll_waves(cfg, roller, wanted)] if part else []

    return spread.spread(scenarios, roll, spread.current_world())
