"""A static key/value cache: one preallocated buffer per layer, written in place.

The decoder writes the keys and values of new positions at [start, start + T) and attends
over [0, start + T). The sampler (prefill once, decode one token at a time, fan a prompt's
cache out to a group) builds on this; it knows nothing about sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer (B, H_kv, S_max, D)
    v: list[torch.Tensor]
    length: int = 0  # positions filled, the same for every sequence of the batch

    @classmethod
    def empty(
        cls, cfg, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        def buf(d: int) -> torch.Tensor:
            return torch.zeros(batch, cfg.n_head_kv, max_len, d, dtype=dtype, device=device)

        return cls(
            [buf(cfg.head_dim) for _ in range(cfg.n_layer)],
            [buf(cfg.head_dim_v) for _ in range(cfg.n_layer)],
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, D) at `start`; return the keys and values of [0, start + T)."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, {end} requested")
        if k.requires_grad or v.requires_grad:
            # Training in passes of micro_batch tokens: earlier passes are context only (their
            # graph is gone after their backward), this pass's keys keep their gradient.
            self.k[layer][:, :, start:end] = k.detach().to(self.k[layer].dtype)
            self.v[layer][:, :, start:end] = v.detach().to(self.v[layer].dtype)
            past_k = self.k[layer][:, :, :start].to(k.dtype)
            past_v = self.v[layer][:, :, :start].to(v.dtype)
            return torch.cat((past_k, k), 2), torch.cat((past_v, v), 2)
        self.k[layer][:, :, start:end] = k.to(self.k[layer].dtype)
        self.v[layer][:, :, start:end] = v.to(self.v[layer].dtype)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def expand(self, n: int) -> KVCache:
        """Fan a batch-1 cache out to n sequences (a group sharing one prompt)."""
        return KVCache(
            [t.expand(n, -1, -1, -1).clone() for t in self.k],
            [t.expand(n, -1, -1, -1).clone() for t in self.v],
            self.length,
        )
