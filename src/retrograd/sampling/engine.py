"""The sampler: batched prefill and decode over a static KV cache, the rollout engine.

`Sampler.generate(requests)` answers many prompts at once. Identical prompts are prefilled
once (a GRPO group fans its prompt's KV cache out to its answers); prompts of different
lengths are left-padded, each keeping its own rope positions. Each answer draws its own
uniform numbers from its own seed, so an answer depends on its prompt, settings and seed,
not on what else is in the batch. Decoding stops a row at an end-of-generation id, a stop
string or its token budget; a finished row leaves the batch at once. The decode loop is
`batch.LiveBatch`, which `retrograd serve` also drives with requests joining mid-way; the
Sampler owns the pieces it calls: rows of a request, prefill, the choice of tokens.

`generation_batch` ([training].generation_batch): prompt tokens per prefill pass, each prompt's
prefill computed in chunks of that many positions, the later ones reading the earlier ones'
keys and values from the cache; decoding is not cut (one token a row a pass).

`fast = True` (fast_sampling_context): the fused attention kernel and a KV cache of `kv_dtype`
([training].kv_dtype): "f16", 16 bits (the compute dtype when it is 16-bit, else float16), or
"f32". `fast = False`: a float32 cache and the plain attention path training uses. The compute
plan's sampling switches (retrograd/compute.py `SamplingPlan`, from the environment):
RETRO_DEVICE_SAMPLING=0 samples on the host, RETRO_DEVICE_LOGPROBS=0 computes log-probs on
the host in float64, RETRO_FAST_TOP_P=0 sorts the whole vocabulary for every nucleus row (the
same tokens, slower: the top candidates are searched first by default, select.py).

`TokenChooser` is the part that does not know the decoder: a request's rows (seeds, budgets,
stops) and the choice of tokens and their log-probabilities from any logits; the llama.cpp
rollout backend (llamacpp.py) samples by it too, so both backends draw by one rule.

The sampler knows the tokenizer only for end-of-generation ids and stop strings; it knows
nothing about chat templates or HTTP.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch

from retrograd import compute, environ
from retrograd.compute import SamplingPlan
from retrograd.model.kv_cache import KVCache
from retrograd.sampling.batch import LiveBatch
from retrograd.sampling.constrain import Constraint, TokenTable, restrict
from retrograd.sampling.params import Completion, SampleRequest
from retrograd.sampling.rows import Row
from retrograd.sampling.select import (
    greedy_device,
    select_device,
    select_host,
    token_logprobs_device,
    token_logprobs_host,
)
from retrograd.sampling.stops import AnswerText

PREFILL_CHUNK = 512  # prompt tokens per prefill pass unless generation_batch says otherwise
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as vLLM's sampler does)


KV_DTYPES = ("f16", "f32")  # [training].kv_dtype


def cache_dtype(compute: torch.dtype, fast: bool, kv_dtype: str = "f16") -> torch.dtype:
    """The generation cache's dtype. float32 for exact sampling (`fast` off: the keys and
    values training attends to, whatever kv_dtype says) and for kv_dtype "f32"; "f16" is 16
    bits: the compute dtype when it is 16-bit (bf16 keys and values kept as computed, which the
    compiled decode step reads in place, model/decode.py), else float16."""
    if not fast or kv_dtype == "f32":
        return torch.float32
    return compute if compute in (torch.float16, torch.bfloat16) else torch.float16


def run_settings(training) -> dict:
    """The Sampler keywords a run file's [training] sets: fast_sampling_context, kv_dtype."""
    return {"fast": training.fast_sampling_context, "kv_dtype": training.kv_dtype}


def sampling_plan(decoder) -> SamplingPlan:
    """The sampling switches `decoder` was loaded by, else the environment's."""
    plan = getattr(decoder, "plan", None)
    if plan is None:
        plan = compute.ComputePlan.of(environ.read())
    return plan.sampling


class TokenChooser:
    """The rows of a request's answers and the choice of their tokens from logits: what every
    sampler shares whatever computes the logits (this module's decoder, llama.cpp in
    sampling/llamacpp.py). Knows the tokenizer for end-of-generation ids, stop strings and
    grammars; nothing about models."""

    def __init__(
        self,
        tokenizer,
        max_len: int | None = None,
        plan: SamplingPlan | None = None,
        device_sampling: bool | None = None,
        device_logprobs: bool | None = None,
        fast_top_p: bool | None = None,
    ):
        """max_len: the context (prompt plus answer) an answer may fill; None = no limit.
        plan: the compute plan's sampling switches (default the environment's);
        device_sampling, device_logprobs and fast_top_p override it."""
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.plan = plan or compute.ComputePlan.of(environ.read()).sampling
        self.device_sampling = (
            self.plan.device_sampling if device_sampling is None else device_sampling
        )
        self.device_logprobs = (
            self.plan.device_logprobs if device_logprobs is None else device_logprobs
        )
        self.fast_top_p = (
            self.plan.top_p == "candidates_first" if fast_top_p is None else fast_top_p
        )
        self._table: TokenTable | None = None  # the vocabulary's pieces, once a grammar asks

    @property
    def token_table(self) -> TokenTable:
        if self._table is None:
            self._table = TokenTable(self.tokenizer)
        return self._table

    def make_rows(self, request: SampleRequest, entry: object = None) -> list[Row]:
        """The rows of a request's answers; ValueError when the prompt leaves nothing to do."""
        if not request.prompt:
            raise ValueError("an empty prompt has nothing to continue")
        p = request.params
        budget = p.max_new_tokens
        if self.max_len is not None:
            budget = min(budget, self.max_len - len(request.prompt))
            if budget < 1:
                raise ValueError(
                    f"a prompt of {len(request.prompt)} tokens leaves no room in a context "
                    f"of {self.max_len}"
                )
        # NOTE: softmax(logits / T) overflows float32 for tiny T (1e-39 is a denormal): below
        # GREEDY_BELOW the answer is the greedy one it tends to anyway
        temperature = p.temperature if p.temperature >= GREEDY_BELOW else 0.0
        stop_ids = frozenset(self.tokenizer.eot_ids) if p.stop_ids is None else p.stop_ids
        table = self.token_table if p.grammar is not None else None
        return [
            Row(
                entry,
                j,
                len(request.prompt),
                budget,
                temperature,
                p.top_p,
                stop_ids,
                torch.Generator().manual_seed(seed),
                AnswerText(self._piece, p.stop),
                constraint=None if table is None else Constraint(p.grammar, table),
            )
            for j, seed in enumerate(request.answer_seeds())
        ]

    def _piece(self, token: int) -> bytes:
        return self.tokenizer.token_to_piece(token, special=False)

    def choose(self, live: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Next token of every live row and its log-probability; rows under a grammar take
        an allowed one (constrain.py)."""
        tokens, lp = self._choose(live, logits)
        for i, row in enumerate(live):
            c = row.constraint
            if c is None or c.allows(tokens[i], row.stop_ids):
                continue
            allowed = c.mask(row.stop_ids)
            if not allowed.any():
                raise ValueError("the grammar allows no token of this vocabulary here")
            tokens[i] = self._choose_again(row, restrict(logits[i], allowed))
            # the log-probability under the row's unrestricted distribution, as for any row
            # (one row on the host: a batch of one would compile the fused kernels again)
            lp[i] = token_logprobs_host(logits[i : i + 1], [row.temperature], [tokens[i]])[0].item()
        return tokens, lp

    def _choose_again(self, row: Row, restricted: torch.Tensor) -> int:
        """A refused row's token from its restricted logits (V,), with a fresh uniform number.
        NOTE: the rule of `_choose` without its fused kernels, which a batch of one would
        compile again (tens of seconds on first use)."""
        if row.temperature <= 0:
            return int(restricted.argmax())
        u = torch.rand((), generator=row.generator, dtype=torch.float64)[None]
        temp = torch.tensor([row.temperature], dtype=torch.float32)
        top_p = torch.tensor([row.top_p], dtype=torch.float32)
        if self.device_sampling:
            dev = restricted.device
            ids = select_device(
                restricted[None], temp.to(dev), top_p.to(dev), u.to(dev), self.fast_top_p
            )
        else:
            ids = select_host(restricted[None], temp, top_p, u)
        return int(ids[0])

    def _choose(self, live: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
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
        return tokens.tolist(), self._logprobs(live, logits, tokens)

    def _logprobs(self, live: list[Row], logits: torch.Tensor, tokens: torch.Tensor) -> list[float]:
        temp = torch.tensor([r.temperature for r in live], dtype=torch.float32)
        lp = None
        if self.device_logprobs:
            lp = token_logprobs_device(logits, temp.to(logits.device), tokens.to(logits.device))
            if not torch.isfinite(lp).all():
                lp = None  # replay on the host
        if lp is None:
            lp = token_logprobs_host(logits, temp, tokens)
        return lp.tolist()


class Sampler(TokenChooser):
    """Batched prefill and decode on our own decoder (the module docstring)."""

    def __init__(
        self,
        decoder,
        tokenizer,
        fast: bool = True,
        max_len: int | None = None,
        device_sampling: bool | None = None,
        device_logprobs: bool | None = None,
        fast_top_p: bool | None = None,
        generation_batch: int = PREFILL_CHUNK,
        kv_dtype: str = "f16",
        plan: SamplingPlan | None = None,
    ):
        """max_len: the context (prompt plus answer) an answer may fill; None = no limit.
        generation_batch: prompt positions per prefill pass (at least 1). kv_dtype: the fast
        context's cache, "f16" or "f32" (`cache_dtype`). plan: the compute plan's sampling
        switches (by default the ones the decoder was loaded by); device_sampling,
        device_logprobs and fast_top_p override it."""
        if generation_batch < 1:
            raise ValueError(f"generation_batch = {generation_batch}: must be at least 1")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype = {kv_dtype!r}: must be one of {', '.join(KV_DTYPES)}")
        super().__init__(
            tokenizer, max_len, plan or sampling_plan(decoder), device_sampling,
            device_logprobs, fast_top_p,
        )  # fmt: skip
        self.decoder = decoder
        self.cache_kind = kv_dtype
        self.generation_batch = generation_batch
        self.fast = fast

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of every KV cache this sampler builds (`cache_dtype`)."""
        return cache_dtype(self.decoder.compute_dtype, self.fast, self.cache_kind)

    def context(self) -> contextlib.ExitStack:
        """Where generation runs: the compute plan's overlay for this precision (fused
        one-token attention in the fast context; packed weights, `SamplingPlan.forward`)."""
        stack = contextlib.ExitStack()
        if not self.fast:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        stack.enter_context(compute.using(self.plan.forward(self.fast, compute.current())))
        return stack

    @torch.no_grad()
    def generate(
        self,
        requests: list[SampleRequest],
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[list[Completion]]:
        """Answers per request, in order. on_text(answer, delta) streams text as it is decided;
        answers are numbered across requests in order."""
        starts = [0, *itertools.accumulate(r.n for r in requests)]  # first answer of each
        out: list[list[Completion]] = [[] for _ in requests]
        batch = LiveBatch(self, max(1, starts[-1]))
        for o, (req, base) in enumerate(zip(requests, starts[:-1], strict=True)):
            text = None
            if on_text is not None:
                text = lambda j, delta, base=base: on_text(base + j, delta)  # noqa: E731
            batch.add(req, text, lambda answers, o=o: out.__setitem__(o, answers))
        while batch.step():
            pass
        return out

    def prefill(self, prompts, capacity):
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
        chunk = self.generation_batch
        for c in range(0, width, chunk):
            e = min(c + chunk, width)
            h = dec(
                ids[:, c:e],
                start=c,
                cache=cache,
                key_mask=key_mask[:, :e] if padded else None,
                positions=positions[:, c:e] if padded else None,
            )  # (P, T, n_embd)
        return cache, dec.head(h[:, -1], float32=False), key_mask
