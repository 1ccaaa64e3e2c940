"""The sampler: batched prefill and decode over a static KV cache, the rollout engine.

`Sampler.generate(requests)` answers many prompts at once. Identical prompts are prefilled
once (a GRPO group fans its prompt's KV cache out to its answers); prompts of different
lengths are left-padded, each keeping its own rope positions. Each answer draws its own
uniform numbers from its own seed, so an answer depends on its prompt, settings and seed,
not on what else is in the batch. Decoding stops a row at an end-of-generation id, a stop
string or its token budget; finished rows leave the batch when enough of them have.

`fast = True` (fast_sampling_context): a 16-bit KV cache and the fused attention kernel.
`fast = False`: a float32 cache and the plain attention path training uses. Environment:
RETRO_DEVICE_SAMPLING=0 samples on the host, RETRO_DEVICE_LOGPROBS=0 computes log-probs on
the host in float64, RETRO_FAST_TOP_P=1 searches the nucleus among the top candidates first.

The sampler knows the tokenizer only for end-of-generation ids and stop strings; it knows
nothing about chat templates or HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from retrograd.model.attention import fast_decode
from retrograd.model.frozen import packed_weights
from retrograd.model.kv_cache import KVCache
from retrograd.sampling.params import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    SampleRequest,
)
from retrograd.sampling.select import (
    greedy_device,
    select_device,
    select_host,
    token_logprobs_device,
    token_logprobs_host,
)
from retrograd.sampling.stops import AnswerText

PREFILL_CHUNK = 512  # prompt tokens per prefill pass


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value not in ("0", "", "false")


@dataclass
class _Row:
    """One answer being generated."""

    index: int  # position in the flat output
    prompt_len: int
    max_new: int
    temperature: float
    top_p: float
    stop_ids: frozenset[int]
    generator: torch.Generator
    text: AnswerText
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    stopped_by: int | str | None = None


class Sampler:
    def __init__(
        self,
        decoder,
        tokenizer,
        fast: bool = True,
        max_len: int | None = None,
        device_sampling: bool | None = None,
        device_logprobs: bool | None = None,
        fast_top_p: bool | None = None,
    ):
        """max_len: the context (prompt plus answer) an answer may fill; None = no limit."""
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.fast = fast
        self.max_len = max_len
        self.device_sampling = (
            _env_flag("RETRO_DEVICE_SAMPLING", True) if device_sampling is None else device_sampling
        )
        self.device_logprobs = (
            _env_flag("RETRO_DEVICE_LOGPROBS", True) if device_logprobs is None else device_logprobs
        )
        self.fast_top_p = _env_flag("RETRO_FAST_TOP_P", False) if fast_top_p is None else fast_top_p

    @property
    def kv_dtype(self) -> torch.dtype:
        """16-bit with fast sampling (the compute dtype when it is 16-bit, else f16), else f32."""
        compute = self.decoder.compute_dtype
        if not self.fast:
            return torch.float32
        return compute if compute in (torch.float16, torch.bfloat16) else torch.float16

    def _attention(self):
        if self.fast:
            return fast_decode()  # fused one-token attention (and SDPA's fused kernels)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    @torch.no_grad()
    def generate(
        self,
        requests: list[SampleRequest],
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[list[Completion]]:
        """Answers per request, in order. on_text(answer, delta) streams text as it is decided;
        answers are numbered across requests in order."""
        prompts = list(dict.fromkeys(r.prompt for r in requests))  # unique, in order
        for p in prompts:
            if not p:
                raise ValueError("an empty prompt has nothing to continue")
        rows, owner = self._rows(requests)
        if not rows:
            return [[] for _ in requests]
        which = torch.tensor(
            [prompts.index(requests[o].prompt) for o in owner], device=self.decoder.device
        )
        width = max(len(p) for p in prompts)
        capacity = width + max(r.max_new for r in rows)
        with self._attention(), packed_weights():
            cache, logits, key_mask = self._prefill(prompts, capacity)
            cache = _select(cache, which)  # fan out: one row per answer
            logits, key_mask = logits[which], key_mask[which]  # (B, V), (B, capacity)
            self._decode(rows, cache, logits, key_mask, width, on_text)
        out: list[list[Completion]] = [[] for _ in requests]
        for row, o in zip(rows, owner, strict=True):
            out[o].append(self._completion(row))
        return out

    def _rows(self, requests: list[SampleRequest]) -> tuple[list[_Row], list[int]]:
        rows, owner = [], []
        eog = frozenset(self.tokenizer.eot_ids)
        piece = self._piece
        for o, req in enumerate(requests):
            p = req.params
            budget = p.max_new_tokens
            if self.max_len is not None:
                budget = min(budget, self.max_len - len(req.prompt))
                if budget < 1:
                    raise ValueError(
                        f"a prompt of {len(req.prompt)} tokens leaves no room in a context "
                        f"of {self.max_len}"
                    )
            for seed in req.answer_seeds():
                rows.append(
                    _Row(
                        len(rows),
                        len(req.prompt),
                        budget,
                        p.temperature,
                        p.top_p,
                        eog if p.stop_ids is None else p.stop_ids,
                        torch.Generator().manual_seed(seed),
                        AnswerText(piece, p.stop),
                    )
                )
                owner.append(o)
        return rows, owner

    def _piece(self, token: int) -> bytes:
        return self.tokenizer.token_to_piece(token, special=False)

    def _prefill(self, prompts, capacity):
        """Left-padded prefill of the unique prompts -> cache, last-row logits (P, V), key mask."""
        dec, dev = self.decoder, self.decoder.device
        P, width = len(prompts), max(len(p) for p in prompts)
        pad = torch.tensor([width - len(p) for p in prompts], device=dev)  # (P,)
        ids = torch.zeros(P, width, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=dev)
        slots = torch.arange(capacity, device=dev)
        key_mask = slots[None, :] >= pad[:, None]  # (P, capacity): False on padding
        positions = (slots[None, :width] - pad[:, None]).clamp_min(0)  # (P, width)
        padded = bool(pad.any())
        cache = KVCache.empty(dec.cfg, P, capacity, self.kv_dtype, dev)
        for c in range(0, width, PREFILL_CHUNK):
            e = min(c + PREFILL_CHUNK, width)
            h = dec(
                ids[:, c:e],
                start=c,
                cache=cache,
                key_mask=key_mask[:, :e] if padded else None,
                positions=positions[:, c:e] if padded else None,
            )  # (P, T, n_embd)
        return cache, dec.head(h[:, -1], float32=False), key_mask

    def _decode(self, rows, cache, logits, key_mask, width, on_text) -> None:
        dec, dev = self.decoder, self.decoder.device
        live = list(rows)  # the rows in the cache, in cache order
        slot = width
        for step in range(max(r.max_new for r in rows)):
            tokens, logps = self._choose(live, logits)
            for row, tok, lp in zip(live, tokens, logps, strict=True):
                if row.finish is None:
                    self._advance(row, tok, lp)
            if on_text is not None:
                for row in live:
                    delta = row.text.delta(final=row.finish is not None)
                    if delta:
                        on_text(row.index, delta)
            keep = [i for i, r in enumerate(live) if r.finish is None]
            if not keep:
                return
            if 4 * (len(live) - len(keep)) >= len(live):  # compact: finished rows leave
                idx = torch.tensor(keep, device=dev)
                cache, key_mask = _select(cache, idx), key_mask[idx]
                live, tokens = [live[i] for i in keep], [tokens[i] for i in keep]
            ids = torch.tensor(tokens, device=dev)[:, None]  # (B, 1)
            positions = torch.tensor([r.prompt_len + step for r in live], device=dev)[:, None]
            h = dec(
                ids, start=slot, cache=cache, key_mask=key_mask[:, : slot + 1], positions=positions
            )
            logits = dec.head(h[:, -1], float32=False)  # (B, V), 16-bit when bf16 compute
            slot += 1

    def _choose(self, live: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Next token of every live row and its log-probability."""
        if self.device_sampling and self.device_logprobs and all(r.temperature <= 0 for r in live):
            # greedy rows draw no uniform numbers (they would ignore them): the general
            # path's numbers, in one kernel
            tokens, lp = greedy_device(logits)
            if bool(torch.isfinite(lp).all()):
                return tokens.tolist(), lp.tolist()
        u = torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64) for r in live])
        temp = torch.tensor([r.temperature for r in live], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in live], dtype=torch.float32)
        if self.device_sampling:
            dev = logits.device
            tokens = select_device(logits, temp.to(dev), top_p.to(dev), u.to(dev), self.fast_top_p)
        else:
            tokens = select_host(logits, temp, top_p, u, self.fast_top_p)
        lp = None
        if self.device_logprobs:
            lp = token_logprobs_device(logits, temp.to(logits.device), tokens.to(logits.device))
            if not torch.isfinite(lp).all():
                lp = None  # replay on the host
        if lp is None:
            lp = token_logprobs_host(logits, temp, tokens)
        return tokens.tolist(), lp.tolist()

    def _advance(self, row: _Row, tok: int, logprob: float) -> None:
        row.ids.append(tok)
        row.logprobs.append(logprob)
        if tok in row.stop_ids:
            row.finish, row.stopped_by = FINISH_STOP, tok
        elif row.text.push(tok):
            row.finish, row.stopped_by = FINISH_STOP, row.text.stopped_by
        elif len(row.ids) >= row.max_new:
            row.finish = FINISH_LENGTH
        if row.finish is not None:
            row.text.finish()

    def _completion(self, row: _Row) -> Completion:
        return Completion(
            tuple(row.ids),
            tuple(row.logprobs),
            row.finish or FINISH_LENGTH,
            row.text.text,
            row.prompt_len,
            row.stopped_by,
        )


def _select(cache: KVCache, index: torch.Tensor) -> KVCache:
    """The cache rows `index` (B',) in that order: fan-out and compaction."""
    return KVCache(
        [k.index_select(0, index) for k in cache.k],
        [v.index_select(0, index) for v in cache.v],
        cache.length,
    )
