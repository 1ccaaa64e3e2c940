"""The decoder's building blocks: RMSNorm, a linear over a frozen GGUF weight, activations.

`Linear` holds a FrozenTensor (the file's bytes) and optionally a trainable adapter in
`lora`; the full, partial and hybrid modes give it a trained `weight` (trainable/base.py)
that replaces the frozen one. Norm weights are small float tensors kept as (frozen) float32
Parameters so that modes that train them only flip requires_grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from retrograd.model.frozen import FrozenTensor, frozen_linear
from retrograd.model.lora_product import frozen_lora, fusable


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, in float32 whatever the input dtype."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Linear(nn.Module):
    """y = x W^T (+ bias) (+ adapter(x)), W frozen as stored in the GGUF."""

    def __init__(self, frozen: FrozenTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.frozen = frozen
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.lora: nn.Module | None = None
        # A trained weight replaces `frozen`: the Parameter the optimizer updates, read through
        # `weight_dtype` (the storage type, when the Parameter is an f32 master copy of it).
        self.weight: nn.Parameter | None = None
        self.weight_dtype: torch.dtype | None = None

    def train_weight(self, weight: nn.Parameter, storage: torch.dtype) -> None:
        """From now on the product reads `weight` (rounded to `storage`), not the file's bytes."""
        self.weight = weight
        self.weight_dtype = storage if weight.dtype != storage else None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The trained weight as the model sees it: in its storage type, then `dtype`."""
        w = self.weight
        if self.weight_dtype is not None:
            w = w.to(self.weight_dtype)  # the master copy rounded as the file would store it
        return w.to(dtype)

    @property
    def in_features(self) -> int:
        return self.frozen.shape[1]

    @property
    def out_features(self) -> int:
        return self.frozen.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            w = self.dense_weight(x.dtype)  # (n_out, n_in)
            y = F.linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
            return self.finish(x, y)
        fused = fused_lora(x, (self,))
        if fused is not None:
            return fused[0]
        return self.finish(x, frozen_linear(x, self.frozen))

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The frozen product y = x W^T plus bias and adapter."""
        return finish(y, x, self.bias, self.adapter())

    def adapter(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(A, B, scale) of the adapter when one is attached and on (trainable/lora.py)."""
        lora = self.lora
        if lora is None or not lora.enabled:
            return None
        return lora.lora_a, lora.lora_b, float(lora.scale)

    def extra_repr(self) -> str:
        f = self.frozen
        trained = ", trained" if self.weight is not None else ""
        return f"{f.shape[1]} -> {f.shape[0]}, {f.ggml_type.name}{trained}"


def fused_lora(x: torch.Tensor, linears) -> list[torch.Tensor] | None:
    """The outputs of frozen linears sharing the input x, each with its adapter, from one
    function (model/lora_product.py) where it applies: every linear frozen, without bias, with
    a 2-D adapter switched on; None otherwise."""
    adapters = [lin.adapter() for lin in linears]
    if any(a is None or a[0].dim() != 2 for a in adapters):
        return None
    if any(lin.weight is not None or lin.bias is not None for lin in linears):
        return None
    frozen = [lin.frozen for lin in linears]
    return frozen_lora(x, frozen, adapters) if fusable(x, frozen) else None


def finish(y: torch.Tensor, x: torch.Tensor, bias, adapter) -> torch.Tensor:
    """A linear's frozen product y = x W^T plus its bias and adapter = (A, B, scale) or None:
    y + scale * B (A x), in y's dtype. A linear calls it eagerly, the decode graph inside."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y if adapter is None else add_lora(y, x, *adapter)


def add_lora(y: torch.Tensor, x: torch.Tensor, a, b, scale: float) -> torch.Tensor:
    """y + scale * B (A x) in y's dtype, with the scale folded into B and the sum done by the
    second matmul (addmm): two fewer passes over (tokens x n_out) per adapted linear."""
    xa = x.reshape(-1, x.shape[-1]) @ a.to(x.dtype).T  # (N, r)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.to(y.dtype), (b * scale).to(y.dtype).T)
    return out.view(y.shape)


def gelu_tanh(x: torch.Tensor, f16_table: bool) -> torch.Tensor:
    """GELU (tanh form). With f16_table, forward values are llama.cpp's CPU ones.

    NOTE: ggml's CPU GELU looks the value up in a table indexed by x rounded to f16 and stores
    f16 results (|x| < 10). The exact path reproduces that in forward and keeps the true
    derivative in backward (straight-through), so training gradients are unaffected.
    """
    y = F.gelu(x, approximate="tanh")
    if not f16_table:
        return y
    with torch.no_grad():
        table = F.gelu(x.half().float(), approximate="tanh").half().float()
        table = torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))
    return y + (table - y).detach()


def silu(x: torch.Tensor, f16_table: bool) -> torch.Tensor:
    return F.silu(x)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
