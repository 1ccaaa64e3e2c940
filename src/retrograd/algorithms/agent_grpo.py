"""Agentic GRPO: group-relative policy optimisation over multi-turn, tool-using trajectories.

Each update: 1. choose scenarios  2. roll a group of trajectories per scenario in lockstep
(agent/rollout.py)  3. score each group by its environment (verify, step rewards) or, when the
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.agent.arena import Arena
from retrograd.agent.groups import concurrency, held_rewards, roll_and_score
from retrograd.agent.limits import Limits
from retrograd.agent.rollout import AgentRoller
from retrograd.agent.scenarios import read_scenarios
from retrograd.agent.scores import USABLE, drop_and_advantage
from retrograd.agent.trajectory import Trajectory
from retrograd.algorithms import context, frame, persist
from retrograd.algorithms.evaluate import report_rewards, reward_summary
from retrograd.algorithms.frame import Patience
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition, outputs
from retrograd.errors import TrainingError
from retrograd.losses.policy import policy_loss
from retrograd.observe import names
from retrograd.optim import lr_at
from retrograd.rollout import spread
from retrograd.rollout.passes import fanout, frozen_logprobs, padded, pieces, score
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import PromptStream
from retrograd.sampling.backend import in_process

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


def total_steps(cfg) -> int:
    return cfg.agent.updates * cfg.agent.epochs_per_update


def check_available(cfg) -> None:
    """What this version cannot honour, refused before anything loads."""
    context.check_fanout(cfg.training, "agent_grpo")


def _check_manifest(path: Path) -> None:
    from retrograd.agent.generate import check_manifest

    check_manifest(path)


# -- the loop ----------------------------------------------------------------------------------


def run_agent_grpo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> AgentResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    a = cfg.agent
    run_dir = Path(run_file).resolve().parent if run_file else Path.cwd()
    # 1. build: everything that can be checked is checked before the model loads
    check_available(cfg)
    outputs.check_outputs(cfg, run_file)
    scenario_file = read_scenarios(a.scenarios)
    _check_manifest(scenario_file.path)
    held_file = read_scenarios(cfg.evaluation.data, "[evaluation].data") if cfg.evaluation else None
    arena = Arena(cfg, run_dir)
    try:
        arena.check(scenario_file, held_file)
        return _train(cfg, arena, scenario_file, held_file, resume, sinks, run_file, started)
    finally:
        arena.close()


def _train(cfg, arena, scenario_file, held_file, resume, sinks, run_file, started):
    a, training = cfg.agent, cfg.training
    model = context.load_model(cfg)
    context.preflight_check(model, training, getattr(sinks, "console", None))
    context.apply_memory_knobs(model, training)
    chat = context.chat_format(model, a.template_variables)
    tr = context.trainables(model, cfg)
    plan, adapters, named, params, optimizer = (
        tr.plan,
        tr.adapters,
        tr.named,
        tr.params,
        tr.optimizer,
    )
    rate, steps = tr.rate, total_steps(cfg)
    reference = context.reference(cfg, model, adapters)
    backend = in_process(model, training, concurrency(cfg))
    ranks = spread.current_world()
    limits = Limits.of(a, training.ctx)
    roller = AgentRoller(
        backend,
        chat,
        limits,
        environment=arena.environment,
        mcp=arena.mcp,
        generator_name=Path(cfg.model.path).name,
    )
    stream = PromptStream(scenario_file.scenarios, "shuffled", a.seed)  # a permutation a pass
    settings = {
        "agent": a.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        "fast_sampling_context": training.fast_sampling_context,
        "reference": context.reference_id(cfg),
        "world": arena.signature(),
    }
    fingerprints = {
        "scenarios": scenario_file.fingerprint,
        "eval": held_file.fingerprint if held_file else None,
    }
    run = persist.RunIdentity.of(cfg, model.config.name, fingerprints, plan, settings)

    # 2. resume
    pos = Position()
    patience = Patience.of(cfg.evaluation)
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
    resumed = found is not None
    observe = frame.open_observe(cfg, "agent_grpo", settings, pos.update, resumed, sinks.console)
    try:
        # 3. updates
        for update in range(pos.update + 1, a.updates + 1):
            t0 = time.perf_counter()
            batch = stream.draw(pos.cursor, a.scenarios_per_update)
            cursor = pos.cursor + len(batch)
            groups, samples, values = roll_and_score(cfg, roller, arena, batch, update, ranks)
            lo, hi = spread.block(len(groups), ranks)  # this rank's groups
            values.update(drop_and_advantage(cfg, groups, update))
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
            own = [r for grp in groups[lo:hi] for r in grp.members if r.eligible]  # this rank's
            if trained:
                t1 = time.perf_counter()
                if a.kl_coefficient > 0:
                    refs = frozen_logprobs(reference, model.decoder, own, training)
                    for r, lp in zip(own, refs, strict=True):
                        r.ref_logprobs = lp
                values[names.SCORING_SECONDS] = time.perf_counter() - t1
                t1 = time.perf_counter()
                for _ in range(a.epochs_per_update):
                    lr = lr_at(
                        pos.global_step, steps, rate, training.lr_scheduler, training.warmup_steps
                    )
                    out = _epoch(cfg, model.decoder, own, trained, limits.loss_budget, ranks)
                    spread.sum_gradients(params, ranks)
                    checked_step(
                        params,
                        optimizer,
                        training.max_grad_norm,
                        lr,
                        out[names.TOTAL_LOSS],
                        f"update {update}",
                    )
                    pos.global_step += 1
                    backend.policy_changed(pos.global_step)
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
            cfg, rate = persist.boundary(
                sinks, cfg, patience, lambda cfg=cfg: _measure(cfg, roller, held_file)
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
        cfg, model, run_file, run, pos.mark(), named, optimizer, plan, tr.trained, patience, steps
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


# -- the update --------------------------------------------------------------------------------


def _epoch(
    cfg, decoder, own: list[Rollout], trained: list[Rollout], budget: int, ranks
) -> dict[str, float]:
    """One pass over this rank's trajectories (`own`, of the update's `trained`); the first
    stores the old log-probabilities (ratios exactly 1). Token sums are divided by budget x
    the update's trajectories; the terms are summed over the ranks."""
    a, training = cfg.agent, cfg.training
    normalizer = float(budget * len(trained))
    policy_tokens = float(sum(r.token_mask.sum() for r in trained))
    sums = {"loss": 0.0, "surrogate": 0.0, "kl": 0.0, "clipped": 0.0, "gap": 0.0}
    for piece in pieces(own, training.micro_batch, fanout(training)):
        lps = score(decoder, own, piece, training)
        batch = [own[i] for i in piece.members]
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
    sums = spread.total(sums, ranks)
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
    rewards = held_rewards(cfg, roller, held_file)
    return report_rewards(rewards, pos, patience, result, sinks, time.perf_counter() - t0)


def _measure(cfg, roller, held_file) -> dict | None:
    """The held-out rewards with the weights as they are (None without [evaluation]), for a
    client's question to a served run; patience is not told."""
    if held_file is None:
        return None
    return reward_summary(held_rewards(cfg, roller, held_file))


def _first_last(values: list[float]) -> str:
    if not values:
        return "no update ran"
    return f"{values[0]:.4f} -> {values[-1]:.4f}"


__all__ = ["Trajectory", "run_agent_grpo"]
