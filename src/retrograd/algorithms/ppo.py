"""PPO: proximal policy optimisation of a LoRA adapter, scored by a reward program, with an
optional value head (critic) and GAE advantages.

Each update: 1. draw rollout_batch_size prompts, one answer each  2. reward them in one batch
3. score them (the critic's features; the old log-probabilities come from the first policy
pass)  4. advantages  5. ppo_epochs optimizer passes  6. value_epochs passes of the value head
7. report, observe, evaluate, checkpoint. The variant (losses/policy.py and losses/value.py say the formulas):
- the loss is the clipped surrogate with one clip range (clip_range on both sides), per-token
  advantages, averaged over the update's tokens (token mean), plus kl_coefficient times the k3
  estimate of KL toward the policy that sampled the batch (spec: not toward [reference]; the
  first pass's term is 0, later passes hold the policy near the sampler), not a per-token
  reward penalty as in TRL's PPO;
- critic on: a linear value head on the model's final hidden states, read from features stored
  at feature_dtype by the scoring pass (it never back-propagates into the model); the reward
  is on the answer's last token, advantages by GAE (gamma, gae_lambda) with V = 0 after it,
  whitened over the update's tokens; the head then trains value_epochs full-batch AdamW steps
  (value_lr) toward the returns Â + V_old. Critic off: every token's advantage is its answer's
  reward, whitened over the update's tokens (a batch-mean baseline, no second forward);
- a batch whose advantages are all equal has no signal: no policy step (the head still trains);
- log-probabilities are at temperature 1 whatever [ppo.sampling] says: temperature and top_p
  shape what is sampled, the ratio compares the policy with itself before the update;
- every random choice is a pure function of the run's seeds: prompts in file order, answer
  seeds derive_seed([ppo.sampling].seed, "sample", update, prompt cursor, 0); resume needs the
  update, the cursor and the value head (weights and optimizer), all in the checkpoint;
- under torchrun each rank samples and rewards a block of the update's prompts and computes
  its answers' features and values; every rank holds all the answers (advantages whitened
  over all of them, as one process), back-propagates its own, and the ranks' gradients (the
  policy's and the value head's) are summed before each step (rollout/spread.py).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from retrograd.algorithms import context, frame, persist, rollout_run
from retrograd.algorithms.evaluate import Patience, report_rewards, spread_rewards
from retrograd.algorithms.policy_terms import PolicyTerms, sampler_cap
from retrograd.algorithms.rollout_run import RolloutResult
from retrograd.algorithms.step import checked_step
from retrograd.checkpoint import DatasetPosition
from retrograd.errors import TrainingError
from retrograd.losses.policy import policy_loss
from retrograd.losses.value import gae, value_loss, whiten
from retrograd.observe import names
from retrograd.optim import lr_at
from retrograd.rewards.program import RewardRequest, reward_program
from retrograd.rollout import spread
from retrograd.rollout.passes import fanout, hidden_states, padded, pieces, score
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import PromptStream, held_out, sample_groups
from retrograd.trainable.value_head import FEATURE_DTYPES, ValueHead

log = logging.getLogger(__name__)
VALUE_HEAD = "value-head.pt"  # the checkpoint artifact of the critic
# [ppo] keys that change no step: a resumed run may change them
_NOT_TRAJECTORY = {"prompts", "reward_command", "reward_mode", "reward_timeout_seconds"}


@dataclass
class Position:
    """Where the loop is between two updates: resume continues from exactly here."""

    update: int = 0  # completed updates
    cursor: int = 0  # prompts drawn so far
    global_step: int = 0

    def mark(self, critic: ValueHead | None) -> persist.Mark:
        return persist.Mark(
            self.global_step,
            update=self.update,
            dataset=DatasetPosition(0, self.cursor, {"update": self.update}),
            artifacts={VALUE_HEAD: critic.state_bytes} if critic is not None else {},
        )


PPOResult = RolloutResult


def total_steps(cfg) -> int:
    return cfg.ppo.updates * cfg.ppo.ppo_epochs


def _concurrency(cfg) -> int:
    """The reference's default: min(answers of an update, the optimizer window (ctx), 256)."""
    t = cfg.training
    return t.generation_concurrency or min(cfg.ppo.rollout_batch_size, t.ctx, 256)


def run_ppo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> PPOResult:
    door = frame.door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    resume, run_file, sinks = door.resume, door.run_file, persist.Legacy(door)
    started = time.perf_counter()
    p, training = cfg.ppo, cfg.training
    # 1. build: everything that can be checked is checked before the model loads
    context.check_fanout(training, "ppo")
    b = rollout_run.build(cfg, p.prompts, "[ppo].prompts", sinks, run_file, _concurrency(cfg))
    model, named, optimizer, plan = b.model, b.named, b.optimizer, b.plan
    steps = total_steps(cfg)
    world = spread.current_world()
    critic = ValueHead(model.config.n_embd, p.critic.value_lr) if p.critic.enabled else None
    stream = PromptStream(b.prompts, "sequential", p.sampling.seed)
    settings = {
        "ppo": p.model_dump(mode="json", exclude=_NOT_TRAJECTORY),
        **rollout_run.sampler_identity(training),
    }
    run = persist.RunIdentity.of(cfg, model.config.name, b.fingerprints, plan, settings)

    # 2. resume
    pos = Position()
    # on the negated mean reward: lower is better, as for a loss
    patience = Patience.of(cfg.evaluation)
    found = persist.find_resume(cfg, resume)
    if found is not None:
        state = persist.restore(found, run, named, optimizer, patience)
        pos = Position(state.progress.update, state.dataset.index, state.global_step)
        if critic is not None:
            critic.load_bytes(state.artifacts[VALUE_HEAD])
    rollout_run.start(sinks, cfg, b, p.updates, pos, found)
    result = PPOResult(Path(cfg.output.path), pos.update, pos.global_step, None, 0.0)
    observe = rollout_run.open_observe(cfg, "ppo", settings, pos.update, found, sinks, world)
    program = reward_program(p, "[ppo]")
    try:
        # 3. updates
        for update in range(pos.update + 1, p.updates + 1):
            t0 = time.perf_counter()
            # 3a-b. sample one answer to each of the next rollout_batch_size prompts and
            # reward them in one batch of the reward program (formats.md §2.4), each rank
            # its block of them; every rank gets all the answers
            batch = stream.draw(pos.cursor, p.rollout_batch_size)
            values = {names.GENERATION_SECONDS: 0.0, names.REWARD_SECONDS: 0.0}
            roll = partial(_sample_and_reward, cfg, b, program, update=update, timing=values)
            groups = spread.spread(batch, roll, world)
            answers = [g.members[0] for g in groups]
            lo, hi = spread.block(len(answers), world)
            own = answers[lo:hi]  # this rank's: it scores and back-propagates these
            # 3c-d. scores and advantages
            t1 = time.perf_counter()
            features = _score_features(cfg, model.decoder, own) if critic else None
            old = _old_values(critic, features, world) if critic else None
            returns, values[names.ADVANTAGE_STD] = _advantages(cfg, answers, old)
            values[names.SCORING_SECONDS] = time.perf_counter() - t1
            signal = any(np.any(r.token_advantages != 0) for r in answers)
            for r in answers:
                r.skip_reason = None if signal else "zero_signal"
            if observe is not None:
                observe.rollouts(update, groups)
            values.update(_rollout_metrics(answers))
            # 3e. the policy: ppo_epochs passes, one optimizer step each
            before = pos.global_step
            t1 = time.perf_counter()
            if signal:
                for epoch in range(p.ppo_epochs):
                    lr = lr_at(
                        pos.global_step, steps, b.rate, training.lr_scheduler, training.warmup_steps
                    )
                    out = _epoch(cfg, model.decoder, own, answers, world, epoch == 0)
                    spread.sum_gradients(b.params, world)
                    loss = out[names.TRAIN_LOSS]
                    values[names.GRAD_NORM] = checked_step(
                        b.params, optimizer, training.max_grad_norm, lr, loss, f"update {update}"
                    )
                    pos.global_step += 1
                    b.backend.policy_changed(pos.global_step)
                    values.update(out)
                    values[names.LEARNING_RATE] = lr
            values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
            # 3f. the critic: value_epochs full-batch steps toward the returns
            if critic is not None:
                targets = returns[lo:hi]
                total = sum(r.n_tokens for r in answers)
                values.update(_train_critic(cfg, critic, features, targets, total, update, world))
            for r in answers:
                r.trained = signal
            values[names.TRAINED_FRACTION] = float(signal)
            values[names.OPTIMIZER_STEPS] = pos.global_step
            pos = Position(update, pos.cursor + p.rollout_batch_size, pos.global_step)
            # 3g. report, observe, evaluate, checkpoint
            if observe is not None:
                observe.outcome(update, groups)
                values[names.OBSERVE_DROPPED] = observe.dropped_batches
                observe.update(update, "completed" if signal else "skipped", values)
            tokens = sum(r.n_tokens for r in answers)
            epoch = max(pos.cursor - 1, 0) // len(b.prompts) + 1  # the pass over the prompts
            seconds = time.perf_counter() - t0
            sinks.step(pos.global_step, epoch, values, tokens, seconds, position=update)
            cfg, b.rate = persist.boundary(
                sinks,
                cfg,
                patience,
                lambda c=cfg: rollout_run.measure(c, b.backend, program, b.held),
            )
            result.rewards.append(values[names.REWARD_MEAN])
            log.debug("update %d: %s", update, {k: round(v, 4) for k, v in values.items()})
            mark = pos.mark(critic)
            if b.held is not None and _evaluate_now(cfg, update):
                t1 = time.perf_counter()
                picked = held_out(b.held, cfg.evaluation.max_examples)
                rewards = spread_rewards(b.backend, program, picked, p.sampling, world)
                seconds = time.perf_counter() - t1
                if report_rewards(rewards, pos, patience, result, sinks, seconds):
                    persist.save_best(
                        cfg, run, mark, named, optimizer, plan, patience, steps, sinks
                    )
            persist.maybe_checkpoint(
                cfg, run, mark, named, optimizer, plan, patience, steps, sinks, before
            )
            if patience.stop:
                result.stopped = "patience"
                break
    finally:
        program.close()
        b.backend.close()
        if observe is not None:
            observe.close()
    # 4. export: the adapter alone (the value head lives in checkpoints only)
    mark = pos.mark(critic)
    return rollout_run.finish(cfg, b, run_file, run, mark, patience, steps, result, started, sinks)


# -- sampling, scores and advantages -------------------------------------------------------


def _sample_and_reward(cfg, b, program, part, lo: int, update: int, timing: dict) -> list:
    """One answer to each (cursor, prompt) of this rank's block (groups of one, numbered from
    `lo`), rewarded in one batch of the reward program; the seconds spent into `timing`."""
    p = cfg.ppo
    t0 = time.perf_counter()
    groups = sample_groups(
        b.backend, part, update, lo, size=1, sampling=p.sampling, concurrency=_concurrency(cfg)
    )
    answers = [g.members[0] for g in groups]
    t1 = time.perf_counter()
    if answers:
        replies = program.score([RewardRequest(r.prompt.text, r.text) for r in answers])
        for r, reply in zip(answers, replies, strict=True):
            r.reward_raw = reply.reward
    timing[names.GENERATION_SECONDS] += t1 - t0
    timing[names.REWARD_SECONDS] += time.perf_counter() - t1
    return groups


def _score_features(cfg, decoder, answers: list[Rollout]) -> list[torch.Tensor]:
    """The critic's scoring pass: each answer's final hidden states, stored at feature_dtype on
    the host. The trunk alone runs: the old log-probabilities come from the first policy pass
    (its ratios are exactly 1), so the head's product over the vocabulary is not paid twice."""
    dtype = FEATURE_DTYPES[cfg.ppo.critic.feature_dtype]
    out: list[torch.Tensor | None] = [None] * len(answers)
    for piece in pieces(answers, cfg.training.micro_batch, fanout(cfg.training)):
        for i, h in zip(piece.members, hidden_states(decoder, answers, piece), strict=True):
            out[i] = h.to("cpu", dtype)  # (n_tokens, n_embd)
    return out


def _old_values(critic: ValueHead, features, world) -> list[np.ndarray]:
    """The head's values of every answer's tokens before it trains: each rank's answers from
    its own features, gathered on every rank."""
    with torch.no_grad():
        mine = [critic(f).float().numpy() for f in features]
    return spread.everyone(mine, world)


def _advantages(cfg, answers: list[Rollout], old) -> tuple[torch.Tensor | None, float]:
    """Per-token advantages into each answer's token_advantages (whitened over the update's
    tokens) and its mean into `advantage`; `old`: the head's values of each answer's tokens
    (None without a critic). -> the critic's targets, (B, T) padded, or None without one, and
    the advantages' standard deviation over the tokens before whitening."""
    c = cfg.ppo.critic
    width = max(r.n_tokens for r in answers)
    mask = padded([np.ones(r.n_tokens, np.float32) for r in answers], width)  # (B, T)
    rewards = torch.zeros(len(answers), width, dtype=torch.float64)  # (B, T)
    for i, r in enumerate(answers):
        rewards[i, r.n_tokens - 1] = r.reward
    if old is None:  # the answer's reward on every token: GAE with V = 0, γ = λ = 1
        adv, ret = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    else:
        v = padded(old, width)  # (B, T)
        adv, ret = gae(rewards, v, mask, gamma=c.gamma, lam=c.gae_lambda)
    spread_before = float(adv[mask.bool()].std(unbiased=False))
    adv = whiten(adv, mask)  # (B, T)
    for i, r in enumerate(answers):
        r.token_advantages = adv[i, : r.n_tokens].numpy().astype(np.float32)
        r.advantage = float(r.token_advantages.mean())
    return (ret if old is not None else None), spread_before


def _epoch(
    cfg, decoder, own: list[Rollout], answers: list[Rollout], world, first: bool
) -> dict[str, float]:
    """One pass over this rank's answers (`own`, of the update's `answers`): forward, loss and
    backward per piece, gradients summed (every term is normalised by the update's tokens),
    the terms summed over the ranks. The first pass stores the old log-probabilities it
    computes (its ratios are exactly 1)."""
    p, training = cfg.ppo, cfg.training
    total = float(sum(r.n_tokens for r in answers))
    terms = PolicyTerms(total, len(answers), first=first, is_cap=sampler_cap(training))
    for piece in pieces(own, training.micro_batch, fanout(training)):
        lps = score(decoder, own, piece, training)
        batch = [own[i] for i in piece.members]
        terms.keep_old(batch, lps)
        width = max(len(lp) for lp in lps)
        logp = torch.nn.utils.rnn.pad_sequence(list(lps), batch_first=True)  # (b, T)
        dev = logp.device
        mask = padded([np.ones(len(lp), np.float32) for lp in lps], width).to(dev)
        old = padded([r.old_logprobs for r in batch], width).to(dev)
        adv = padded([r.token_advantages for r in batch], width).to(dev)
        adv = terms.corrected(batch, adv, mask)  # a sampler that is not the trainer
        out = policy_loss(
            logp,
            old,
            adv,
            mask,
            clip_low=p.clip_range,
            clip_high=p.clip_range,
            ref_logp=old,  # KL toward the sampling policy, reported even at coefficient 0
            kl_coef=p.kl_coefficient,
            normalizer=total,
        )
        out.loss.backward()
        terms.add(out, mask, len(batch))
    out = terms.metrics(world)
    del out[names.TOTAL_LOSS]  # PPO reports the total as train/loss alone (formats.md §7.2)
    return out


def _train_critic(
    cfg, critic: ValueHead, features, returns, total: int, update: int, world
) -> dict[str, float]:
    """value_epochs full-batch AdamW steps of the head on the stored features (this rank's
    answers, `returns` their rows; `total` tokens in the update: the loss's normalizer), the
    ranks' gradients summed; -> the mean value loss over the passes and the features' size
    (this rank's)."""
    n_embd = critic.linear.in_features
    dtype = FEATURE_DTYPES[cfg.ppo.critic.feature_dtype]
    feats = torch.cat(features) if features else torch.zeros(0, n_embd, dtype=dtype)  # (N, n_embd)
    target = torch.cat(
        [returns[i, : len(f)] for i, f in enumerate(features)] or [torch.zeros(0)]
    ).float()  # (N,)
    ones = torch.ones_like(target)
    losses = []
    for _ in range(cfg.ppo.critic.value_epochs):
        critic.optimizer.zero_grad(set_to_none=True)
        loss = value_loss(critic(feats), target, ones, normalizer=total)
        loss.backward()
        spread.sum_gradients(list(critic.parameters()), world)
        loss = spread.total({"loss": float(loss.detach())}, world)["loss"]
        if not math.isfinite(loss):
            raise TrainingError(f"update {update}: the value head's loss is {loss}")
        critic.optimizer.step()
        losses.append(loss)
    return {
        names.VALUE_LOSS: float(np.mean(losses)),
        names.FEATURE_MIB: feats.numel() * feats.element_size() / 2**20,
    }


# -- metrics and evaluation ----------------------------------------------------------------


def _rollout_metrics(answers: list[Rollout]) -> dict[str, float]:
    rewards = np.array([r.reward for r in answers], dtype=np.float64)
    lengths = np.array([r.n_tokens for r in answers], dtype=np.float64)
    return {
        names.REWARD_MEAN: float(rewards.mean()),
        names.REWARD_MIN: float(rewards.min()),
        names.REWARD_MAX: float(rewards.max()),
        names.REWARD_STD: float(rewards.std()),
        names.LENGTH_MEAN: float(lengths.mean()),
        names.TRUNCATION_FRACTION: float(np.mean([r.truncated for r in answers])),
        names.ADVANTAGE_ABS_MEAN: float(
            np.mean(np.concatenate([np.abs(r.token_advantages) for r in answers]))
        ),
    }


def _evaluate_now(cfg, update: int) -> bool:
    return update % cfg.evaluation.every_iterations == 0 or update == cfg.ppo.updates
