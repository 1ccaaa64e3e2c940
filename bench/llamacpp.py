"""llama.cpp decoding N sequences in parallel: the peer of our batched generation.

What llama.cpp's own `batched` and `parallel` examples do, through llama-cpp-python's
low-level API: one context with n_seq_max = N (llama.cpp's default layout: one KV stream per
sequence, not unified), n_batch = n_ubatch = 512 and the same thread count for prompts and
decoding. Prompts are prefilled in batches of up to n_batch tokens that mix sequences (logits
only for each prompt's last token); then each step is one `llama_decode` of a batch holding
every sequence's last token (its own seq_id and position), and the next tokens are the argmax
of the (N, n_vocab) float32 logits it returns, or, at a temperature above 0, drawn by a
llama.cpp sampler chain per sequence (its own seed) as we draw: the temperature first, then
top-p over the tempered distribution (`llama_sampler_init_top_p`, a no-op at 1), then the draw
(`llama_sampler_init_dist`). (llama.cpp's own default chain applies the temperature last, after
top-k 40, top-p 0.95 and min-p 0.05; these are the settings we are compared at.) End of
generation is ignored, so every sequence makes exactly `new` tokens. N = 1 is llama.cpp's
single stream. Knows nothing about us.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

N_BATCH = 512  # llama.cpp's default logical and physical batch


def _quiet(_level, _text, _user_data) -> None:
    """llama.cpp's log, dropped (it prints every graph it builds)."""


_QUIET = None  # the callback, made once and never freed: llama.cpp keeps its pointer


def quiet_llama(llama_cpp) -> None:
    global _QUIET
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(_quiet)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))


class LlamaBatched:
    """One model, a context per number of parallel sequences (made on first use)."""

    def __init__(self, path: str, threads: int, ctx_per_seq: int):
        import llama_cpp

        self.lib = llama_cpp
        quiet_llama(llama_cpp)
        llama_cpp.llama_backend_init()
        self.threads, self.ctx_per_seq = threads, ctx_per_seq
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self._contexts: dict[int, tuple] = {}

    def _context(self, n_seq: int):
        if n_seq not in self._contexts:
            lib = self.lib
            params = lib.llama_context_default_params()
            params.n_ctx = n_seq * self.ctx_per_seq
            params.n_batch = params.n_ubatch = N_BATCH
            params.n_seq_max = n_seq
            params.n_threads = params.n_threads_batch = self.threads
            params.no_perf = True
            ctx = lib.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} sequences")
            batch = lib.llama_batch_init(max(N_BATCH, n_seq), 0, 1)
            self._contexts[n_seq] = (ctx, batch)
        return self._contexts[n_seq]

    def generate(
        self,
        prompts: list[list[int]],
        new: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """Continuations of `new` tokens, all prompts decoded together: greedy at temperature
        0, else sampled (sequence s seeded with seed + s)."""
        lib = self.lib
        ctx, batch = self._context(len(prompts))
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        chains = None
        if temperature > 0:
            chains = [self._chain(temperature, top_p, seed + s) for s in range(len(prompts))]
        out: list[list[int]] = [[] for _ in prompts]
        try:
            self._prefill(ctx, batch, prompts, out, chains)
            for step in range(new - 1):
                cells = [(s, out[s][-1], len(p) + step) for s, p in enumerate(prompts)]
                self._fill(batch, [(s, tok, pos, True) for s, tok, pos in cells])
                self._decode(ctx, batch)
                picks = [(s, s) for s in range(len(prompts))]  # cell s is sequence s
                for s, tok in enumerate(self._next(ctx, picks, chains)):
                    out[s].append(tok)
        finally:
            for chain in chains or []:
                lib.llama_sampler_free(chain)  # and the samplers added to it
        return out

    def _chain(self, temperature: float, top_p: float, seed: int):
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _next(self, ctx, picks: list[tuple[int, int]], chains) -> list[int]:
        """The next token of each (sequence, batch index) whose logits the last decode made,
        in batch order."""
        if chains is None:
            return self._argmax(ctx, len(picks))
        return [self.lib.llama_sampler_sample(chains[s], ctx, i) for s, i in picks]

    def rate(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        """(generated tokens per second of wall time, prefill included; seconds)."""
        t = time.perf_counter()
        out = self.generate(prompts, new)
        dt = time.perf_counter() - t
        assert all(len(o) == new for o in out)
        return len(prompts) * new / dt, dt

    def _prefill(self, ctx, batch, prompts, out, chains) -> None:
        cells = [
            (s, tok, pos, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        for c in range(0, len(cells), N_BATCH):
            part = cells[c : c + N_BATCH]
            self._fill(batch, part)
            self._decode(ctx, batch)
            last = [(s, i) for i, (s, _tok, _pos, wanted) in enumerate(part) if wanted]
            for (s, _i), tok in zip(last, self._next(ctx, last, chains), strict=True):
                out[s].append(tok)

    @staticmethod
    def _fill(batch, cells) -> None:
        """cells: (sequence, token, position, logits wanted) in batch order."""
        for i, (seq, tok, pos, wanted) in enumerate(cells):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wanted
        batch.n_tokens = len(cells)

    def _decode(self, ctx, batch) -> None:
        code = self.lib.llama_decode(ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, ctx, rows: int) -> list[int]:
        """The argmax of the last decode's `rows` output rows, in batch order."""
        ptr = self.lib.llama_get_logits(ctx)
        flat = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        logits = np.ctypeslib.as_array(flat, shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def close(self) -> None:
        for ctx, batch in self._contexts.values():
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)
        self._contexts.clear()
        self.lib.llama_model_free(self.model)
