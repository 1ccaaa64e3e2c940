"""Gefen: Adam with one second moment per block of parameters, for less optimizer memory.

Each parameter of at least `min_numel` elements is cut into blocks of `block_size` elements
(in storage order; the last block may be shorter). Its second moment is one number per block,
the running mean of the squared gradient over the block (bias-corrected, as Adam's). The
first moment is kept per element, in float32 (`shared_v`: about 4 bytes of state per
parameter against AdamW's 8), or in 8 bits (`quantized_m`: a uniform 256-level code per
element and one float32 scale per block, its largest magnitude / 127: about 1 byte). Weight
decay is decoupled. Smaller parameters go to AdamW (`gefen_with_adamw`). The state holds
tensors only, so checkpoints keep it exactly; the two variants' slots differ, and resume
refuses a change of variant by name (checkpoint/run.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from retrograd.optim.muon import Joined, adamw


class Gefen(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float = 0.0,
        variant: str = "shared_v",
        block_size: int = 1024,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        if variant not in ("shared_v", "quantized_m"):
            raise ValueError(f"Gefen variant {variant!r}: must be shared_v or quantized_m")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            variant=variant,
            block_size=block_size,
            betas=betas,
            eps=eps,
            lr_scale=1.0,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        b1, b2 = group["betas"]
        size, quantized = group["block_size"], group["variant"] == "quantized_m"
        state = self.state[p]
        n = p.numel()
        n_blocks = math.ceil(n / size)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
            if quantized:
                state["exp_avg_code"] = torch.zeros(n, dtype=torch.int8, device=p.device)
                state["exp_avg_scale"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
            else:
                state["exp_avg"] = torch.zeros(n, dtype=torch.float32, device=p.device)
        grad = p.grad.reshape(-1).float()  # (n,)
        pad = n_blocks * size - n
        counts = torch.full((n_blocks,), float(size), device=p.device)
        counts[-1] = n - (n_blocks - 1) * size
        block_sq = F.pad(grad.square(), (0, pad)).view(n_blocks, size).sum(1) / counts
        v = state["exp_avg_sq"]
        v.mul_(b2).add_(block_sq, alpha=1 - b2)  # (n_blocks,)
        m = dequantize_m(state, n, size) if quantized else state["exp_avg"]
        m.mul_(b1).add_(grad, alpha=1 - b1)  # (n,)
        state["step"] += 1
        t = float(state["step"])
        denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])  # (n_blocks,)
        update = m / denom.repeat_interleave(size)[:n]
        lr = group["lr"]
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(update.view(p.shape).to(p.dtype), alpha=-lr / (1 - b1**t))
        if quantized:
            quantize_m(state, m, n, size)


def dequantize_m(state: dict, n: int, size: int) -> torch.Tensor:
    """The first moment (n,) float32 from its 8-bit codes and per-block scales."""
    scale = state["exp_avg_scale"].repeat_interleave(size)[:n]
    return state["exp_avg_code"].float() * scale


def quantize_m(state: dict, m: torch.Tensor, n: int, size: int) -> None:
    """Store `m` (n,) as codes in [-127, 127] times its block's largest magnitude / 127."""
    n_blocks = state["exp_avg_scale"].numel()
    absmax = F.pad(m.abs(), (0, n_blocks * size - n)).view(n_blocks, size).amax(1)
    scale = absmax / 127.0
    state["exp_avg_scale"].copy_(scale)
    per = scale.repeat_interleave(size)[:n]
    codes = torch.where(per > 0, m / per.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    state["exp_avg_code"].copy_(codes.round_().clamp_(-127, 127).to(torch.int8))


def gefen_with_adamw(params, lr: float, weight_decay: float, cfg) -> torch.optim.Optimizer | Joined:
    """Gefen over parameters of at least cfg.min_numel elements, AdamW over the rest."""
    big = [p for p in params if p.numel() >= cfg.min_numel]
    small = [p for p in params if p.numel() < cfg.min_numel]
    parts: list[torch.optim.Optimizer] = []
    if big:
        parts.append(
            Gefen(
                big,
                lr,
                weight_decay,
                cfg.variant,
                cfg.block_size,
                (cfg.beta1, cfg.beta2),
                cfg.eps,
            )
        )
    if small:
        parts.append(adamw(small, lr, weight_decay))
    return parts[0] if len(parts) == 1 else Joined(parts)


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors (what a checkpoint's optimizer-state.bin holds)."""
    parts = optimizer.parts if isinstance(optimizer, Joined) else [optimizer]
    total = 0
    for part in parts:
        for slots in part.state.values():
            total += sum(t.numel() * t.element_size() for t in slots.values() if torch.is_tensor(t))
    return total
