"""PPO: proximal policy optimisation of a LoRA adapter, scored by a reward program, with an
optional value head (critic) and GAE advantages.

Each update: 1. draw rollout_batch_size prompts, one answer each  2. reward them in one batch
3. score them (the critic's features; the old log-probabilities come from the first policy
pass)  4. advantages  5. ppo_epochs optimizer passes (policy.py)  6. value_epochs passes of the value head
7. report, observe, evaluate, checkpoint (frame.py). The variant (losses/policy.py and losses/value.py say the formulas):
- the loss is the clipped surrogate with one clip range (clip_range on both sides), per-token
  advantages, averaged over the update's tokens (token mean), plus kl_coefficient times the k3
  estimate of KL toward the policy that sampled the batch (spec: not toward [reference]; the
  first pass's term is 0, later passes hold the policy near the sampler), not a per-token
  reward penalty as in TRL's PPO; and, ours (the spec has no such key), plus
  reference_kl_coefficient times the same term toward the reference (the base model with the
  adapter off, or [reference].model), which acts from the first pass: the anchor TRL's PPO
  has (as a per-token reward there) and GRPO's example needed, which holds the text the reward
  does not score (after the answer) near the reference's. Off (0) by default; on, the
  reference scores each answer once an update (step 3);
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
from functools import partial

import numpy as np
import torch

from retrograd.algorithms import context, frame, policy
from retrograd.algorithms.evaluate import prompt_evaluation
from retrograd.errors import RewardError, TrainingError
from retrograd.losses.value import explained_variance, gae, value_loss, whiten
from retrograd.observe import names
from retrograd.rewards.callables import open_rewards
from retrograd.rewards.program import RewardRequest
from retrograd.rollout import spread
from retrograd.rollout.metrics import answer_metrics, reward_metrics
from retrograd.rollout.passes import attach_logprobs, fanout, hidden_states, padded, pieces
from retrograd.rollout.records import Rollout
from retrograd.rollout.sample import PromptStream, pass_over, read_prompt_files, sample_groups
from retrograd.sampling.backend import sampler_identity
from retrograd.trainable.value_head import FEATURE_DTYPES, ValueHead

log = logging.getLogger(__name__)
VALUE_HEAD = "value-head.pt"  # the checkpoint artifact of the critic
# [ppo] keys that change no step: a resumed run may change them
_NOT_TRAJECTORY = {"prompts", "reward_command", "reward_mode", "reward_timeout_seconds"}


def _not_trajectory(p) -> set[str]:
    """The keys left out of the resume signature: those that change no step, and
    reference_kl_coefficient at its default 0 (a checkpoint made before the key existed
    resumes)."""
    return _NOT_TRAJECTORY | (
        {"reference_kl_coefficient"} if not p.reference_kl_coefficient else set()
    )


def total_steps(cfg) -> int:
    return cfg.ppo.updates * cfg.ppo.ppo_epochs


def _concurrency(cfg) -> int:
    """The reference's default: min(answers of an update, the optimizer window (ctx), 256)."""
    t = cfg.training
    return t.generation_concurrency or min(cfg.ppo.rollout_batch_size, t.ctx, 256)


def run_ppo(cfg, door=None, *, resume=None, sinks=None, run_file=None) -> frame.Result:
    p, t = cfg.ppo, cfg.training
    # 1. build: everything that can be checked is checked before the model loads
    context.check_fanout(t, "ppo")
    door = frame.prepare(cfg, door, resume=resume, sinks=sinks, run_file=run_file)
    files = read_prompt_files(cfg, p.prompts, "[ppo].prompts", extra_keys=bool(door.rewards))
    model = frame.model_of(cfg, door)
    prompts, held = files.render(context.chat_format(model), t.ctx)
    settings = {"ppo": p.model_dump(mode="json", exclude=_not_trajectory(p)), **sampler_identity(t)}
    if p.reference_kl_coefficient > 0:
        settings["reference"] = context.reference_id(cfg)
    inputs = frame.Inputs(files.fingerprints, settings, *files.described(prompts, held))
    label = "mean reward, first -> last update"
    shape = frame.Shape(total_steps(cfg), p.updates, "update", names.REWARD_MEAN, label)
    run = frame.open_run(cfg, model, door, inputs, shape, observe="ppo")
    critic = ValueHead(model.config.n_embd, p.critic.value_lr) if p.critic.enabled else None
    anchor = context.reference(cfg, model, run.tr.adapters) if p.reference_kl_coefficient else None
    if critic is not None and run.restored is not None:
        critic.load_bytes(run.restored.artifacts[VALUE_HEAD])
    artifacts = {VALUE_HEAD: critic.state_bytes} if critic is not None else {}
    backend = context.rollout_backend(run, _concurrency(cfg))
    program = run.closing.enter_context(open_rewards(p, "[ppo]", door.rewards, door.reward_weights))
    run = frame.evaluate_with(run, prompt_evaluation(backend, program, held, p.sampling, run.world))
    stream = PromptStream(prompts, "sequential", p.sampling.seed)
    pos, world = run.position, run.world
    with run.closing:
        for update in range(pos.update + 1, p.updates + 1):
            began, before = time.perf_counter(), pos.global_step
            # 1-2. one answer to each of the next rollout_batch_size prompts, rewarded in one
            # batch of the reward program (formats.md §2.4), each rank its block of them
            groups, values = _rollouts(
                run, backend, program, stream.draw(pos.index, p.rollout_batch_size), update
            )
            answers = [g.members[0] for g in groups]
            lo, hi = spread.block(len(answers), world)
            own = answers[lo:hi]  # this rank's: it scores and back-propagates these
            # 3-4. the critic's features and old values; advantages (none equal: a signal);
            # the reference's log-probabilities of this rank's answers (its KL term on)
            features, returns, signal = _advantages_of(run, critic, answers, own, values)
            if anchor is not None and signal:
                t2 = time.perf_counter()
                attach_logprobs(anchor, run.model.decoder, own, t, "ref_logprobs")
                values[names.SCORING_SECONDS] += time.perf_counter() - t2
            frame.observe_rollouts(run, update, groups)
            # 5. the policy: ppo_epochs passes, one optimizer step each
            step, t1 = pos.global_step, time.perf_counter()
            if signal:
                tokens = float(sum(r.n_tokens for r in answers))
                shape = policy.Pass(tokens, tokens, len(answers), advantages="token")
                surrogate = policy.Surrogate.of(p)
                step, out = policy.train(
                    run, backend, own, surrogate, shape, p.ppo_epochs, f"update {update}", step
                )
                del out[names.TOTAL_LOSS]  # PPO reports the total as train/loss alone (§7.2)
                values.update(out)
            values[names.OPTIMIZER_SECONDS] = time.perf_counter() - t1
            # 6. the critic: value_epochs full-batch steps toward the returns
            if critic is not None:
                total = sum(r.n_tokens for r in answers)
                values.update(
                    _train_critic(cfg, critic, features, returns[lo:hi], total, update, world)
                )
            for r in answers:
                r.trained = signal
            values[names.TRAINED_FRACTION] = float(signal)
            values[names.OPTIMIZER_STEPS] = step
            pos = pos.after_update(update, pos.index + p.rollout_batch_size, step)
            # 7. report, observe, evaluate, checkpoint
            tokens = sum(r.n_tokens for r in answers)
            epoch = pass_over(pos.index, len(prompts))
            report = frame.Report(
                values, tokens, began, epoch, before, trained=signal, groups=groups,
                artifacts=artifacts,
            )  # fmt: skip
            if frame.after_step(run, pos, report):
                break
    # export: the adapter alone (the value head lives in checkpoints only)
    return frame.finish(run, pos, artifacts=artifacts)


# -- sampling, scores and advantages -------------------------------------------------------


def _rollouts(run, backend, program, batch, update: int) -> tuple[list, dict[str, float]]:
    """The update's groups of one answer, sampled and rewarded by each rank's block of the
    (cursor, prompt) `batch` and gathered on every rank, and their timings."""
    values = {names.GENERATION_SECONDS: 0.0, names.REWARD_SECONDS: 0.0}
    roll = partial(_sample_and_reward, run.cfg, backend, program, update=update, timing=values)
    return spread.spread(batch, roll, run.world), values


def _advantages_of(run, critic, answers: list[Rollout], own: list[Rollout], values: dict):
    """The critic's features of this rank's answers and every answer's old values, the
    advantages, and the update's rollout metrics into `values`. -> (features, the critic's
    targets, whether the advantages carry a signal: a batch whose every advantage is 0 does
    not train the policy)."""
    cfg, t1 = run.cfg, time.perf_counter()
    features = _score_features(cfg, run.model.decoder, own) if critic else None
    old = _old_values(critic, features, run.world) if critic else None
    returns, values[names.ADVANTAGE_STD], explained = _advantages(cfg, answers, old)
    if math.isfinite(explained):
        values[names.EXPLAINED_VARIANCE] = explained
    values[names.SCORING_SECONDS] = time.perf_counter() - t1
    signal = any(np.any(r.token_advantages != 0) for r in answers)
    for r in answers:
        r.skip_reason = None if signal else "zero_signal"
    values.update(reward_metrics(answers) | answer_metrics(answers))
    values[names.ADVANTAGE_ABS_MEAN] = float(
        np.mean(np.concatenate([np.abs(r.token_advantages) for r in answers]))
    )
    return features, returns, signal


def _sample_and_reward(cfg, backend, program, part, lo: int, update: int, timing: dict) -> list:
    """One answer to each (cursor, prompt) of this rank's block (groups of one, numbered from
    `lo`), rewarded in one batch of the reward program; the seconds spent into `timing`."""
    p = cfg.ppo
    t0 = time.perf_counter()
    groups = sample_groups(
        backend, part, update, lo, size=1, sampling=p.sampling, concurrency=_concurrency(cfg)
    )
    answers = [g.members[0] for g in groups]
    t1 = time.perf_counter()
    if answers:
        requests = [RewardRequest(r.prompt.text, r.text, r.prompt.record) for r in answers]
        replies = program.score(requests)
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


def _advantages(cfg, answers: list[Rollout], old) -> tuple[torch.Tensor | None, float, float]:
    """Per-token advantages into each answer's token_advantages (whitened over the update's
    tokens) and its mean into `advantage`; `old`: the head's values of each answer's tokens
    (None without a critic). -> the critic's targets, (B, T) padded, or None without one, the
    advantages' standard deviation over the tokens before whitening, and the share of the
    returns' variance the old values explain (NaN without a critic). Raises RewardError when
    the rewards are too large for that arithmetic."""
    c = cfg.ppo.critic
    width = max(r.n_tokens for r in answers)
    mask = padded([np.ones(r.n_tokens, np.float32) for r in answers], width)  # (B, T)
    rewards = torch.zeros(len(answers), width, dtype=torch.float64)  # (B, T)
    for i, r in enumerate(answers):
        rewards[i, r.n_tokens - 1] = r.reward
    explained = float("nan")
    if old is None:  # the answer's reward on every token: GAE with V = 0, γ = λ = 1
        adv, ret = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    else:
        v = padded(old, width)  # (B, T)
        adv, ret = gae(rewards, v, mask, gamma=c.gamma, lam=c.gae_lambda)
        explained = explained_variance(v, ret, mask)
    spread_before = float(adv[mask.bool()].std(unbiased=False))
    adv = whiten(adv, mask)  # (B, T)
    if not (torch.isfinite(adv).all() and torch.isfinite(ret.float()).all()):
        top = max(answers, key=lambda r: abs(r.reward))
        raise RewardError(
            f"update {top.update}: the rewards (up to {top.reward!r}, answer {top.group}) "
            f"overflow the advantages' arithmetic (float64, the critic's targets float32): "
            f"scale the rewards down"
        )
    for i, r in enumerate(answers):
        r.token_advantages = adv[i, : r.n_tokens].numpy().astype(np.float32)
        r.advantage = float(r.token_advantages.mean())
    return (ret if old is not None else None), spread_before, explained


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
