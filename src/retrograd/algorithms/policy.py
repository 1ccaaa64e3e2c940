"""The policy update every rollout loop makes: epochs passes over the update's answers, each a
forward, the clipped surrogate (losses/policy.py), backward, the ranks' gradients summed and
one checked optimizer step.

A loop says what differs in a `Surrogate` (its section's clip range, ratio level and KL
term: read once) and a `Pass` (what normalises the loss, which tokens train, how advantages
and the first pass's old log-probabilities are set). The pass's terms and statistics are
policy_terms.py's. Knows the decoder, the rollout records and the frame's optimizer step;
not sampling, rewards or advantages, which the loop computes before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from retrograd.algorithms import frame
from retrograd.algorithms.policy_terms import PolicyTerms, sampler_cap
from retrograd.losses.policy import policy_loss
from retrograd.observe import names
from retrograd.rollout.passes import fanout, padded, pieces, score
from retrograd.rollout.records import Rollout


@dataclass(frozen=True)
class Surrogate:
    """A section's surrogate keys: the clip range, the ratio's level (token, or sequence:
    GSPO), the KL coefficient, and whether the KL term is toward the reference (ref_logprobs)
    or toward the policy that sampled (PPO: the old log-probabilities, reported at 0 too);
    anchor_coef: PPO's second KL term, toward the reference (ref_logprobs), on every pass."""

    clip_low: float
    clip_high: float
    level: str = "token"
    kl_coef: float = 0.0
    kl_to_old: bool = False
    anchor_coef: float = 0.0

    @classmethod
    def of(cls, section, *, kl_coef: float | None = None) -> Surrogate:
        """[grpo], [distill], [agent] (clip_range_low/high) or [ppo] (clip_range)."""
        if hasattr(section, "clip_range"):
            low = high = section.clip_range
        else:
            low, high = section.clip_range_low, section.clip_range_high
        level = getattr(section, "importance_sampling_level", "token")
        coef = section.kl_coefficient if kl_coef is None else kl_coef
        ppo = hasattr(section, "clip_range")
        anchor = section.reference_kl_coefficient if ppo else 0.0
        return cls(low, high, level, coef, kl_to_old=ppo, anchor_coef=anchor)


@dataclass(frozen=True)
class Pass:
    """How a loop's passes read its answers. normalizer: the loss's denominator (the update's
    trained tokens; agent: its token budget x trajectories); tokens: what the pieces' shares,
    the sampler gap and the entropy are over (agent: the policy's own tokens); answers: the
    update's trained answers; by_answer: statistics shared by answers (GRPO at sequence
    level) rather than by tokens; advantages: "answer" (one a row),
    "token" (token_advantages) or "either" (token_advantages where an answer has them);
    masked: only token_mask's tokens train (agent); on_first: called with the answers a
    first pass just scored (their old log-probabilities set), before their loss (distill sets
    its advantages there); is_cap: C of the truncated importance weights for answers a
    sampler other than the trainer drew (a caller's own rollouts with their behaviour
    log-probabilities), where [training].rollout_backend alone would not correct."""

    normalizer: float
    tokens: float
    answers: int
    by_answer: bool = False
    advantages: str = "answer"
    masked: bool = False
    on_first: Callable[[list[Rollout]], None] | None = None
    is_cap: float | None = None


def train(
    run: frame.Run,
    backend,
    own: list[Rollout],
    surrogate: Surrogate,
    shape: Pass,
    epochs: int,
    where: str,
    step: int,
) -> tuple[int, dict[str, float]]:
    """`epochs` passes over this rank's answers (`own`), one checked optimizer step each (the
    ranks' gradients summed before it); the backend told of each new policy (None: a caller's
    own rollouts). -> (the global step after them, the last pass's values with the rate and the
    gradient norm)."""
    values: dict[str, float] = {}
    for epoch in range(epochs):
        out = policy_pass(run, own, surrogate, shape, first=epoch == 0)
        run.replicas.sum_step(run.tr.params)
        rate, norm = frame.optimizer_step(run, step, out[names.TRAIN_LOSS], where)
        step += 1
        if backend is not None:
            backend.policy_changed(step)
        values.update(out)
        values[names.LEARNING_RATE], values[names.GRAD_NORM] = rate, norm
    return step, values


def policy_pass(
    run: frame.Run, own: list[Rollout], surrogate: Surrogate, shape: Pass, first: bool
) -> dict[str, float]:
    """One pass over this rank's answers: forward, loss and backward per piece (the loss is a
    sum over the update's tokens divided by the normalizer, so the pieces' gradients add up to
    the whole update's); the terms summed over the ranks. The first pass keeps the old
    log-probabilities it computes (ratios exactly 1)."""
    training, decoder = run.cfg.training, run.model.decoder
    cap = shape.is_cap if shape.is_cap is not None else sampler_cap(training)
    s = surrogate
    terms = PolicyTerms(shape.tokens, shape.answers, shape.by_answer, first, cap, s.anchor_coef > 0)
    for piece in pieces(own, training.micro_batch, fanout(training)):
        lps = score(decoder, own, piece, training)
        batch = [own[i] for i in piece.members]
        fresh = [r for r in batch if r.old_logprobs is None]
        terms.keep_old(batch, lps, masked=shape.masked)
        if fresh and shape.on_first is not None:
            shape.on_first(fresh)
        width = max(len(lp) for lp in lps)
        logp = torch.nn.utils.rnn.pad_sequence(list(lps), batch_first=True)  # (b, T)
        dev = logp.device
        mask = _mask(batch, lps, width, shape.masked).to(dev)
        old = padded([r.old_logprobs for r in batch], width).to(dev)
        adv = _advantages(batch, width, shape.advantages).to(dev)
        adv = terms.corrected(batch, adv, mask)  # a sampler that is not the trainer
        if s.kl_to_old:
            ref = old
        elif s.kl_coef > 0:
            ref = padded([r.ref_logprobs for r in batch], width).to(dev)
        else:
            ref = None
        anchor = None
        if s.anchor_coef > 0:
            anchor = padded([r.ref_logprobs for r in batch], width).to(dev)
        out = policy_loss(
            logp,
            old,
            adv,
            mask,
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            level=s.level,
            ref_logp=ref,
            kl_coef=s.kl_coef,
            anchor_logp=anchor,
            anchor_coef=s.anchor_coef,
            normalizer=shape.normalizer,
        )
        out.loss.backward()
        # the pieces' terms are sums over the update's tokens: they add up to the whole's
        terms.add(out, mask, len(batch))
    return terms.metrics(run.world)


def _mask(batch: list[Rollout], lps, width: int, masked: bool) -> torch.Tensor:
    if masked:
        return padded([r.token_mask for r in batch], width)
    return padded([np.ones(len(lp), np.float32) for lp in lps], width)


def _advantages(batch: list[Rollout], width: int, kind: str) -> torch.Tensor:
    """(b,) one advantage an answer, or (b, T) one a token."""
    if kind == "either" and any(r.token_advantages is not None for r in batch):
        per_token = [
            r.token_advantages
            if r.token_advantages is not None
            else np.full(r.n_tokens, r.advantage, np.float32)
            for r in batch
        ]
        return padded(per_token, width)
    if kind == "token":
        return padded([r.token_advantages for r in batch], width)
    return torch.tensor([r.advantage for r in batch], dtype=torch.float32)


def kept(values: dict[str, float], keys) -> dict[str, float]:
    """The values a loop reports of a pass's (its metric list, docs/metrics.md)."""
    return {k: v for k, v in values.items() if k in keys}
