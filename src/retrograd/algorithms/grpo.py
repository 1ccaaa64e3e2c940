"""GRPO: group-relative policy optimisation of a LoRA adapter, scored by a reward program.

Each update: 1. choose prompts  2. sample a group of answers per prompt  3. reward them  4.
advantages  5. reference scores  6. grpo_epochs optimizer passes  7. report, observe,
evaluate, checkpoint. The variant (rollout/shaping.py, losses/policy.py say the formulas):
- advantages are the reward minus the group's baseline (its mean, or leave-one-out), not
  divided by the group's standard deviation (Dr. GRPO); a group whose rewards are all equal
  carries no signal and does not train; with [grpo.dynamic_sampling] it is replaced by a group
  of a fresh prompt, up to max_resample_factor x prompts_per_update prompts an update;
- the loss is the clipped surrogate with clip_range_low / clip_range_high, ratios per token or
  per answer (GSPO), averaged over the update's trained tokens (DAPO's token mean), plus
  kl_coefficient times the k3 estimate of KL toward the reference (the base model with the
  adapter switched off, or [reference].model);
- old log-probabilities come from the training path itself: the first pass of an update
  scores the answers with the weights that sampled them, so its ratios are exactly 1, and
  later passes compare with those values; the sampler's own log-probabilities (fast sampling
  context: a 16-bit cache) are only compared with them (policy/sampler_logprob_gap); when the
  sampler is not the trainer ([training].rollout_backend = "llama_cpp"), each token's surrogate
  term is weighted by min(pi_old / pi_sampler, rollout_is_cap) (truncated importance sampling,
  as TRL and verl correct a vLLM sampler; losses/correction.py);
- each pass over the update's answers is one optimizer step; the learning rate schedule counts
  updates x grpo_epochs steps;
- every random choice is a pure function of the run's seeds and the update: answer seeds from
  seeds.derive_seed([grpo.sampling].seed, "sample", update, prompt cursor, member), the prompt
  order a permutation per pass over the file; resume needs the update, the prompt cursor, the
  stall counter and the KL controller, all in the checkpoint;
- under torchrun each rank samples and rewards a block of each round's prompts, every rank
  then holds the whole update's groups (advantages, metrics and decisions as one process),
  scores and back-propagates its own answers, and the ranks' gradients are summed before the
  step (rollout/spread.py); rank 0 alone reports and observes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms import context, frame, persist, rollout_run
from retrograd.algorithms.evaluate import Patience, report_rewards, spread_rewards
from retrograd.algorithms.policy_terms import PolicyTerms, sampler_cap
from retrograd.algorithms.rollout_run import RolloutResult
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition
from retrograd.errors import JudgeError, TrainingError
from retrograd.losses.policy import policy_loss
from retrograd.observe import names
from retrograd.optim import lr_at
from retrograd.rewards.judge import group_id, open_judge
from retrograd.rewards.program import RewardRequest, reward_program
from retrograd.rewards.ruler.prompt import Candidate
from retrograd.rollout import spread
from retrograd.rollout.passes import fanout, frozen_logprobs, padded, pieces, score
from retrograd.rollout.records import Group, Rollout
from retrograd.rollout.sample import PromptStream, held_out, sample_groups
from retrograd.rollout.shaping import (
    KlController,
    apply_overlong_penalty,
    assign_advantages,
    zero_signal,
)

log = logging.getLogger(__name__)
# [grpo] keys that change no step: a resumed run may change them
_NOT_TRAJECTORY = {
    "prompts",
    "reward_command",
    "reward_mode",
    "reward_timeout_seconds",
    "max_stalled_updates",
}


@dataclass
class Position:
    """Where the loop is between two updates: resume continues from exactly here."""

    update: int = 0  # completed updates
    cursor: int = 0  # prompts drawn so far (the prompt stream's position)
    global_step: int = 0
    stalled: int = 0  # updates in a row without signal
    kl: dict = field(default_factory=dict)  # the KL controller's state

    def mark(self) -> persist.Mark:
        return persist.Mark(
            self.global_step,
            update=self.update,
            dataset=DatasetPosition(0, self.cursor, {"update": self.update}),
            extra={"stalled": self.stalled, "kl": dict(self.kl)},
        )

    @classmethod
    def restored(cls, state) -> Position:
        p = state.progress
        return cls(
            p.update,
            state.dataset.index,
            state.global_step,
            int(p.extra["stalled"]),
            dict(p.extra["kl"]),
        )


GRPOResult = RolloutResult


def total_steps(cfg) -> int:
    return cfg.grpo.updates * cfg.grpo.grpo_epochs


def concurrency(cfg) -> int:
    """The reference's default concurrency: min(answers of an update, the optimizer window,
    256), the window being ctx for rollouts (gradient_accumulation = ctx / micro_batch)."""
    g, t = cfg.grpo, cfg.training
    return t.generation_concurrency or min(g.prompts_per_update * g.group_size, t.ctx, 256)


def check_available(cfg) -> None:
    """Values the configuration reference allows that this loop cannot honour yet: refused
    before anything loads, naming the key (docs/configuration.md, "At run time")."""
    context.check_fanout(cfg.training, "grpo")


def run_grpo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> GRPOResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    g, training = cfg.grpo, cfg.training
    # 1. build: everything that can be checked is checked before the model loads
    check_available(cfg)
    b = rollout_run.build(cfg, g.prompts, "[grpo].prompts", sinks, run_file, concurrency(cfg))
    model, named, optimizer, plan, adapters = b.model, b.named, b.optimizer, b.plan, b.adapters
    params, rate, steps, backend, held = b.params, b.rate, total_steps(cfg), b.backend, b.held
    world = spread.current_world()
    reference = context.reference(cfg, model, adapters)
    stream = PromptStream(b.prompts, g.prompt_order, g.sampling.seed)
    settings = {
        "grpo": g.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        **rollout_run.sampler_identity(training),
        "reference": context.reference_id(cfg),
    }
    run = persist.RunIdentity.of(cfg, model.config.name, b.fingerprints, plan, settings)

    # 2. resume
    pos = Position()
    # on the negated mean reward: lower is better, as for a loss
    patience = Patience.of(cfg.evaluation)
    kl = KlController.from_section(g)
    found = persist.find_resume(cfg, resume)
    if found is not None:
        pos = Position.restored(persist.restore(found, run, named, optimizer, patience))
        kl.load_state_dict(pos.kl)
    rollout_run.start(sinks, cfg, b, g.updates, pos, found)
    result = GRPOResult(Path(cfg.output.path), pos.update, pos.global_step, None, 0.0)
    observe = rollout_run.open_observe(cfg, "grpo", settings, pos.update, found, sinks, world)
    program = reward_program(g, "[grpo]")
    run_dir = Path(run_file).resolve().parent if run_file else Path.cwd()
    judge = open_judge(g.judge, "[grpo.judge]", run_dir) if g.judge is not None else None
    try:
        # 3. updates
        for update in range(pos.update + 1, g.updates + 1):
            t0 = time.perf_counter()
            groups, mine, cursor, timing = _sample_and_reward(
                cfg, backend, stream, program, judge, update, pos.cursor, world
            )
            _check_judge_drops(cfg, groups, update)
            stats = assign_advantages(groups, g.baseline, g.mask_truncated)
            trained = [r for grp in groups for r in grp.members if r.eligible]
            # this rank's answers: it scores and back-propagates these
            own = [r for grp in groups if grp.index in mine for r in grp.members if r.eligible]
            if observe is not None:  # before training: `trained` comes with the outcome
                observe.rollouts(update, groups)
            coef = kl.value(update)
            values = _rollout_metrics(groups, cursor - pos.cursor, g.prompts_per_update)
            values.update(stats_names(stats))
            values.update(timing)
            if judge is not None:
                values.update(_judge_metrics(groups, judge))
            before = pos.global_step
            if trained:
                t1 = time.perf_counter()
                if coef > 0:
                    refs = frozen_logprobs(reference, model.decoder, own, training)
                    for r, lp in zip(own, refs, strict=True):
                        r.ref_logprobs = lp
                values[names.SCORING_SECONDS] = time.perf_counter() - t1
                t1 = time.perf_counter()
                for epoch in range(g.grpo_epochs):
                    lr = lr_at(
                        pos.global_step, steps, rate, training.lr_scheduler, training.warmup_steps
                    )
                    out = _epoch(cfg, model.decoder, own, trained, coef, world, epoch == 0)
                    spread.sum_gradients(params, world)
                    where = f"update {update}"
                    loss = out[names.TOTAL_LOSS]
                    norm = checked_step(params, optimizer, training.max_grad_norm, lr, loss, where)
                    pos.global_step += 1
                    backend.policy_changed(pos.global_step)
                    values.update(out)
                    values[names.LEARNING_RATE] = lr
                    values[names.GRAD_NORM] = norm
                values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
                for r in trained:
                    r.trained = True
                kl.observe(values.get(names.POLICY_KL, 0.0), update)
                pos.stalled = 0
            else:
                pos.stalled += 1
            for grp in groups:
                for r in grp.members:
                    if r.trained is None:
                        r.trained = False
            values[names.KL_COEFFICIENT] = coef
            values[names.OPTIMIZER_STEPS] = pos.global_step
            pos = Position(update, cursor, pos.global_step, pos.stalled, kl.state_dict())
            if observe is not None:
                observe.outcome(update, groups)
                values[names.OBSERVE_DROPPED] = observe.dropped_batches
                observe.update(update, "completed" if trained else "skipped", values)
            tokens = sum(r.n_tokens for grp in groups for r in grp.members)
            epoch = max(cursor - 1, 0) // len(stream.prompts) + 1  # the pass over the prompts
            seconds = time.perf_counter() - t0
            sinks.step(pos.global_step, epoch, values, tokens, seconds, position=update)
            cfg, rate = persist.boundary(
                sinks, cfg, patience, lambda c=cfg: rollout_run.measure(c, backend, program, held)
            )
            result.rewards.append(values[names.REWARD_MEAN])
            log.debug("update %d: %s", update, {k: round(v, 4) for k, v in values.items()})
            # evaluation, then the checkpoint that includes its patience
            if held is not None and _evaluate_now(cfg, update):
                improved = _evaluate(cfg, backend, program, held, pos, patience, result, sinks)
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
            if g.max_stalled_updates and pos.stalled >= g.max_stalled_updates:
                result.stopped = f"{pos.stalled} updates in a row without signal"
                break
    finally:
        program.close()
        backend.close()
        if observe is not None:
            observe.close()
    # 4. export; if that fails, the trained adapter is kept elsewhere and the error says where
    return rollout_run.finish(
        cfg, b, run_file, run, pos.mark(), patience, steps, result, started, sinks
    )


# -- sampling and rewards ------------------------------------------------------------------


def _sample_and_reward(cfg, backend, stream, program, judge, update: int, cursor: int, world):
    """The update's groups, sampled and rewarded, the indices of those this rank sampled, and
    the prompt cursor after them. Each rank samples and rewards a block of a round's prompts
    (one batch of the reward program each), and every rank gets the round's groups. With
    dynamic sampling, groups without signal are replaced by fresh prompts' groups while the
    prompt budget lasts."""
    g = cfg.grpo
    want = g.prompts_per_update
    budget = want * (g.dynamic_sampling.max_resample_factor if g.dynamic_sampling else 1)
    kept: list[Group] = []
    dropped: list[Group] = []
    mine: set[int] = set()
    drawn = 0
    timing = {names.GENERATION_SECONDS: 0.0, names.REWARD_SECONDS: 0.0, names.JUDGE_SECONDS: 0.0}
    while True:
        n = min(want - len(kept), budget - drawn) if g.dynamic_sampling else want
        batch = stream.draw(cursor, n)
        cursor, drawn = cursor + n, drawn + n
        first = len(kept) + len(dropped)

        def roll(part, lo, first=first):
            t0 = time.perf_counter()
            groups = sample_groups(
                backend,
                part,
                update,
                first + lo,
                size=g.group_size,
                sampling=g.sampling,
                concurrency=concurrency(cfg),
            )
            t1 = time.perf_counter()
            judging = _reward(cfg, program, judge, groups) if groups else 0.0
            timing[names.GENERATION_SECONDS] += t1 - t0
            timing[names.REWARD_SECONDS] += time.perf_counter() - t1 - judging
            timing[names.JUDGE_SECONDS] += judging
            mine.update(grp.index for grp in groups)
            return groups

        groups = spread.spread(batch, roll, world)
        if not g.dynamic_sampling:
            return groups, mine, cursor, timing
        for grp in groups:
            (dropped if zero_signal(grp.rewards) else kept).append(grp)
        if len(kept) >= want or drawn >= budget:
            # what was not replaced stays in the update (and skips for want of signal)
            return kept + dropped[: max(0, want - len(kept))], mine, cursor, timing


def _reward(cfg, program, judge, groups: list[Group]) -> float:
    """One reward batch for every answer of these groups, the judge's verdicts and the
    overlong penalty applied; -> seconds spent judging."""
    g = cfg.grpo
    members = [r for grp in groups for r in grp.members]
    replies = program.score([RewardRequest(r.prompt.text, r.text) for r in members])
    weights = {}
    for r, reply in zip(members, replies, strict=True):
        r.reward_raw = reply.reward
        weights[id(r)] = g.judge_weight if reply.judge_weight is None else reply.judge_weight
    t0 = time.perf_counter()
    if judge is not None:
        _judge_groups(cfg, judge, groups, weights)
    if g.overlong_penalty is not None:
        o = g.overlong_penalty
        apply_overlong_penalty(groups, g.sampling.max_new_tokens, o.buffer_tokens, o.max_penalty)
    return time.perf_counter() - t0


def _judge_groups(cfg, judge, groups: list[Group], weights: dict[int, float]) -> None:
    """reward += weight x verdict (formats.md §3.5), every group's requests at once; a group
    whose every weight is 0 is not sent. A failing judge drops the group (it keeps its
    verifiable reward but leaves the baseline and the loss), or fails the run with
    judge_failure = "fail"."""
    sent, jobs = [], []
    for grp in groups:
        if not any(weights[id(r)] for r in grp.members):
            for r in grp.members:
                r.judge_term = 0.0
            continue
        candidates = [
            Candidate([*r.prompt.messages, {"role": "assistant", "content": r.text}])
            for r in grp.members
        ]
        sent.append(grp)
        jobs.append((candidates, group_id(grp.update, grp.index), grp.prompt.rubric))
    for grp, verdicts in zip(sent, judge.score_groups(jobs), strict=True):
        if isinstance(verdicts, JudgeError):
            if cfg.grpo.judge_failure == "fail":
                raise verdicts
            log.warning(
                "update %d, group %d: %s; the group is dropped", grp.update, grp.index, verdicts
            )
            grp.skip("judge_dropped")
            continue
        for r, v in zip(grp.members, verdicts, strict=True):
            r.judge_term = weights[id(r)] * v


def _judge_metrics(groups: list[Group], judge) -> dict[str, float]:
    """judge/ metrics of the update (formats.md §7.2): the judge's own (requests, latency,
    cache hits, budgets: a ruler judge's stats()), then the loop's counts."""
    dropped = [grp.members[0].skip_reason == "judge_dropped" for grp in groups]
    terms = [r.judge_term for grp in groups for r in grp.members if r.judge_term is not None]
    values = {**judge.stats(), names.JUDGE_DROPPED_FRACTION: float(np.mean(dropped))}
    if terms:
        values[names.REWARD_JUDGE_MEAN] = float(np.mean(terms))
    return values


def _check_judge_drops(cfg, groups: list[Group], update: int) -> None:
    if cfg.grpo.judge is None:
        return
    dropped = sum(1 for grp in groups if grp.members[0].skip_reason == "judge_dropped")
    limit = cfg.grpo.max_judge_dropped_fraction
    if dropped / len(groups) > limit:
        raise TrainingError(
            f"update {update}: the judge failed on {dropped} of {len(groups)} groups, more "
            f"than [grpo].max_judge_dropped_fraction = {limit}; see the judge errors above"
        )


# -- scoring and the update ----------------------------------------------------------------


def _epoch(
    cfg, decoder, own: list[Rollout], trained: list[Rollout], kl_coef: float, world, first: bool
) -> dict[str, float]:
    """One pass over this rank's answers (`own`, of the update's `trained`): forward, loss and
    backward per pass of answers, gradients summed (the loss is normalised by the whole
    update's trained tokens); the terms are summed over the ranks. The first pass stores the
    old log-probabilities it computes (ratios exactly 1)."""
    g, training = cfg.grpo, cfg.training
    total_tokens = float(sum(r.n_tokens for r in trained))
    by_answer = g.importance_sampling_level == "sequence"
    terms = PolicyTerms(total_tokens, len(trained), by_answer, first, sampler_cap(training))
    for piece in pieces(own, training.micro_batch, fanout(training)):
        lps = score(decoder, own, piece, training)
        batch = [own[i] for i in piece.members]
        terms.keep_old(batch, lps)
        width = max(len(lp) for lp in lps)
        logp = torch.nn.utils.rnn.pad_sequence(list(lps), batch_first=True)
        mask = padded([np.ones(len(lp), np.float32) for lp in lps], width)
        old = padded([r.old_logprobs for r in batch], width)
        ref = padded([r.ref_logprobs for r in batch], width) if kl_coef > 0 else None
        adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32)
        adv = terms.corrected(batch, adv, mask)  # a sampler that is not the trainer
        out = policy_loss(
            logp,
            old,
            adv,
            mask,
            clip_low=g.clip_range_low,
            clip_high=g.clip_range_high,
            level=g.importance_sampling_level,
            ref_logp=ref,
            kl_coef=kl_coef,
            normalizer=total_tokens,
        )
        out.loss.backward()
        # the pieces' terms are sums over the update's tokens: they add up to the whole's
        terms.add(out, mask, len(batch))
    return terms.metrics(world)


# -- metrics and evaluation ----------------------------------------------------------------


def stats_names(stats: dict) -> dict[str, float]:
    return {
        names.ZERO_STD_GROUP_FRACTION: stats["zero_std_group_fraction"],
        names.ADVANTAGE_ABS_MEAN: stats["advantage_abs_mean"],
        names.ADVANTAGE_STD: stats["advantage_std"],
        names.TRAINED_FRACTION: stats["trained_fraction"],
    }


def _rollout_metrics(groups: list[Group], drawn: int, wanted: int) -> dict[str, float]:
    members = [r for grp in groups for r in grp.members]
    rewards = np.array([r.reward for r in members], dtype=np.float64)
    raw = np.array([r.reward_raw for r in members], dtype=np.float64)
    lengths = np.array([r.n_tokens for r in members], dtype=np.float64)
    group_std = [float(np.std(grp.rewards)) for grp in groups]
    return {
        names.REWARD_MEAN: float(rewards.mean()),
        names.REWARD_MIN: float(rewards.min()),
        names.REWARD_MAX: float(rewards.max()),
        names.REWARD_STD: float(rewards.std()),
        names.REWARD_GROUP_STD: float(np.mean(group_std)),
        names.REWARD_VERIFIABLE_MEAN: float(raw.mean()),
        names.LENGTH_MEAN: float(lengths.mean()),
        names.LENGTH_MIN: float(lengths.min()),
        names.LENGTH_MAX: float(lengths.max()),
        names.TRUNCATION_FRACTION: float(np.mean([r.truncated for r in members])),
        names.GROUPS_SAMPLED_FRACTION: drawn / wanted,
    }


def _evaluate_now(cfg, update: int) -> bool:
    return update % cfg.evaluation.every_iterations == 0 or update == cfg.grpo.updates


def _evaluate(cfg, backend, program, held, pos, patience, result, sinks) -> bool:
    """Mean reward of one answer per held-out prompt (evaluate.held_out_rewards), each rank
    answering a block of them."""
    t0 = time.perf_counter()
    prompts = held_out(held, cfg.evaluation.max_examples)
    world = spread.current_world()
    rewards = spread_rewards(backend, program, prompts, cfg.grpo.sampling, world)
    return report_rewards(rewards, pos, patience, result, sinks, time.perf_counter() - t0)
