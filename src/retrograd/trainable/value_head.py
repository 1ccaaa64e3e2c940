"""PPO's value head: one linear map from the model's final hidden states to a value per token,
with its own optimizer, and its checkpoint bytes.

It reads stored features (the hidden states the policy's scoring pass produced, detached), so
it never back-propagates into the model and the adapter never sees its gradient. It is not
part of the adapter: the LoRA GGUF export never holds it; checkpoints keep it as an artifact.
Starts at zero (every value 0): no seed to derive, and the first update's advantages are the
rewards' own (GAE with V = 0).

NOTE: the head reads each feature vector scaled to norm 1 (RMS-normalised, divided by
√n_embd). Hidden states differ in scale from model to model (Gemma's final norm weights reach
the tens), and Adam moves every weight by about value_lr a step whatever its gradient: on raw
features one step could move a value by value_lr · |h|_1, far past rewards in [0, 1]. On unit
features a step moves a value by value_lr · (1 + |ĥ|_1) at most, value_lr · (1 + √n_embd) where
every feature agrees, about 2 · value_lr where they do not, on any model.
"""

from __future__ import annotations

import io

import torch
from torch import nn

FEATURE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class ValueHead(nn.Module):
    """V(h) = w·ĥ + b, ĥ = h / |h|_2 (rms(h) √n_embd), on float32 features."""

    def __init__(self, n_embd: int, lr: float):
        super().__init__()
        self.linear = nn.Linear(n_embd, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        # no weight decay: the head is a regression, and the spec gives it only a rate
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(..., n_embd) in any float dtype -> (...) float32."""
        h = features.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) * h.shape[-1] + 1e-12)
        return self.linear(h).squeeze(-1)

    def state_bytes(self) -> bytes:
        """The weights and the optimizer's state, for a checkpoint (exact on reload)."""
        buf = io.BytesIO()
        torch.save({"head": self.state_dict(), "optimizer": self.optimizer.state_dict()}, buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True)
        self.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])

    @staticmethod
    def weights_of(data: bytes) -> dict[str, torch.Tensor]:
        """The weights held in checkpoint bytes (for comparing two runs' heads)."""
        return torch.load(io.BytesIO(data), weights_only=True)["head"]
