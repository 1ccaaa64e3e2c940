"""A static key/value cache: one preallocated buffer per layer, written in place.

The decoder writes the keys and values of new positions at [start, start + T) and attends
over [0, start + T). Recurrent layers (lfm2's convolutions, SSMs, delta nets) keep a state
instead: a tuple of tensors per layer, batch first, stored by the position it was reached at.
A call at `start` reads the state at `start` and writes the one at `start + T`; keeping the
state it read makes a recomputed forward (activation checkpointing) read it again. The sampler (prefill once, decode one token at a time, fan a prompt's
cache out to a group) builds on this; it knows nothing about sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer (B, H_kv, S_max, D)
    v: list[torch.Tensor]
    length: int = 0  # positions filled, the same for every sequence of the batch
    states: dict[int, dict[int, tuple[torch.Tensor, ...]]] = field(default_factory=dict)

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

    def read_state(self, layer: int, start: int, batch: int) -> tuple[torch.Tensor, ...]:
        """The recurrent state of `layer` at position `start` (> 0)."""
        state = self.states.get(layer, {}).get(start)
        if state is None:
            raise ValueError(f"layer {layer} has no recurrent state at position {start}")
        return state

    def write_state(self, layer: int, start: int, end: int, state: tuple[torch.Tensor, ...]):
        """Keep the state at `end`, and the one at `start` (a recomputation reads it again)."""
        if any(t.requires_grad for t in state):  # earlier passes are context only, as keys
            state = tuple(t.detach() for t in state)
        kept = self.states.setdefault(layer, {})
        for p in [p for p in kept if p not in (start, end)]:
            del kept[p]
        kept[end] = state

    def current_states(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each recurrent layer's latest state."""
        return {layer: kept[max(kept)] for layer, kept in self.states.items() if kept}

    def set_states(self, states: dict[int, tuple[torch.Tensor, ...]], at: int) -> None:
        """Start from these states at position `at` (a sampler's rows, already in order)."""
        self.states = {layer: {at: state} for layer, state in states.items()}

    def expand(self, n: int) -> KVCache:
        """Fan a batch-1 cache out to n sequences (a group sharing one prompt)."""
        out = KVCache(
            [t.expand(n, -1, -1, -1).clone() for t in self.k],
            [t.expand(n, -1, -1, -1).clone() for t in self.v],
            self.length,
        )
        out.set_states(
            {
                layer: tuple(t.expand(n, *t.shape[1:]).clone() for t in state)
                for layer, state in self.current_states().items()
            },
            self.length,
        )
        return out


def select_states(states: dict, index: torch.Tensor | list[int]) -> dict:
    """The states of the rows `index` (dim 0), in that order."""
    out = {}
    for layer, state in states.items():
        i = torch.as_tensor(index, dtype=torch.long, device=state[0].device)
        out[layer] = tuple(t.index_select(0, i) for t in state)
    return out
