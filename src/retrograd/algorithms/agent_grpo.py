"""Agentic GRPO: group-relative policy optimisation over multi-turn, tool-using trajectories.

Each update: 1. choose scenarios  2. roll a group of trajectories per scenario in lockstep
(rollout/agent.py)  3. score each group by its environment (verify, step rewards) or, when the
environment does not grade it, by the judge  4. drop what cannot train, advantages  5. reference
scores  6. epochs_per_update optimizer passes  7. report, observe, evaluate, checkpoint.
The variant (formats.md §4.4; the GRPO loop's docstring says the shared parts):
- only the policy's own tokens train: prompt, observations and template framing are context;
- a trajectory's reward is its final reward (verify's, or the judge's verdict) plus its step
  rewards, undiscounted; a token's advantage is the group advantage (reward − group mean, not
  divided by the standard deviation) plus its intermediate return (the step rewards at or
  after its turn), mean-centred within the trajectory;
- truncation = "drop" leaves a cut trajectory out of the baseline and the loss; "min_reward"
  trains it at its group's lowest complete reward. Failed (environment) and unscored
  trajectories never train; a group with fewer than two survivors is dropped; more than
  max_dropped_fraction of the requested trajectories lost stops the run; fewer than two
  trainable trajectories fails the update unless skip_empty_updates;
- the loss sums token terms and divides by a constant budget per trajectory,
  min(max_turns × max_new_tokens_per_turn, max_trajectory_tokens), so its scale does not
  follow the lengths sampled (re-tune the learning rate when the limits change);
- every random choice is a pure function of agent.seed and the update: scenario order a
  permutation per pass, trajectory j of the scenario drawn at cursor c in update u sampled from
  derive_seed(agent.seed, "sample", u, c, j); resume needs the update and the cursor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.agent.scenarios import Scenario, ScenarioFile, read_scenarios
from retrograd.agent.trajectory import Trajectory
from retrograd.agent.world import World
from retrograd.algorithms import context, outputs, persist
from retrograd.algorithms.evaluate import Patience, report_rewards
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition
from retrograd.data.sft import permutation
from retrograd.errors import ConfigError, JudgeError, TrainingError
from retrograd.losses.policy import policy_loss
from retrograd.observe import names
from retrograd.observe.rollouts import ObserveWriter
from retrograd.optim import base_lr, build_optimizer, lr_at
from retrograd.rewards.judge import judge_request
from retrograd.rollout.agent import AgentRoller, AgentSample, Limits
from retrograd.rollout.passes import fanout, frozen_logprobs, padded, pieces, score
from retrograd.rollout.records import Group, Prompt, Rollout
from retrograd.rollout.sample import held_out
from retrograd.rollout.shaping import NOT_IN_BASELINE, assign_advantages, zero_signal
from retrograd.sampling import Sampler
from retrograd.seeds import SAMPLE, derive_seed
from retrograd.trainable.plan import build_lora_plan, check_mode, trained_parameters

log = logging.getLogger(__name__)
EVALUATE = "evaluate"
# [agent] keys that change no step: a resumed run may change them
_NOT_TRAJECTORY = {
    "scenarios",
    "updates",
    "max_dropped_fraction",
    "skip_empty_updates",
    "collect_api",
    "scenario_generation",
    "judge",
}
AGENT_NOT_IN_BASELINE = (*NOT_IN_BASELINE, "truncated")
USABLE = (None, "zero_signal")  # scored and kept, though a group without signal trains nothing


@dataclass
class Position:
    update: int = 0
    cursor: int = 0  # scenarios drawn so far
    global_step: int = 0

    def mark(self) -> persist.Mark:
        return persist.Mark(
            self.global_step,
            update=self.update,
            dataset=DatasetPosition(0, self.cursor, {"update": self.update}),
            extra={},
        )

    @classmethod
    def restored(cls, state) -> Position:
        return cls(state.progress.update, state.dataset.index, state.global_step)


@dataclass
class AgentResult:
    output: Path
    updates: int
    global_step: int
    stopped: str | None
    seconds: float
    rewards: list[float] = field(default_factory=list)  # mean reward of each update
    evals: list[tuple[int, float]] = field(default_factory=list)
    best_eval: float | None = None
    skipped: int = 0  # updates with fewer than two usable trajectories (skip_empty_updates)
    no_signal: int = 0  # updates whose every group scored alike


class ScenarioStream:
    """Scenarios in the run's order: a fresh permutation per pass over the file."""

    def __init__(self, scenarios: tuple[Scenario, ...], seed: int):
        self.scenarios, self.seed = scenarios, seed

    def at(self, cursor: int) -> Scenario:
        n = len(self.scenarios)
        cycle, j = divmod(cursor, n)
        return self.scenarios[permutation(n, self.seed, cycle)[j]]

    def draw(self, cursor: int, n: int) -> list[tuple[int, Scenario]]:
        return [(cursor + i, self.at(cursor + i)) for i in range(n)]


def total_steps(cfg) -> int:
    return cfg.agent.updates * cfg.agent.epochs_per_update


def check_available(cfg) -> None:
    """What this version cannot honour, refused before anything loads."""
    a = cfg.agent
    if a.judge is not None and a.judge.type != "command":
        raise ConfigError(
            f'[agent.judge].type = "{a.judge.type}": not available in this version (the LLM '
            'judge comes later; use type = "command", or an environment that verifies)'
        )
    context.check_rollout_keys(cfg.training, "agent_grpo")


def _check_manifest(path: Path) -> None:
    from retrograd.agent.generate import check_manifest

    check_manifest(path)


# -- the loop ----------------------------------------------------------------------------------


def run_agent_grpo(cfg, *, resume=None, sinks=None, run_file=None) -> AgentResult:
    started = time.perf_counter()
    a, training = cfg.agent, cfg.training
    run_dir = Path(run_file).resolve().parent if run_file else Path.cwd()
    # 1. build: everything that can be checked is checked before the model loads
    check_available(cfg)
    check_mode(training.trainable)
    outputs.check_outputs(cfg, run_file)
    scenario_file = read_scenarios(a.scenarios)
    _check_manifest(scenario_file.path)
    held_file = read_scenarios(cfg.evaluation.data, "[evaluation].data") if cfg.evaluation else None
    world = World(cfg, run_dir)
    try:
        world.check(scenario_file, held_file)
        return _train(cfg, world, scenario_file, held_file, resume, sinks, run_file, started)
    finally:
        world.close()


def _train(cfg, world, scenario_file, held_file, resume, sinks, run_file, started):
    a, training = cfg.agent, cfg.training
    model = context.load_model(cfg)
    context.preflight_check(model, training, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, training)
    chat = context.chat_format(model, a.template_variables)
    init = cfg.lora.init_adapter if cfg.lora else None
    plan, adapters = build_lora_plan(model.decoder, cfg.lora, init_adapter=init)
    named = trained_parameters(adapters)
    params = [p for _, p in named]
    optimizer = build_optimizer(params, training, cfg.optimizer)
    rate, steps = base_lr(training, cfg.optimizer), total_steps(cfg)
    reference = context.reference(cfg, model, adapters)
    sampler = Sampler(
        model.decoder, model.tokenizer, fast=training.fast_sampling_context, max_len=training.ctx
    )
    limits = Limits.of(a, training.ctx)
    roller = AgentRoller(
        sampler,
        chat,
        limits,
        environment=world.environment,
        mcp=world.mcp,
        system_suffix=a.system_suffix,
        generator_name=Path(cfg.model.path).name,
    )
    stream = ScenarioStream(scenario_file.scenarios, a.seed)
    settings = {
        "agent": a.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        "fast_sampling_context": training.fast_sampling_context,
        "reference": context.reference_id(cfg),
        "world": world.signature(),
    }
    fingerprints = {
        "scenarios": scenario_file.fingerprint,
        "eval": held_file.fingerprint if held_file else None,
    }
    run = persist.RunIdentity.of(cfg, model.config.name, fingerprints, plan, settings)
    sinks = sinks or persist.Sinks.quiet()

    # 2. resume
    pos = Position()
    patience = Patience(
        cfg.evaluation.patience if cfg.evaluation else None,
        cfg.evaluation.min_delta if cfg.evaluation else 0.0,
    )
    found = persist.find_resume(cfg, resume)
    if found is not None:
        pos = Position.restored(persist.restore(found, run, named, optimizer, patience))
    n = len(scenario_file)
    held_n = len(held_file) if held_file else 0
    sinks.start(
        cfg,
        model,
        plan,
        a.updates,
        data=(scenario_file.path, f"{scenario_file.path.name}: {n} scenarios"),
        held=(held_file.path, f"{held_file.path.name}: {held_n} scenarios") if held_file else None,
        iterations=a.updates,
        initial_step=pos.global_step,
        unit="update",
        initial_position=pos.update,
    )
    if found is not None:
        sinks.resumed(found[1], pos.global_step)
    result = AgentResult(Path(cfg.output.path), pos.update, pos.global_step, None, 0.0)
    observe = ObserveWriter.open(
        cfg.observe,
        algorithm="agent_grpo",
        model=cfg.model.path,
        params=settings,
        resumed_from_update=pos.update if found is not None else None,
        console=getattr(sinks, "console", None),
    )
    try:
        # 3. updates
        for update in range(pos.update + 1, a.updates + 1):
            t0 = time.perf_counter()
            batch = stream.draw(pos.cursor, a.scenarios_per_update)
            cursor = pos.cursor + len(batch)
            groups, samples, values = _roll_and_score(cfg, roller, world, batch, update)
            values.update(_drop_and_advantage(cfg, groups, update))
            trained = [r for grp in groups for r in grp.members if r.eligible]
            usable = sum(1 for grp in groups for r in grp.members if r.skip_reason in USABLE)
            if observe is not None:
                observe.rollouts(update, groups)
                observe.selection(update, groups)
            before = pos.global_step
            if usable < 2:
                if not a.skip_empty_updates:
                    raise TrainingError(
                        f"update {update}: {usable} trajectories are usable (at least 2 needed); "
                        "see agent/failed_fraction and agent/truncated_fraction, or set "
                        "[agent].skip_empty_updates = true"
                    )
                for grp in groups:
                    grp.skip("update_skipped")
                trained = []
                result.skipped += 1
            elif not trained:  # usable, but every group scored alike: nothing to learn
                result.no_signal += 1
            if trained:
                t1 = time.perf_counter()
                if a.kl_coefficient > 0:
                    refs = frozen_logprobs(reference, model.decoder, trained, training)
                    for r, lp in zip(trained, refs, strict=True):
                        r.ref_logprobs = lp
                values[names.SCORING_SECONDS] = time.perf_counter() - t1
                t1 = time.perf_counter()
                for _ in range(a.epochs_per_update):
                    lr = lr_at(
                        pos.global_step, steps, rate, training.lr_scheduler, training.warmup_steps
                    )
                    out = _epoch(cfg, model.decoder, trained, limits.loss_budget)
                    checked_step(
                        params,
                        optimizer,
                        training.max_grad_norm,
                        lr,
                        out[names.TOTAL_LOSS],
                        f"update {update}",
                    )
                    pos.global_step += 1
                    values.update(out)
                    values[names.LEARNING_RATE] = lr
                values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
                for r in trained:
                    r.trained = True
            for grp in groups:
                for r in grp.members:
                    if r.trained is None:
                        r.trained = False
            values[names.KL_COEFFICIENT] = a.kl_coefficient
            pos = Position(update, cursor, pos.global_step)
            if observe is not None:
                observe.outcome(update, groups)
                values[names.OBSERVE_DROPPED] = observe.dropped_batches
                observe.update(update, "completed" if trained else "skipped", values)
            tokens = sum(len(s.seq) for s in samples)
            epoch = max(cursor - 1, 0) // n + 1
            sinks.step(
                pos.global_step, epoch, values, tokens, time.perf_counter() - t0, position=update
            )
            result.rewards.append(values[names.REWARD_MEAN])
            if held_file is not None and _evaluate_now(cfg, update):
                improved = _evaluate(cfg, roller, held_file, pos, patience, result, sinks)
                if improved:
                    persist.save_best(
                        cfg, run, pos.mark(), named, optimizer, plan, patience, steps, sinks
                    )
            persist.maybe_checkpoint(
                cfg, run, pos.mark(), named, optimizer, plan, patience, steps, sinks, before
            )
            if patience.stop:
                result.stopped = "patience"
                break
    finally:
        roller.close()
        if observe is not None:
            observe.close()
    # 4. export
    persist.export_or_keep(
        cfg, model, run_file, run, pos.mark(), named, optimizer, plan, adapters, patience, steps
    )
    result.updates, result.global_step = pos.update, pos.global_step
    result.best_eval = -patience.best if patience.best != float("inf") else None
    result.seconds = time.perf_counter() - started
    sinks.finish(
        {
            "adapter": str(result.output),
            "mean reward, first -> last update": _first_last(result.rewards),
            "updates skipped (fewer than 2 usable trajectories)": result.skipped,
            "updates without signal (every group scored alike)": result.no_signal,
            "stopped early": result.stopped or "no",
        }
    )
    return result


# -- rollouts, scores and records --------------------------------------------------------------


def _seeds(cfg, update: int, cursor: int, k: int) -> list[int]:
    return [derive_seed(cfg.agent.seed, SAMPLE, update, cursor, j) for j in range(k)]


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


def _roll_and_score(cfg, roller, world, batch, update):
    a = cfg.agent
    t0 = time.perf_counter()
    gen0, tool0 = roller.generation_seconds, roller.tool_seconds
    pre0, reuse0 = roller.decoder.prefilled, roller.decoder.reused
    wanted = [(s, _seeds(cfg, update, c, a.group_size)) for c, s in batch]
    rolled = roll_waves(cfg, roller, wanted)
    rollout_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    judged = _score(cfg, world, rolled, update)
    judge_seconds = time.perf_counter() - t1
    groups = [_group(samples, update, g) for g, samples in enumerate(rolled)]
    samples = [s for grp in rolled for s in grp]
    prefilled = roller.decoder.prefilled - pre0
    reused = roller.decoder.reused - reuse0
    values = _agent_metrics(samples)
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
    env = world.environment
    if env is not None and hasattr(env, "metrics"):
        values.update(env.metrics())
    return groups, samples, values


def _score(cfg, world, rolled: list[list[AgentSample]], update: int) -> dict[str, float]:
    """Final rewards: the environment's when it grades the group (verify or any step reward),
    else the judge's verdict; a group is scored by one or the other, never both."""
    a = cfg.agent
    env = world.environment
    stats = {"judged": 0, "dropped": 0, "degenerate": 0, "scores": []}
    for g, group in enumerate(rolled):
        scenario = group[0].traj.scenario
        live = [s for s in group if not s.traj.failed]
        by_env = (env is not None and env.grades(scenario)) or any(
            s.traj.step_rewards for s in live
        )
        if by_env or world.judge is None:
            for s in live:
                if s.traj.final_reward is None:
                    s.traj.final_reward = 0.0  # graded by step rewards alone, or no verify
            continue
        stats["judged"] += 1
        requests = [judge_request(s.traj.messages) for s in live]
        try:
            verdicts = world.judge.score(requests)
        except JudgeError as e:
            if a.judge_failure == "fail":
                raise
            log.warning("update %d, group %d: %s; the group is dropped", update, g, e)
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
    if world.judge is None:
        return {}
    judged = max(1, stats["judged"])
    scores = np.array(stats["scores"], dtype=np.float64)
    return {
        names.JUDGE_DROPPED_FRACTION: stats["dropped"] / judged,
        names.JUDGE_DEGENERATE_FRACTION: stats["degenerate"] / judged,
        names.JUDGE_SCORE_MEAN: float(scores.mean()) if scores.size else 0.0,
        names.JUDGE_SCORE_STD: float(scores.std()) if scores.size else 0.0,
    }


def _group(samples: list[AgentSample], update: int, index: int) -> Group:
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
        r.extra["returns"] = _returns(s, common)
        if traj.failed or getattr(s, "judge_dropped", False) or traj.reward is None:
            r.skip_reason = "judge_dropped" if getattr(s, "judge_dropped", False) else "unscored"
        members.append(r)
    return Group(prompt, update, index, members)


def _returns(s: AgentSample, common: int) -> np.ndarray | None:
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


def _drop_and_advantage(cfg, groups: list[Group], update: int) -> dict[str, float]:
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


def _agent_metrics(samples: list[AgentSample]) -> dict[str, float]:
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


# -- the update --------------------------------------------------------------------------------


def _epoch(cfg, decoder, trained: list[Rollout], budget: int) -> dict[str, float]:
    """One pass over the update's trajectories; the first stores the old log-probabilities
    (ratios exactly 1). Token sums are divided by budget x trajectories."""
    a, training = cfg.agent, cfg.training
    normalizer = float(budget * len(trained))
    policy_tokens = float(sum(r.token_mask.sum() for r in trained))
    sums = {"loss": 0.0, "surrogate": 0.0, "kl": 0.0, "clipped": 0.0, "gap": 0.0}
    for piece in pieces(trained, training.micro_batch, fanout(training)):
        lps = score(decoder, trained, piece, training)
        batch = [trained[i] for i in piece.members]
        for r, lp in zip(batch, lps, strict=True):
            if r.old_logprobs is None:
                r.old_logprobs = lp.detach().numpy().astype(np.float32)
                gap = np.abs(r.old_logprobs - r.sampler_logprobs) * r.token_mask
                sums["gap"] += float(gap.sum())
        width = max(len(lp) for lp in lps)
        logp = torch.nn.utils.rnn.pad_sequence(list(lps), batch_first=True)
        mask = padded([r.token_mask for r in batch], width)
        old = padded([r.old_logprobs for r in batch], width)
        ref = padded([r.ref_logprobs for r in batch], width) if a.kl_coefficient > 0 else None
        if any(r.token_advantages is not None for r in batch):
            adv = padded(
                [
                    r.token_advantages
                    if r.token_advantages is not None
                    else np.full(r.n_tokens, r.advantage, np.float32)
                    for r in batch
                ],
                width,
            )
        else:
            adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32)
        out = policy_loss(
            logp,
            old,
            adv,
            mask,
            clip_low=a.clip_range_low,
            clip_high=a.clip_range_high,
            level=a.importance_sampling_level,
            ref_logp=ref,
            kl_coef=a.kl_coefficient,
            normalizer=normalizer,
        )
        out.loss.backward()
        sums["loss"] += float(out.loss.detach())
        sums["surrogate"] += float(out.surrogate.detach())
        sums["kl"] += float(out.kl.detach())
        sums["clipped"] += float(out.clip_fraction) * float(mask.sum()) / max(policy_tokens, 1.0)
    return {
        names.TOTAL_LOSS: sums["loss"],
        names.TRAIN_LOSS: sums["loss"],
        names.SURROGATE_LOSS: sums["surrogate"],
        names.POLICY_KL: sums["kl"] * normalizer / max(policy_tokens, 1.0),
        names.CLIP_FRACTION: sums["clipped"],
        names.SAMPLER_LOGPROB_GAP: sums["gap"] / max(policy_tokens, 1.0),
    }


# -- evaluation and collect --------------------------------------------------------------------


def _evaluate_now(cfg, update: int) -> bool:
    return update % cfg.evaluation.every_iterations == 0 or update == cfg.agent.updates


def _evaluate(cfg, roller, held_file, pos, patience, result, sinks) -> bool:
    """Mean environment reward of one trajectory per held-out scenario, seeds fixed for the
    run (the same adapter scores the same); never the judge."""
    t0 = time.perf_counter()
    scenarios = held_out(list(held_file.scenarios), cfg.evaluation.max_examples)
    wanted = [(s, [derive_seed(cfg.agent.seed, EVALUATE, 0, i)]) for i, s in enumerate(scenarios)]
    rolled = roll_waves(cfg, roller, wanted)
    rewards = [(s.traj.reward or 0.0) for [s] in rolled]
    return report_rewards(rewards, pos, patience, result, sinks, time.perf_counter() - t0)


def collect_groups(
    cfg, model_path, scenarios, k: int, seed: int, limit: int | None = None, run_dir=None
):
    """`retrograd collect` without --api: k trajectories per scenario from the local model
    (and init_adapter), scored as training scores them; nothing trains. -> per scenario, its
    trajectories. Scenario i is rolled out from seeds seed + i × k + j."""
    import retrograd
    from retrograd.trainable.plan import build_lora_plan as plan_of

    a = cfg.agent
    if isinstance(scenarios, ScenarioFile):
        scenarios = scenarios.scenarios
    scenarios = list(scenarios)[:limit] if limit else list(scenarios)
    run_dir = Path(run_dir or Path(a.scenarios).parent)
    world = World(cfg, run_dir)
    try:
        env = world.environment
        if env is not None and hasattr(env, "check_scenarios"):
            env.check_scenarios(scenarios)
        model = retrograd.load(model_path, device=cfg.model.device, threads=cfg.training.threads)
        if cfg.lora is not None and cfg.lora.init_adapter:
            plan_of(model.decoder, cfg.lora, init_adapter=cfg.lora.init_adapter)
        chat = context.chat_format(model, a.template_variables)
        sampler = Sampler(
            model.decoder,
            model.tokenizer,
            fast=cfg.training.fast_sampling_context,
            max_len=cfg.training.ctx,
        )
        roller = AgentRoller(
            sampler,
            chat,
            Limits.of(a, cfg.training.ctx),
            environment=world.environment,
            mcp=world.mcp,
            system_suffix=a.system_suffix,
            generator_name=Path(model_path).name,
        )
        try:
            wanted = [(s, [seed + i * k + j for j in range(k)]) for i, s in enumerate(scenarios)]
            rolled = roll_waves(cfg, roller, wanted)
            _score(cfg, world, rolled, 0)
        finally:
            roller.close()
        return [[s.traj for s in group] for group in rolled]
    finally:
        world.close()


def _first_last(values: list[float]) -> str:
    if not values:
        return "no update ran"
    return f"{values[0]:.4f} -> {values[-1]:.4f}"


__all__ = ["Trajectory", "collect_groups", "run_agent_grpo"]
