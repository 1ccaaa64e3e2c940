"""Mixtures of experts: experts kept in their 3-D GGUF tensors, routed as llama.cpp routes.

(Being written: routing and the expert products land with the MoE families.)
"""

from __future__ import annotations

import torch
from torch import nn

from retrograd.model.frozen import FrozenTensor


class Experts(nn.Module):
    """One 3-D expert tensor (n_expert, n_out, n_in) as stored, and its bias (n_expert, n_out)."""

    def __init__(self, frozen: FrozenTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.frozen = frozen
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.lora: nn.Module | None = None

    @property
    def n_expert(self) -> int:
        return self.frozen.shape[0]

    def extra_repr(self) -> str:
        e, o, i = self.frozen.shape
        return f"{e} experts, {i} -> {o}, {self.frozen.ggml_type.name}"


def ffn(block, h: torch.Tensor, ctx) -> torch.Tensor:
    raise NotImplementedError("mixture-of-experts layers land with the MoE families")
