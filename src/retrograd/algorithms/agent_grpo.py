"""Agentic GRPO: group-relative policy optimisation over multi-turn, tool-using trajectories.

Each update: 1. choose scenarios  2. roll a group of trajectories per scenario in lockstep
(agent/rollout.py)  3. score each group by its environment (verify, step rewards) or, when the
environment does not grade it, by the judge  4. drop what cannot train, advantages, the update
skip rules  5. reference scores  6. epochs_per_update optimizer passes (policy.py)  7. report,
observe, evaluate, checkpoint (frame.py).
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
  derive_seed(agent.seed, "sample", u, c, j); resume needs the update and the cursor;
- under torchrun each rank rolls out and scores a block of the update's scenarios (its own
  environment episodes and judge requests); every rank holds all the groups (drops,
  advantages and metrics as one process), back-propagates its own trajectories, and the
  ranks' gradients are summed before each step (rollout/spread.py). The judge's own counters
  and the environment's metrics are rank 0's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from retrograd.agent.arena import Arena
from retrograd.agent.groups import concurrency, held_rewards, roll_and_score
from retrograd.agent.limits import Limits
from retrograd.agent.rollout import AgentRoller
from retrograd.agent.scenarios import read_scenarios
from retrograd.agent.scores import USABLE, drop_and_advantage
from retrograd.agent.trajectory import Trajectory
from retrograd.algorithms import context, frame, policy
from retrograd.algorithms.door import Door
from retrograd.algorithms.evaluate import reward_evaluation
from retrograd.errors import TrainingError
from retrograd.observe import names
from retrograd.rollout import spread
from retrograd.rollout.passes import attach_logprobs
from retrograd.rollout.records import Group, Rollout
from retrograd.rollout.sample import PromptStream, pass_over
from retrograd.sampling.backend import in_process, sampler_identity

log = logging.getLogger(__name__)
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
# what a policy pass reports here (docs/metrics.md, "Agentic GRPO")
_POLICY = (
    names.TOTAL_LOSS,
    names.TRAIN_LOSS,
    names.SURROGATE_LOSS,
    names.POLICY_KL,
    names.CLIP_FRACTION,
    names.SAMPLER_LOGPROB_GAP,
    names.LEARNING_RATE,
)


def total_steps(cfg) -> int:
    return cfg.agent.updates * cfg.agent.epochs_per_update


def check_available(cfg) -> None:
    """What this version cannot honour, refused before anything loads."""
    context.check_fanout(cfg.training, "agent_grpo")


def _check_manifest(path: Path) -> None:
    from retrograd.agent.generate import check_manifest

    check_manifest(path)


# -- the loop ----------------------------------------------------------------------------------


def run_agent_grpo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    a = cfg.agent
    # 1. build: everything that can be checked is checked before the model loads
    check_available(cfg)
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    scenario_file = read_scenarios(a.scenarios)
    _check_manifest(scenario_file.path)
    held_file = read_scenarios(cfg.evaluation.data, "[evaluation].data") if cfg.evaluation else None
    arena = Arena(cfg, door.run_dir, environment=door.environment, verify=door.verify)
    try:
        arena.check(scenario_file, held_file)
        return _train(cfg, door, arena, scenario_file, held_file)
    finally:
        arena.close()


def _train(cfg, door: Door, arena: Arena, scenario_file, held_file) -> frame.Result:
    a, t = cfg.agent, cfg.training
    model = frame.model_of(cfg, door)
    settings = {
        "agent": a.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        **sampler_identity(t),
        "reference": context.reference_id(cfg),
        "world": arena.signature(),
    }
    prints = {"scenarios": scenario_file.fingerprint, "eval": _fingerprint(held_file)}
    inputs = frame.Inputs(prints, settings, _described(scenario_file), _described(held_file))
    label = "mean reward, first -> last update"
    shape = frame.Shape(total_steps(cfg), a.updates, "update", names.REWARD_MEAN, label)
    run = frame.open_run(cfg, model, door, inputs, shape, observe="agent_grpo")
    limits = Limits.of(a, t.ctx)
    roller = _roller(run, arena, limits)
    held = (lambda c: held_rewards(c, roller, held_file)) if held_file is not None else None
    run = frame.evaluate_with(run, reward_evaluation(held))
    reference = context.reference(cfg, model, run.tr.adapters)
    stream = PromptStream(scenario_file.scenarios, "shuffled", a.seed)  # a permutation a pass
    pos, ranks, counts = run.position, run.world, run.result.counts
    counts.update(skipped=0, no_signal=0)
    with run.closing:
        for update in range(pos.update + 1, a.updates + 1):
            began, before = time.perf_counter(), pos.global_step
            # 2-3. a group of trajectories per scenario, rolled out and scored (each rank a block)
            batch = stream.draw(pos.index, a.scenarios_per_update)
            cursor = pos.index + len(batch)
            groups, samples, values = roll_and_score(cfg, roller, arena, batch, update, ranks)
            lo, hi = spread.block(len(groups), ranks)  # this rank's groups
            # 4. drops and advantages; an update without two usable trajectories, or without
            # signal, does not train
            values.update(drop_and_advantage(cfg, groups, update))
            frame.observe_rollouts(run, update, groups, selection=True)
            trained = _trained(a, groups, update, counts)
            own = [r for grp in groups[lo:hi] for r in grp.members if r.eligible]  # this rank's
            # 5-6. reference scores; epochs_per_update optimizer steps
            step = pos.global_step
            if trained:
                step = _update(run, roller, reference, own, trained, limits, update, step, values)
            for grp in groups:
                for r in grp.members:
                    if r.trained is None:
                        r.trained = False
            values[names.KL_COEFFICIENT] = a.kl_coefficient
            pos = pos.after_update(update, cursor, step)
            # 7. report, observe, evaluate, checkpoint
            tokens = sum(len(s.seq) for s in samples)
            epoch = pass_over(cursor, len(scenario_file))
            report = frame.Report(
                values, tokens, began, epoch, before, trained=bool(trained), groups=groups
            )
            if frame.after_step(run, pos, report):
                break
    # export
    summary = {
        "updates skipped (fewer than 2 usable trajectories)": counts["skipped"],
        "updates without signal (every group scored alike)": counts["no_signal"],
    }
    return frame.finish(run, pos, summary=summary)


def _roller(run: frame.Run, arena: Arena, limits: Limits) -> AgentRoller:
    """The run's multi-turn rollouts: the in-process sampler over the training model, the
    model's chat format, the arena's environment and MCP hub; closed with the run."""
    cfg, model = run.cfg, run.model
    roller = AgentRoller(
        in_process(model, cfg.training, concurrency(cfg)),
        context.chat_format(model, cfg.agent.template_variables),
        limits,
        environment=arena.environment,
        mcp=arena.mcp,
        generator_name=Path(cfg.model.path).name,
    )
    run.closing.callback(roller.close)
    return roller


def _update(run, roller, reference, own, trained, limits, update: int, step: int, values) -> int:
    """Reference scores of this rank's trajectories (with a KL term) and epochs_per_update
    optimizer steps; each trained one marked. -> the global step after them."""
    a, t1 = run.cfg.agent, time.perf_counter()
    if a.kl_coefficient > 0:
        attach_logprobs(reference, run.model.decoder, own, run.cfg.training, "ref_logprobs")
    values[names.SCORING_SECONDS] = time.perf_counter() - t1
    t1 = time.perf_counter()
    step, out = policy.train(
        run, roller.backend, own, policy.Surrogate.of(a), _pass(trained, limits.loss_budget),
        a.epochs_per_update, f"update {update}", step,
    )  # fmt: skip
    values.update(_reported(out, trained, limits.loss_budget))
    values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
    for r in trained:
        r.trained = True
    return step


def _trained(a, groups: list[Group], update: int, counts: dict[str, int]) -> list[Rollout]:
    """The update's trajectories that train. Fewer than two usable ones fail the update, or
    skip it with skip_empty_updates; usable ones that all scored alike carry no signal."""
    trained = [r for grp in groups for r in grp.members if r.eligible]
    usable = sum(1 for grp in groups for r in grp.members if r.skip_reason in USABLE)
    if usable < 2:
        if not a.skip_empty_updates:
            raise TrainingError(
                f"update {update}: {usable} trajectories are usable (at least 2 needed); "
                "see agent/failed_fraction and agent/truncated_fraction, or set "
                "[agent].skip_empty_updates = true"
            )
        for grp in groups:
            grp.skip("update_skipped")
        counts["skipped"] += 1
        return []
    if not trained:
        counts["no_signal"] += 1
    return trained


def _pass(trained: list[Rollout], budget: int) -> policy.Pass:
    """The update's passes: only the policy's own tokens train; token sums are divided by a
    constant budget x the update's trajectories; a trajectory's tokens take their own
    advantages where it has them (step rewards), else its group advantage."""
    normalizer = float(budget * len(trained))
    policy_tokens = float(sum(r.token_mask.sum() for r in trained))
    return policy.Pass(normalizer, policy_tokens, len(trained), advantages="either", masked=True)


def _reported(out: dict[str, float], trained: list[Rollout], budget: int) -> dict[str, float]:
    """The pass's values this loop reports; its KL as a mean over the policy's tokens (the
    loss's term is over the budget)."""
    values = policy.kept(out, _POLICY)
    policy_tokens = float(sum(r.token_mask.sum() for r in trained))
    values[names.POLICY_KL] *= float(budget * len(trained)) / max(policy_tokens, 1.0)
    return values


def _fingerprint(file) -> str | None:
    return file.fingerprint if file is not None else None


def _described(file) -> tuple[Path, str] | None:
    """(path, one line) of a scenario file for the start lines."""
    if file is None:
        return None
    return file.path, f"{file.path.name}: {len(file)} scenarios"


__all__ = ["Trajectory", "run_agent_grpo"]
