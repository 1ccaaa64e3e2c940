"""Tokens under a byte grammar: which ids may come next, and the choice that respects it.

A row generating under a grammar (`Constraint`) keeps its parse state. Its token is chosen as
llama.cpp's sampler does with a grammar: first by the row's usual rule; when the grammar
refuses that token, the logits of every refused id are set to -inf and the rule runs again
with a fresh uniform number of the row's generator. Greedy rows thus take the most likely
allowed token, and sampled rows draw from the distribution restricted to the allowed tokens
(when top_p < 1, a first draw that happens to be allowed was taken from the unrestricted
nucleus, as in llama.cpp). End-of-generation ids are allowed only where the text may end;
when nothing may follow (the JSON value is closed) the row finishes at once.

Which ids are allowed is computed without walking the vocabulary in Python: the ids' first
two bytes are checked against the bytes the state allows (one table lookup per id); inside a
string, ids whose bytes all stay in the string are allowed as a class; only the remaining
candidates (those with three or more bytes outside strings, or quotes and escapes inside
them) are fed byte by byte. Nothing here knows about HTTP or the model.
"""

from __future__ import annotations

import numpy as np
import torch

from retrograd.sampling.grammar import STRING_BYTE, Grammar, State

END = 256  # the "second byte" of a one-byte piece


class TokenTable:
    """Every id's bytes as the text shows them (control tokens: none), in arrays."""

    def __init__(self, tokenizer):
        self.pieces = [tokenizer.token_to_piece(i, special=False) for i in range(tokenizer.n_vocab)]
        V = len(self.pieces)
        # first byte, or row END of the opening table (never allowed) for a piece without bytes
        self.first = np.full(V, END, dtype=np.intp)
        self.second = np.full(V, END, dtype=np.intp)
        self.long = np.zeros(V, dtype=bool)  # three bytes or more
        plain = np.frombuffer(bytes(b in STRING_BYTE for b in range(256)), dtype=bool)
        self.plain = np.zeros(V, dtype=bool)  # every byte one a string holds as it is
        for i, p in enumerate(self.pieces):
            if p:
                self.first[i] = p[0]
                if len(p) > 1:
                    self.second[i] = p[1]
                self.long[i] = len(p) > 2
                self.plain[i] = bool(plain[np.frombuffer(p, dtype=np.uint8)].all())


class Constraint:
    """One row's grammar and parse state, over a vocabulary's pieces."""

    def __init__(self, grammar: Grammar, table: TokenTable):
        self.grammar, self.table = grammar, table
        self.state: State = grammar.start

    @property
    def done(self) -> bool:
        return Grammar.done(self.state)

    def allows(self, token: int, stop_ids: frozenset[int]) -> bool:
        if token in stop_ids:
            return Grammar.accepts(self.state)
        piece = self.table.pieces[token] if token < len(self.table.pieces) else b""
        return bool(piece) and bool(self.grammar.feed(self.state, piece))

    def push(self, token: int) -> None:
        """Take a token the grammar allows (an ending id leaves the state as it is)."""
        piece = self.table.pieces[token]
        if piece:
            self.state = self.grammar.feed(self.state, piece)

    def mask(self, stop_ids: frozenset[int]) -> np.ndarray:
        """(n_vocab,) bool: the ids the grammar allows next."""
        g, state, table = self.grammar, self.state, self.table
        pairs = _pairs(g, state)
        ok = pairs[table.first, table.second]  # a copy: refined below
        check = ok & table.long
        if g.plain_loop(state, STRING_BYTE):
            check &= ~table.plain  # plain pieces keep the string going
        for i in np.flatnonzero(check):
            if not g.feed(state, table.pieces[i]):
                ok[i] = False
        if Grammar.accepts(state):
            for s in stop_ids:
                if s < ok.size:
                    ok[s] = True
        return ok


def _pairs(g: Grammar, state: State) -> np.ndarray:
    """(257, 257) bool [first byte, second byte or END]: the two-byte openings allowed (row
    256, for pieces without bytes, stays False). Kept per state: a string's state repeats."""
    cache = g.token_cache.setdefault("pairs", {})
    out = cache.get(state)
    if out is None:
        if len(cache) > 4096:
            cache.clear()
        out = np.zeros((257, 257), dtype=bool)
        for b in g.next_bytes(state):
            out[b, END] = True
            out[b, sorted(g.next_bytes(g.step(state, b)))] = True
        cache[state] = out
    return out


def restrict(logits: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """One row's logits (V,) with every refused id at -inf (ids past `allowed`, as padding
    rows of the output matrix, too), in float32."""
    keep = np.zeros(logits.shape[-1], dtype=bool)
    n = min(keep.size, allowed.size)
    keep[:n] = allowed[:n]
    out = logits.float().clone()
    out[torch.from_numpy(~keep).to(out.device)] = float("-inf")
    return out
