"""Multi-turn lockstep generation: a group's trajectories take a turn together, in one decode
batch, and keep their keys and values between turns.

A `Thread` is one trajectory's token stream: everything the model has read or written so far
(`seq`) and, when the prefix cache is on, the keys and values of its first `n_kv` tokens. The
caller appends the next turn's context (an observation rendered by the chat template) to
`seq`, then `TurnDecoder.turn(threads, ...)` samples the next assistant turn of each:

1. Layout. Every row is right-aligned to end at slot W = the longest sequence, its tokens
   contiguous in [W - len, W) (left of it: masked slots), so that slot distance equals
   position distance (sliding-window layers mask the right keys) and all rows write their next
   token at the same slot, as in `batch.LiveBatch`.
2. Prefill. A row's cached keys and values are copied into place; only the tokens after them
   are computed. One forward covers the widest row's new tokens, w of them: a row with fewer
   new tokens recomputes the last cached ones (same tokens, same positions: the same values up
   to the rounding of the batch), which keeps the pass one rectangle. Turn 0 (nothing cached)
   prefills each distinct prompt once, so a group's shared opening is computed once.
3. Decode. Rows choose their tokens with their own settings and generators
   (`Sampler.choose`); a row that finishes keeps a copy of its keys and values (everything but
   its last token, which was chosen but never fed) and leaves the batch, the last row taking
   its place (one row's slots copied).

Recurrent families (lfm2, SSMs, delta nets: a state instead of keys in some layers) prefill
whole sequences every turn: a state cannot recompute its last tokens as keys can, so step 2's
rectangle does not apply. With RETRO_GENERATION_PREFIX_CACHE=0 nothing is kept: every turn prefills whole sequences
(the measure of what the cache saves). `prefilled` and `reused` count positions computed and
served from the cache. Knows nothing about chat templates, tools or environments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrograd.model.kv_cache import KVCache, select_states
from retrograd.sampling.engine import GREEDY_BELOW
from retrograd.sampling.params import Completion
from retrograd.sampling.rows import Row, advance, completion
from retrograd.sampling.stops import AnswerText


@dataclass(eq=False)
class Thread:
    """One trajectory's tokens across turns and the generator its draws come from."""

    seq: list[int]
    generator: torch.Generator
    kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # per layer (H, n_kv, D)
    n_kv: int = 0  # leading tokens of seq whose keys and values `kv` holds

    def forget(self) -> None:
        self.kv, self.n_kv = None, 0


class TurnDecoder:
    def __init__(self, sampler, keep_kv: bool | None = None):
        self.sampler = sampler
        self.decoder = sampler.decoder
        self.keep_kv = sampler.plan.prefix_cache if keep_kv is None else keep_kv
        self.keep_kv = self.keep_kv and not self.decoder.cfg.recurrent
        self.states: dict = {}  # recurrent layers: the decode rows' states, in buffer order
        self.prefilled = 0  # positions computed by prefills
        self.reused = 0  # positions served from kept keys and values

    @torch.no_grad()
    def turn(
        self,
        threads: list[Thread],
        budgets: list[int],
        temperature: float,
        top_p: float,
        stop_ids: frozenset[int] | None = None,
    ) -> list[Completion]:
        """The next turn of every thread (each at most budgets[i] >= 1 tokens); the caller
        appends the sampled ids to `seq` itself (with what follows them)."""
        if not threads:
            return []
        assert len(budgets) == len(threads) and min(budgets) >= 1, budgets
        stop = frozenset(self.sampler.tokenizer.eot_ids) if stop_ids is None else stop_ids
        temp = temperature if temperature >= GREEDY_BELOW else 0.0
        lens = [len(t.seq) for t in threads]
        W = max(lens)
        capacity = W + max(budgets)
        rows = [
            Row(None, i, lens[i], budgets[i], temp, top_p, stop, t.generator, self._text())
            for i, t in enumerate(threads)
        ]
        with self.sampler.context():
            if self.keep_kv and any(t.kv is not None for t in threads):
                k, v, logits = self._extend(threads, lens, W, capacity)
            else:
                k, v, logits = self._fresh(threads, lens, W, capacity)
            self._decode(threads, rows, k, v, logits, [W - n for n in lens], W)
        return [completion(r) for r in rows]

    def _text(self) -> AnswerText:
        return AnswerText(self.sampler._piece, ())

    # -- prefill -------------------------------------------------------------------------------

    def _fresh(self, threads, lens, W, capacity):
        """Nothing cached: each distinct sequence prefilled once, fanned out to its rows."""
        unique = list(dict.fromkeys(tuple(t.seq) for t in threads))
        cache, logits, _ = self.sampler.prefill([list(u) for u in unique], capacity)
        which = torch.tensor(
            [unique.index(tuple(t.seq)) for t in threads], device=self.decoder.device
        )
        self.prefilled += sum(len(u) for u in unique)
        for t in threads:
            t.forget()
        k = [b.index_select(0, which) for b in cache.k]
        v = [b.index_select(0, which) for b in cache.v]
        self.states = select_states(cache.current_states(), which)
        return k, v, logits.index_select(0, which)

    def _extend(self, threads, lens, W, capacity):
        """Cached keys and values copied into place; the new tokens computed in one rectangle."""
        dec, dev = self.decoder, self.decoder.device
        k, v = self._buffers(len(threads), capacity)
        for a, t in enumerate(threads):
            if t.kv is None:
                continue
            f = W - lens[a]
            for buf, part in zip(k + v, t.kv[0] + t.kv[1], strict=True):
                buf[a, :, f : f + t.n_kv] = part
            self.reused += t.n_kv
        w = max(n - t.n_kv for n, t in zip(lens, threads, strict=True))
        ids = torch.zeros(len(threads), w, dtype=torch.long, device=dev)
        for a, t in enumerate(threads):
            tail = t.seq[-w:]
            ids[a, w - len(tail) :] = torch.tensor(tail, device=dev)
            t.forget()  # the kept copy is in the buffers now
        first = torch.tensor([W - n for n in lens], device=dev)  # (B,)
        slots = torch.arange(capacity, device=dev)
        key_mask = slots[None, :] >= first[:, None]  # (B, capacity)
        positions = (slots[None, W - w : W] - first[:, None]).clamp_min(0)  # (B, w)
        cache = KVCache(k, v)
        self.prefilled += len(threads) * w
        chunk = self.sampler.generation_batch
        for c in range(0, w, chunk):
            e = min(c + chunk, w)
            start = W - w + c
            h = dec(
                ids[:, c:e],
                start=start,
                cache=cache,
                key_mask=key_mask[:, : W - w + e],
                positions=positions[:, c:e],
            )
        return k, v, dec.head(h[:, -1], float32=False)

    def _buffers(self, rows: int, capacity: int):
        """Zeroed buffers: masked slots must hold finite numbers (0 x NaN would leak)."""
        cfg, dtype, dev = self.decoder.cfg, self.sampler.kv_dtype, self.decoder.device

        def buf(d: int) -> torch.Tensor:
            return torch.zeros(rows, cfg.n_head_kv, capacity, d, dtype=dtype, device=dev)

        return [buf(cfg.head_dim) for _ in range(cfg.n_layer)], [
            buf(cfg.head_dim_v) for _ in range(cfg.n_layer)
        ]

    # -- decode --------------------------------------------------------------------------------

    def _decode(self, threads, rows, k, v, logits, first, slot) -> None:
        dec, dev = self.decoder, self.decoder.device
        live = list(range(len(rows)))  # buffer row b holds thread live[b]
        while True:
            tokens, logps = self.sampler.choose([rows[i] for i in live], logits)
            for i, tok, lp in zip(live, tokens, logps, strict=True):
                advance(rows[i], tok, lp)
            done = {b for b, i in enumerate(live) if rows[i].finish is not None}
            if done:
                for b in sorted(done):
                    if self.keep_kv:  # all but the last token, which was chosen, never fed
                        t = threads[live[b]]
                        t.kv = (
                            [buf[b, :, first[b] : slot].clone() for buf in k],
                            [buf[b, :, first[b] : slot].clone() for buf in v],
                        )
                        t.n_kv = slot - first[b]
                B = len(live) - len(done)
                if B == 0:
                    return
                holes = [b for b in range(B) if b in done]
                movers = [b for b in range(B, len(live)) if b not in done]
                order = list(range(B))  # buffer row j takes the row that was at order[j]
                for h, m in zip(holes, movers, strict=True):
                    order[h] = m
                if holes:
                    lo = min(first[m] for m in movers)
                    dst = torch.tensor(holes, device=dev)
                    src = torch.tensor(movers, device=dev)
                    for buf in k + v:
                        buf[dst, :, lo:slot] = buf[src, :, lo:slot]
                if self.states:
                    self.states = select_states(self.states, order)
                live = [live[o] for o in order]
                first = [first[o] for o in order]
                tokens = [tokens[o] for o in order]
            B = len(live)
            ids = torch.tensor(tokens, device=dev)[:, None]  # (B, 1)
            f = torch.tensor(first, device=dev)
            key_mask = torch.arange(slot + 1, device=dev)[None, :] >= f[:, None]
            positions = (slot - f)[:, None]
            cache = KVCache([t[:B] for t in k], [t[:B] for t in v], slot)
            if self.states:
                cache.set_states(self.states, slot)
            h = dec(ids, start=slot, cache=cache, key_mask=key_mask, positions=positions)
            logits = dec.head(h[:, -1], float32=False)
            slot += 1
            if self.states:
                self.states = cache.current_states()
