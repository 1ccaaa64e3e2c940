"""A live batch: answers join at the next decode step and leave the step they finish.

`LiveBatch.add(request)` queues a request; each `step()` (1) prefills what was added since the
last step and places its KV rows into the batch, (2) chooses every live row's next token with
its own settings and seed (`Sampler.choose`), streams text and hands finished requests their
completions, (3) lets finished and cancelled rows leave, and (4) runs one decode step for
the rest on the sampler's fast path (packed weights, the per-layer decode graph).
`Sampler.generate` is this loop with everything added before the first step; `retrograd
serve` adds requests while it runs.

Cache slots. One buffer per layer holds `max_rows` rows of `capacity` slots. All live rows
write their next token at the same slot (`slot`, the decoder's `start`) and each row keeps
its tokens contiguous in [first, slot): a joining prompt is placed so that its last token
sits at slot - 1 (left of it: masked slots), its rope positions count from its own first
slot (position = slot - first), and `key_mask` hides everything left of `first`. Rows live
in buffer rows [0, B), so the decoder sees views of the buffers, not copies. A row that
leaves is replaced by the last row (one row's slots copied, not the batch's). When a prompt
is wider than `slot`, every live row moves right to make room; when the slots run out, the
rows move left by the padding they all share (`min(first)`), and the buffers grow only when
that is not enough (by at least GROW_MIN slots, at most what the rows may still need). Rows
also move left once the common padding is at least half the slots (attention reads every
slot up to `slot`).

Contiguous rows keep slot distance equal to position distance, so sliding-window layers mask
the right keys. What a row computes does not depend on its batch mates except through the
rounding of batched products: see docs/sampling.md for what is guaranteed. Knows nothing
about HTTP, threads or chat templates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from retrograd.model.kv_cache import KVCache, select_states
from retrograd.sampling.params import Completion, SampleRequest
from retrograd.sampling.rows import Row, advance, completion

GROW_MIN = 512  # slots added at least when the buffers grow
REBASE_MIN = 64  # common padding (slots) worth moving the rows left for


@dataclass(eq=False)
class Entry:
    """One request in the batch: its answers' rows and where their text and results go."""

    request: SampleRequest
    on_text: Callable[[int, str], None] | None  # (answer, text delta)
    on_done: Callable[[list[Completion]], None] | None  # every answer, in order
    rows: list[Row] = field(default_factory=list)
    left: int = 0  # answers not finished yet
    cancelled: bool = False


class LiveBatch:
    def __init__(self, sampler, max_rows: int):
        """sampler: a `Sampler` (decoder, settings, prefill, choice); max_rows: answers at once."""
        if max_rows < 1:
            raise ValueError("a batch holds at least one row")
        self.sampler = sampler
        self.decoder = sampler.decoder
        self.max_rows = max_rows
        self.rows: list[Row] = []  # live rows, in buffer order
        self.first: list[int] = []  # each row's first slot
        self.slot = 0  # the slot every row writes next
        self.logits: torch.Tensor | None = None  # (B, V): each live row's next-token logits
        self.k: list[torch.Tensor] = []  # per layer (max_rows, H_kv, capacity, D)
        self.v: list[torch.Tensor] = []
        self.states: dict = {}  # recurrent layers: the live rows' states, in row order
        self._pending: list[Entry] = []
        self._view: KVCache | None = None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    @property
    def size(self) -> int:
        """Rows live or waiting for the next step: what max_rows bounds."""
        return len(self.rows) + sum(len(e.rows) for e in self._pending)

    @property
    def idle(self) -> bool:
        return not self.rows and not self._pending

    def add(
        self,
        request: SampleRequest,
        on_text: Callable[[int, str], None] | None = None,
        on_done: Callable[[list[Completion]], None] | None = None,
    ) -> Entry:
        """Queue a request for the next step; ValueError when it cannot be answered (an empty
        prompt, no room in the context, more answers than free rows)."""
        entry = Entry(request, on_text, on_done)
        entry.rows = self.sampler.make_rows(request, entry)
        entry.left = len(entry.rows)
        if self.size + len(entry.rows) > self.max_rows:
            raise ValueError(
                f"{len(entry.rows)} answers do not fit: {self.size} of {self.max_rows} rows taken"
            )
        if not entry.rows:
            if on_done is not None:
                on_done([])
            return entry
        self._pending.append(entry)
        return entry

    def cancel(self, entry: Entry) -> None:
        """Its rows leave at the next step; on_text and on_done are not called again."""
        entry.cancelled = True

    def drop(self) -> list[Entry]:
        """Empty the batch (after an error): the entries that were live or waiting."""
        entries = list(dict.fromkeys([r.entry for r in self.rows] + self._pending))
        self.rows, self.first, self._pending = [], [], []
        self.slot, self.logits, self._view, self.states = 0, None, None, {}
        return entries

    @torch.no_grad()
    def step(self) -> bool:
        """Admit, choose, finish, decode (see the module docstring). False once nothing is
        live or waiting."""
        with self.sampler.context():
            self._admit()
            if not self.rows:
                return False
            tokens, logps = self.sampler.choose(self.rows, self.logits)
            self._decide(tokens, logps)
            keep = [
                i for i, r in enumerate(self.rows) if r.finish is None and not r.entry.cancelled
            ]
            tokens = self._leave(keep, tokens)
            if self.rows:
                self._forward(tokens)
        return not self.idle

    # -- the steps ---------------------------------------------------------------------------

    def _admit(self) -> None:
        """Prefill the requests added since the last step; their rows join the batch."""
        new = [e for e in self._pending if not e.cancelled]
        self._pending = []
        if not new:
            return
        rows = [r for e in new for r in e.rows]
        prompts = list(dict.fromkeys(e.request.prompt for e in new))  # unique, in order
        width = max(len(p) for p in prompts)
        small, logits, _ = self.sampler.prefill(prompts, width)
        index = [prompts.index(r.entry.request.prompt) for r in rows]
        which = torch.tensor(index, device=self.decoder.device)
        if not self.rows:
            self.slot, self.first = width, []
        at = max(self.slot, width)  # the joiners' last prompt token goes to slot at - 1
        need = at + max(r.remaining for r in self.rows + rows)
        capacity = self.capacity
        if capacity <= at:
            capacity = at + min(need - at, max(GROW_MIN, capacity))
        self._move(at - self.slot, capacity)
        B, b = len(self.rows), len(rows)
        for buf, part in zip(self.k + self.v, small.k + small.v, strict=True):
            buf[B : B + b, :, at - width : at] = part.index_select(0, which)
        joined = select_states(small.current_states(), which)
        self.states = {
            layer: tuple(torch.cat(p) for p in zip(self.states[layer], s, strict=True)) if B else s
            for layer, s in joined.items()
        }
        self.rows += rows
        self.first += [at - r.prompt_len for r in rows]
        logits = logits.index_select(0, which)  # (b, V)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self._view = None

    def _decide(self, tokens: list[int], logps: list[float]) -> None:
        """Each row takes its token; text is streamed and finished requests are answered."""
        for row, tok, lp in zip(self.rows, tokens, logps, strict=True):
            entry = row.entry
            if entry.cancelled:
                continue
            advance(row, tok, lp)
            if entry.on_text is not None:
                delta = row.text.delta(final=row.finish is not None)
                if delta:
                    entry.on_text(row.answer, delta)
            if row.finish is not None:
                entry.left -= 1
                if entry.left == 0 and entry.on_done is not None:
                    entry.on_done([completion(r) for r in entry.rows])

    def _leave(self, keep: list[int], tokens: list[int]) -> list[int]:
        """Only rows `keep` stay: the last rows move into the freed buffer rows. -> their
        tokens, in the new order."""
        B = len(keep)
        if B == len(self.rows):
            return tokens
        order = list(range(B))
        kept = set(keep)
        holes = [i for i in range(B) if i not in kept]
        movers = [i for i in keep if i >= B]
        for h, m in zip(holes, movers, strict=True):
            order[h] = m
        if holes:
            dev = self.decoder.device
            dst, src = torch.tensor(holes, device=dev), torch.tensor(movers, device=dev)
            for buf in self.k + self.v:
                buf[dst, :, : self.slot] = buf[src, :, : self.slot]
        if self.states:
            self.states = select_states(self.states, order)
        self.rows = [self.rows[i] for i in order]
        self.first = [self.first[i] for i in order]
        self.logits, self._view = None, None
        if not self.rows:
            self.slot = 0
            return []
        lead = min(self.first)
        if lead >= REBASE_MIN and 2 * lead >= self.slot:
            self._move(-lead, self.capacity)
        return [tokens[i] for i in order]

    def _forward(self, tokens: list[int]) -> None:
        """One decode step: every row's token at `slot` -> the rows' next logits."""
        if self.slot >= self.capacity:
            self._make_room()
        dec, dev = self.decoder, self.decoder.device
        first = torch.tensor(self.first, device=dev)  # (B,)
        ids = torch.tensor(tokens, device=dev)[:, None]  # (B, 1)
        key_mask = torch.arange(self.slot + 1, device=dev)[None, :] >= first[:, None]
        positions = (self.slot - first)[:, None]  # (B, 1)
        cache = self._cache()
        if self.states:
            cache.set_states(self.states, self.slot)
        h = dec(ids, start=self.slot, cache=cache, key_mask=key_mask, positions=positions)
        self.logits = dec.head(h[:, -1], float32=False)  # (B, V), 16-bit when bf16 compute
        self.slot += 1
        if self.states:
            self.states = cache.current_states()

    # -- slots -------------------------------------------------------------------------------

    def _make_room(self) -> None:
        """A free slot for the next step: the rows' common padding first, then more slots."""
        lead = min(self.first)
        capacity = self.capacity
        if 4 * lead < capacity:  # too little to be worth a move of its own: grow as well
            need = max(r.remaining for r in self.rows)
            capacity += max(1, min(need, max(GROW_MIN, capacity)))
        self._move(-lead, capacity)

    def _move(self, shift: int, capacity: int) -> None:
        """Every live row's slots `shift` later (earlier when negative), in buffers of
        `capacity` slots (new buffers when that changes)."""
        lo, hi = min(self.first, default=self.slot), self.slot  # the live rows' slots
        B = len(self.rows)
        if capacity != self.capacity:
            old = self.k + self.v  # none before the first allocation
            self.k, self.v = self._buffers(capacity)
            for new, buf in zip(self.k + self.v, old, strict=False):
                new[:B, :, lo + shift : hi + shift] = buf[:B, :, lo:hi]
        elif shift and B:
            for buf in self.k + self.v:
                buf[:B, :, lo + shift : hi + shift] = buf[:B, :, lo:hi].clone()
        self.first = [f + shift for f in self.first]
        self.slot += shift
        self._view = None

    def _buffers(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed buffers: masked slots must hold finite numbers (0 x NaN would leak)."""
        cfg, dtype, dev = self.decoder.cfg, self.sampler.kv_dtype, self.decoder.device

        def buf(d: int) -> torch.Tensor:
            return torch.zeros(self.max_rows, cfg.n_head_kv, capacity, d, dtype=dtype, device=dev)

        return [buf(cfg.head_dim) for _ in range(cfg.n_layer)], [
            buf(cfg.head_dim_v) for _ in range(cfg.n_layer)
        ]

    def _cache(self) -> KVCache:
        """The live rows' views of the buffers, as the decoder takes them."""
        if self._view is None:
            B = len(self.rows)
            self._view = KVCache([t[:B] for t in self.k], [t[:B] for t in self.v], self.slot)
        return self._view
