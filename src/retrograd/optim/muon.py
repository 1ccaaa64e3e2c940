"""Muon for the 2-D hidden weight matrices, AdamW for every other trained parameter.

Muon is PyTorch's own (`torch.optim.Muon`): momentum (`lerp` form), Nesterov, then the
quintic Newton-Schulz orthogonalization of the update (`ns_steps`, normalised with
`ns_epsilon`), Keller Jordan's learning-rate adjustment sqrt(max(1, rows / cols)) and
decoupled weight decay. tests/unit/optim checks it against a direct implementation of the
algorithm. Everything else (vectors, the output head, LoRA factors) goes to AdamW at
[optimizer.muon].fallback_learning_rate. The two run as one optimizer (`Joined`), so a
checkpoint holds one state and the schedule sets both rates. This module knows torch
optimizers, not the model.
"""

from __future__ import annotations

import torch


class Joined:
    """Torch optimizers over disjoint parameters, seen as one: param_groups in order, one
    state dict whose parameter indices run across them, as `torch.optim.Optimizer` numbers
    them. Each group's `lr_scale` multiplies the rate the schedule sets (step.clip_and_step)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self):
        return {p: s for part in self.parts for p, s in part.state.items()}

    def step(self, closure=None) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({i + offset: s for i, s in sd["state"].items()})
            groups += [
                {**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        offset, first = 0, 0
        for part in self.parts:
            groups = sd["param_groups"][first : first + len(part.param_groups)]
            n = sum(len(g["params"]) for g in groups)
            part.load_state_dict(
                {
                    "state": {
                        i - offset: s for i, s in sd["state"].items() if offset <= i < offset + n
                    },
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in groups
                    ],
                }
            )
            offset += n
            first += len(groups)


def adamw(params, lr: float, weight_decay: float, lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """The AdamW every optimizer falls back to (betas 0.9, 0.999; eps 1e-8): PyTorch's over
    float32 parameters, `AdamW16` where a 16-bit tensor trains itself (master_weights = off)."""
    params = list(params)
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    kind = AdamW16 if low else torch.optim.AdamW
    opt = kind(params, lr=lr * lr_scale, weight_decay=weight_decay, eps=1e-8)
    for g in opt.param_groups:
        g["lr_scale"] = lr_scale
    return opt


class AdamW16(torch.optim.Optimizer):
    """AdamW for parameters stored in f16 or bf16 (and f32 beside them): the moments and the
    update in float32, the new weight stochastically rounded to the parameter's type.

    NOTE: PyTorch's AdamW keeps a 16-bit parameter's moments in its own type: in f16 the
    second moment underflows to zero and eps (1e-8) with it, and the first step divides by
    zero. Rounding to nearest would also drop every update below half a 16-bit step; rounding
    up with probability (distance to the lower neighbour / step) keeps them in expectation.
    The random draws come from a generator seeded by (step, parameter index), so a resumed
    run rounds exactly as an uninterrupted one.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        index = 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.float()
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                w = p.float() * (1 - group["lr"] * group["weight_decay"])
                w.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))
                seed = int(t) * 1_000_003 + index
                p.copy_(stochastic_round(w, p.dtype, seed))


def stochastic_round(w: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`w` (float32) in `dtype`, each value rounded to one of its two neighbours with
    probability proportional to closeness (unbiased); exact for float32."""
    if dtype == torch.float32:
        return w
    near = w.to(dtype)
    nf = near.float()
    away = torch.where(nf > w, float("-inf"), float("inf")).to(dtype)
    other = torch.nextafter(near, away)
    gap = (other.float() - nf).abs()
    chance = torch.where(gap > 0, (w - nf).abs() / gap.clamp_min(1e-38), 0.0)
    gen = torch.Generator(device=w.device).manual_seed(seed)
    u = torch.rand(w.shape, generator=gen, device=w.device)
    return torch.where(u < chance, other, near)


def muon_with_adamw(
    matrices: list[torch.nn.Parameter],
    others: list[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    muon,
) -> torch.optim.Optimizer | Joined:
    """Muon at `lr` over `matrices`, AdamW at muon.fallback_learning_rate over `others`."""
    parts: list[torch.optim.Optimizer] = []
    if matrices:
        opt = torch.optim.Muon(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=muon.momentum,
            nesterov=muon.nesterov,
            ns_steps=muon.ns_steps,
            eps=muon.ns_epsilon,
        )
        for g in opt.param_groups:
            g["lr_scale"] = 1.0
        parts.append(opt)
    if others:
        parts.append(adamw(others, lr, weight_decay, muon.fallback_learning_rate / lr))
    return parts[0] if len(parts) == 1 else Joined(parts)
