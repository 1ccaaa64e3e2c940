"""Distillation losses: pure functions of log-probabilities (no model, no records).

On-policy (rl-math.md §3.7, Tinker's on-policy distillation): the student samples an answer,
the teacher scores its tokens, and each sampled token x_t carries the sampled-token estimate of
the reverse KL, k_t = log π_student(x_t) − log p_teacher(x_t). Its advantage is −k_t, capped at
±weight_clip nats (the spec's "cap on a single token's weight"), and the policy loss
(losses/policy.py) trains on it: tokens the teacher finds likelier than the student are pushed
up, the others down. The expectation of Σ_t k_t over the student's samples is KL(student ‖
teacher) of the answer, which this gradient lowers.

Offline top-k: the teacher's k most likely next tokens at every trained position, with their
log-probabilities, stored once (data/topk.py). The loss at a position is the forward KL from
the teacher to the student on k + 1 outcomes, the k tokens and "any other token":
  Σ_i p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail),
p_tail = 1 − Σ p_i, q_tail = 1 − Σ q_i. It is ≥ 0 and 0 exactly when the student gives the k
tokens the teacher's probabilities (the tail then matches too), so it never pulls the student
to renormalise over the k tokens alone (ART's top-k distillation keeps the tail the same way).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reverse_kl_advantages(
    student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, weight_clip: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(B, T) log-probabilities of the sampled tokens -> per token (advantage, k, clipped):
    k = student − teacher (the reverse-KL estimate, 0 off the mask), advantage = −k capped at
    ±weight_clip (0 off the mask), clipped = where the cap bit (bool, False off the mask)."""
    assert weight_clip > 0, weight_clip
    keep = mask.bool()
    k = torch.where(keep, student_logp.float() - teacher_logp.float(), 0.0)
    clipped = keep & (k.abs() > weight_clip)
    return -k.clamp(-weight_clip, weight_clip), k, clipped


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − e^x) for x < 0, accurate at both ends (Mächler's two branches)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """(N, k) log-probabilities of the teacher's top-k tokens, under the student (normalised
    over the whole vocabulary) and the teacher -> (N,) KL(teacher ‖ student) over the k tokens
    and the tail bucket. Differentiable through student_logp; float32 at least."""
    dtype = torch.promote_types(student_logp.dtype, torch.float32)
    s, t = student_logp.to(dtype), teacher_logp.to(dtype)
    p = t.exp()
    head = (p * (t - s)).sum(-1)
    t_tail = log1mexp(torch.logsumexp(t, -1))
    s_tail = log1mexp(torch.logsumexp(s, -1))
    return head + t_tail.exp() * (t_tail - s_tail)


def full_kl(student_logits: Tensor, teacher_logits: Tensor) -> tuple[Tensor, Tensor]:
    """(N, V) logits -> per position (KL(teacher ‖ student), KL(student ‖ teacher)), float32."""
    s = torch.log_softmax(student_logits.float(), -1)
    t = torch.log_softmax(teacher_logits.float(), -1)
    forward = (t.exp() * (t - s)).sum(-1)
    reverse = (s.exp() * (s - t)).sum(-1)
    return forward, reverse
