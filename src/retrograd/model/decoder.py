"""One decoder for every supported architecture, with modules named after GGUF tensors.

`Decoder.blk[3].attn_q` is the module of `blk.3.attn_q.weight`, so tensor patterns in a run
file match module paths and adapters export with no renaming. Differences between
architectures come from `ModelConfig.arch` (a facts table), read once at construction. A
layer and its step live in model/block.py; a decode step may run each layer as one compiled
graph of that same step (model/decode.py). `ForwardContext` (model/forward.py) carries what
every layer of one call reads, the compute plan's switches included.

Precision: the residual stream, norms, rope, logits and soft-capping are float32; matmuls and
attention run in `compute_dtype` (bfloat16 for speed, float32 for exactness). The decoder
knows nothing about tokenizers, sampling or losses.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from retrograd import compute
from retrograd.model import decode
from retrograd.model.block import Block
from retrograd.model.config import ModelConfig
from retrograd.model.forward import ForwardContext
from retrograd.model.frozen import FrozenTensor, frozen_linear
from retrograd.model.kv_cache import KVCache
from retrograd.model.layers import Linear, RMSNorm


class Decoder(nn.Module):
    """ids (B, T) -> hidden states after output_norm (B, T, n_embd) float32; `head` -> logits."""

    def __init__(
        self,
        cfg: ModelConfig,
        token_embd: FrozenTensor,
        blocks: list[Block],
        output_norm: RMSNorm,
        output: Linear | None,
        freq_factors: torch.Tensor | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.token_embd = token_embd
        self.blk = nn.ModuleList(blocks)
        self.output_norm = output_norm
        self.output = output
        self.register_buffer("rope_freqs", freq_factors, persistent=False)
        self.compute_dtype = torch.float32
        self.f16_gelu = True
        self.embed_scale = math.sqrt(cfg.n_embd) if cfg.arch.embed_scale else cfg.embedding_scale
        self.logit_mul = 1.0 / cfg.logit_scale  # granite: logits / logit_scale
        self.checkpointing: tuple[int, torch.dtype] | None = None
        self.base_trained = False  # a Linear reads a trained weight (trainable/base.py)
        self.plan: compute.ComputePlan | None = None  # what it was loaded by (model/loader.py)
        # Blocks sharded by FSDP2 (distributed/fsdp2.py): a block's weights exist whole only
        # within its own pass, so no block may read the next one's norm ahead of time.
        self.sharded = False

    @property
    def device(self) -> torch.device:
        return self.token_embd.device

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype
        # llama.cpp's CPU GELU table only matters where we match it digit for digit.
        self.f16_gelu = dtype == torch.float32

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embd.rows(ids, torch.float32)  # (B, T, n_embd)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def forward(
        self,
        ids: torch.Tensor,
        start: int = 0,
        cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`start`: the cache slot of ids[:, 0]. `positions` (B, T): rope positions per sequence
        when they differ from the slots (left-padded batches); `key_mask` (B, S) hides padding."""
        B, T = ids.shape
        ctx = ForwardContext(
            self.cfg,
            T,
            start,
            cache,
            self.compute_dtype,
            ids.device,
            self.rope_freqs,
            self.f16_gelu,
            key_mask,
            positions,
        )
        ctx.B = B
        x = self.embed(ids)
        if self.checkpointing is not None and torch.is_grad_enabled():
            x = self._checkpointed_blocks(x, ctx)
        elif decode.applies(self, ctx, T):
            x = decode.decode_layers(self, x, ctx)
        else:
            h = None
            for i, block in enumerate(self.blk):
                last = i + 1 == len(self.blk) or self.sharded
                nxt = None if last else self.blk[i + 1].attn_norm
                x, h = block.step(x, ctx, h, nxt)
        if cache is not None:
            cache.length = start + T
        return self.output_norm(x)

    def enable_checkpointing(self, every_n_layers: int, dtype: torch.dtype = torch.float32) -> None:
        """Recompute activations in backward: keep only every n-th layer's input, in `dtype`."""
        self.checkpointing = (max(1, every_n_layers), dtype)

    def _checkpointed_blocks(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        stride, dtype = self.checkpointing
        for first in range(0, len(self.blk), stride):
            group = self.blk[first : first + stride]

            def run(x_stored: torch.Tensor, group=group) -> torch.Tensor:
                y = x_stored.float()
                for block in group:
                    y = block(y, ctx)
                return y

            # NOTE: the stored input is the segment's only saved activation; f16/bf16 storage
            # halves it and rounds the residual stream at segment boundaries. early_stop off:
            # stopping the recomputation early trips over the compiled kernels inside
            # (torch.utils.checkpoint: "target_frame.early_stop is set" in 16-bit compute).
            x = checkpoint(run, x.to(dtype), use_reentrant=False, early_stop=False)
        return x

    def head(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Hidden states (..., n_embd) -> logits (..., n_vocab) float32. float32=False leaves
        them in the compute dtype when nothing follows the product (no soft-capping): the same
        values, without a (rows x vocabulary) float32 copy."""
        h = h.to(self.compute_dtype)
        if self.output is not None:
            logits = self.output(h)
        else:
            logits = frozen_linear(h, self.token_embd)
        if self.logit_mul != 1.0:  # after the product, as llama.cpp scales
            logits = (logits.float() if float32 else logits) * self.logit_mul
        cap = self.cfg.final_softcap
        if not float32 and not cap:
            return logits
        logits = logits.float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
