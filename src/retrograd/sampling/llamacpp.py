"""The llama.cpp rollout backend: answers decoded by llama.cpp (llama-cpp-python's low-level
API) from the run's GGUF as stored, the policy's LoRA adapter applied to its context.

- One llama.cpp model read from the file (its quantized weights, memory-mapped) and one context
  whose KV cache is unified over `sequences` sequences. A request's prompt is prefilled once
  into one sequence and copied to its other answers' (`llama_memory_seq_cp`: in a unified cache
  the cells are shared, nothing is copied); each decode step is one `llama_decode` of every
  live answer's last token at its own position. An answer that ends frees its sequence at once
  and a waiting request takes it.
- The tokens are chosen from llama.cpp's float32 logits by our own rule (engine.TokenChooser):
  the same seeds, the same inverse-CDF draw, greedy / temperature / top-p, end-of-generation
  ids, stop strings and budgets, and the same behaviour log-probabilities, log_softmax(logits /
  T) at the sampled token (T = 1 for greedy). Only the logits differ from the in-process
  sampler's, by llama.cpp's arithmetic (and its f16 KV cache in the fast context).
- The policy: after an optimizer step (`policy_changed`) the adapter's factors are written
  with our exporter (gguf/lora_export.py, f32 factors: the run's output format at full
  precision) before the next `generate`, loaded as a fresh llama.cpp adapter, set on the
  context, and the previous adapter freed.

It is given the adapter's factors by a callable (`AdapterSource`); it knows nothing about
training, optimizers or rollout records, and nothing about what a run file says (the factory
in backend.py reads that).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.errors import RolloutBackendError
from retrograd.gguf.lora_export import write_lora_adapter
from retrograd.sampling.engine import TokenChooser
from retrograd.sampling.params import Completion, SampleRequest
from retrograd.sampling.rows import Row, advance, completion

log = logging.getLogger(__name__)

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
GGML_F16, GGML_F32 = 1, 0  # ggml_type of the KV cache
FLASH_AUTO, FLASH_OFF = -1, 0  # llama_flash_attn_type
WARN, ERROR = 3, 4  # ggml_log_level
INSTALL = (
    "pip install 'retrograd[llama-cpp]' (llama-cpp-python 0.3.36; build flags: docs/sampling.md)"
)


@dataclass(frozen=True)
class LlamaCppSettings:
    """The llama.cpp context. sequences: answers decoded at once (n_seq_max; grown to a
    request's n when one asks for more); ctx: tokens one answer may fill, prompt included;
    batch: tokens per llama_decode (prompt chunks; at least `sequences`); kv_f32: a float32 KV
    cache (else f16); flash: llama.cpp's own choice of flash attention (False: off, the exact
    context); gpu_layers: layers offloaded to a GPU (0 on a CPU build)."""

    threads: int
    sequences: int
    ctx: int
    batch: int
    kv_f32: bool = False
    flash: bool = True
    gpu_layers: int = 0


@dataclass(frozen=True)
class AdapterSource:
    """The policy's adapter: `factors()` -> {base tensor name (blk.0.attn_q.weight): (A (r,
    n_in), B (n_out, r))} float32 as they are now; alpha and the architecture as the
    exporter writes them."""

    architecture: str
    alpha: float
    factors: Callable[[], dict[str, tuple[np.ndarray, np.ndarray]]]


def load_library():
    """llama_cpp, or a RolloutBackendError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise RolloutBackendError(
            f'[training].rollout_backend = "llama_cpp" needs llama-cpp-python: {INSTALL}'
        ) from e
    return llama_cpp


def gpu_offload() -> bool:
    """Whether the installed llama.cpp can offload layers to a GPU (False for a CPU build)."""
    return bool(load_library().llama_supports_gpu_offload())


class LlamaLog:
    """llama.cpp's log kept from the terminal; its last error lines are quoted in our errors.
    One per process (`llama_log`): llama.cpp keeps the callback's pointer for the life of the
    process, so the callback must never be freed (one a backend owned, freed with it, crashed
    the next model load of any llama.cpp user in the process)."""

    def __init__(self, lib):
        self.lines: collections.deque[str] = collections.deque(maxlen=8)
        self._callback = lib.llama_log_callback(self._line)  # kept: llama.cpp holds a pointer
        self.install(lib)

    def install(self, lib) -> None:
        """Make this the callback llama.cpp logs through (again, if another was set since)."""
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _line(self, level: int, text: bytes, _user) -> None:
        if level in (WARN, ERROR) and text and text.strip():
            self.lines.append(text.decode("utf-8", "replace").strip())

    def tail(self) -> str:
        said = "; ".join(line for line in self.lines if line)
        return f" (llama.cpp: {said})" if said else ""


_LOG: LlamaLog | None = None  # the process's one callback, never freed


def llama_log(lib) -> LlamaLog:
    """The process's llama.cpp log, installed as the callback llama.cpp logs through."""
    global _LOG
    if _LOG is None:
        _LOG = LlamaLog(lib)
    else:
        _LOG.install(lib)
    return _LOG


@dataclass(eq=False)
class _Live:
    """One answer being decoded: its row, its llama.cpp sequence and its next position."""

    row: Row
    seq: int
    pos: int


class LlamaCppBackend:
    """The llama.cpp rollout backend (the module docstring)."""

    kind = "llama_cpp"

    def __init__(
        self,
        model_path: str | Path,
        chooser: TokenChooser,
        settings: LlamaCppSettings,
        adapter: AdapterSource | None = None,
        n_vocab: int | None = None,
    ):
        """chooser: rows and token choice (its tokenizer and max_len); adapter: the policy's
        adapter, applied now and after every `policy_changed` (None: the base model);
        n_vocab: the logits' width the run expects (checked against llama.cpp's)."""
        self.lib = load_library()
        self.log = llama_log(self.lib)
        self.lib.llama_backend_init()
        self.chooser, self.settings, self.adapter = chooser, settings, adapter
        self.path = Path(model_path)
        self._model = self._load_model()
        self._ctx = self._batch = None
        self._lora = None  # the adapter set on the context
        self._dirty = adapter is not None
        self._dir = Path(tempfile.mkdtemp(prefix="retrograd-llamacpp-"))
        try:
            vocab = self.lib.llama_model_get_vocab(self._model)
            self.n_vocab = int(self.lib.llama_vocab_n_tokens(vocab))
            if n_vocab is not None and n_vocab != self.n_vocab:
                raise RolloutBackendError(
                    f"{self.path.name}: llama.cpp reads {self.n_vocab} tokens, the model's "
                    f"output has {n_vocab}: the llama_cpp rollout backend cannot sample it"
                )
            self._open(settings.sequences)
            self.sync()  # an adapter llama.cpp refuses fails the run before it trains
            # NOTE: written again before the first answers: a resumed run restores the
            # adapter's weights after its backend is built, and says nothing
            self._dirty = adapter is not None
        except BaseException:
            self.close()
            raise

    @property
    def tokenizer(self):
        return self.chooser.tokenizer

    # -- the RolloutBackend interface ---------------------------------------------------------

    def generate(self, requests: Sequence[SampleRequest]) -> list[list[Completion]]:
        """Per request, its n completions in the order of its seeds."""
        requests = list(requests)
        most = max((r.n for r in requests), default=0)
        if most > self.sequences:
            self._open(most)
        self.sync()
        out: list[list[Completion] | None] = [None] * len(requests)
        rows = [self.chooser.make_rows(r, entry=i) for i, r in enumerate(requests)]
        left = [len(rs) for rs in rows]
        waiting = collections.deque(i for i, rs in enumerate(rows) if rs)
        for i, rs in enumerate(rows):
            if not rs:
                out[i] = []
        free = list(range(self.sequences - 1, -1, -1))  # llama.cpp sequence ids
        live: list[_Live] = []
        logits: torch.Tensor | None = None  # (len(live), V): each live answer's next logits
        try:
            while waiting or live:
                joined, joined_logits = self._admit(waiting, rows, requests, free)
                live += joined
                if joined_logits is not None:
                    logits = joined_logits if logits is None else torch.cat([logits, joined_logits])
                assert live and logits is not None, "a request needs more sequences than exist"
                tokens, logps = self.chooser.choose([a.row for a in live], logits)
                stay = []
                for a, tok, lp in zip(live, tokens, logps, strict=True):
                    advance(a.row, tok, lp)
                    if a.row.finish is None:
                        stay.append((a, tok))
                        continue
                    self._forget(a.seq)
                    free.append(a.seq)
                    i = a.row.entry
                    left[i] -= 1
                    if left[i] == 0:
                        out[i] = [completion(r) for r in rows[i]]
                live = [a for a, _ in stay]
                logits = self._step(stay) if stay else None
        finally:
            self.lib.llama_memory_clear(self._memory, True)
        return [o if o is not None else [] for o in out]

    def policy_changed(self, step: int) -> None:
        """The trained weights moved: the adapter is written and set before the next answers."""
        self._dirty = self.adapter is not None

    def close(self) -> None:
        lib = self.lib
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._lora is not None:
            lib.llama_adapter_lora_free(self._lora)
            self._lora = None
        if self._model is not None:
            lib.llama_model_free(self._model)
            self._model = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """The logits after `prompt` (V,) float32, with the adapter as last set: what llama.cpp
        computes, for checks (the rollouts go through `generate`)."""
        self.sync()
        try:
            return self._prefill([(0, tuple(prompt))])[0]
        finally:
            self.lib.llama_memory_clear(self._memory, True)

    @property
    def adapter_handle(self) -> int | None:
        """The address of the llama.cpp adapter set on the context (None before one is)."""
        return None if self._lora is None else ctypes.cast(self._lora, ctypes.c_void_p).value

    # -- the model, the context and the adapter -----------------------------------------------

    def _load_model(self):
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = self.settings.gpu_layers
        model = self.lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if not model:
            raise RolloutBackendError(
                f"{self.path}: llama.cpp could not load the model{self.log.tail()}; use "
                '[training].rollout_backend = "in_process"'
            )
        return model

    def _open(self, sequences: int) -> None:
        """A context for `sequences` answers at once (a fresh one when that grows)."""
        if sequences > MAX_SEQUENCES:
            raise RolloutBackendError(
                f"{sequences} answers to one prompt: llama.cpp decodes at most {MAX_SEQUENCES} "
                "sequences at once"
            )
        s, lib = self.settings, self.lib
        if self._ctx is not None:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            self._ctx = self._batch = None
        params = lib.llama_context_default_params()
        params.n_ctx = sequences * s.ctx  # every answer at its longest, prompts unshared
        params.n_batch = params.n_ubatch = max(s.batch, sequences)
        params.n_seq_max = sequences
        params.kv_unified = True  # a group's answers share their prompt's cells
        params.n_threads = params.n_threads_batch = s.threads
        params.type_k = params.type_v = GGML_F32 if s.kv_f32 else GGML_F16
        params.flash_attn_type = FLASH_AUTO if s.flash else FLASH_OFF
        params.no_perf = True
        ctx = lib.llama_init_from_model(self._model, params)
        if not ctx:
            raise RolloutBackendError(
                f"{self.path.name}: llama.cpp could not make a context of {params.n_ctx} "
                f"tokens for {sequences} sequences{self.log.tail()}; lower "
                "[training].generation_concurrency or ctx"
            )
        self._ctx, self.sequences = ctx, sequences
        self._batch = lib.llama_batch_init(params.n_batch, 0, 1)
        self._batch_size = params.n_batch
        self._memory = lib.llama_get_memory(ctx)
        if self._lora is not None:
            self._set(self._lora)

    def sync(self) -> None:
        """The adapter as the weights are now, set on the context, the previous one freed, if
        an update came since the last (`generate` calls it; a caller may, to time it)."""
        if not self._dirty or self.adapter is None:
            return
        a = self.adapter
        path = write_lora_adapter(
            self._dir / "policy.gguf",
            architecture=a.architecture,
            tensors=a.factors(),
            alpha=a.alpha,
            dtype="f32",
            name="policy",
        )
        fresh = self.lib.llama_adapter_lora_init(self._model, os.fsencode(path))
        path.unlink()
        if not fresh:
            raise RolloutBackendError(
                f"llama.cpp refused the policy's adapter for this {a.architecture} model"
                f'{self.log.tail()}; use [training].rollout_backend = "in_process"'
            )
        self._set(fresh)
        # NOTE: freed only once the context holds the new one, so the two never share an
        # address (llama.cpp skips a set whose adapters look the same)
        if self._lora is not None:
            self.lib.llama_adapter_lora_free(self._lora)
        self._lora, self._dirty = fresh, False

    def _set(self, lora) -> None:
        lib = self.lib
        adapters = (lib.llama_adapter_lora_p_ctypes * 1)(lora)
        scales = (ctypes.c_float * 1)(1.0)
        lib.llama_set_adapters_lora(self._ctx, adapters, 1, scales)

    # -- decoding -----------------------------------------------------------------------------

    def _admit(self, waiting, rows, requests, free) -> tuple[list[_Live], torch.Tensor | None]:
        """The waiting requests whose answers all find a free sequence, in order: their
        prompts prefilled (one sequence each, copied to the others) -> their answers, the
        logits each starts from."""
        groups = []
        while waiting and len(rows[waiting[0]]) <= len(free):
            i = waiting.popleft()
            groups.append((i, [free.pop() for _ in rows[i]]))
        if not groups:
            return [], None
        first = self._prefill([(seqs[0], requests[i].prompt) for i, seqs in groups])  # (G, V)
        joined, which = [], []
        for g, (i, seqs) in enumerate(groups):
            for s in seqs[1:]:
                self.lib.llama_memory_seq_cp(self._memory, seqs[0], s, -1, -1)
            n = len(requests[i].prompt)
            joined += [_Live(row, s, n) for row, s in zip(rows[i], seqs, strict=True)]
            which += [g] * len(seqs)
        return joined, first.index_select(0, torch.tensor(which))

    def _prefill(self, prompts: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
        """Each (sequence, prompt) decoded in batches of up to `batch` tokens that mix
        prompts -> the logits after each prompt's last token (P, V)."""
        cells = [
            (seq, tok, pos, pos == len(p) - 1) for seq, p in prompts for pos, tok in enumerate(p)
        ]
        parts = []
        for c in range(0, len(cells), self._batch_size):
            part = cells[c : c + self._batch_size]
            self._decode(part)
            wanted = sum(1 for cell in part if cell[3])
            if wanted:
                parts.append(self._logits(wanted))
        return torch.cat(parts)

    def _step(self, stay: list[tuple[_Live, int]]) -> torch.Tensor:
        """One decode step: each live answer's last token at its position -> its next logits."""
        self._decode([(a.seq, tok, a.pos, True) for a, tok in stay])
        for a, _ in stay:
            a.pos += 1
        return self._logits(len(stay))

    def _decode(self, cells) -> None:
        """cells: (sequence, token, position, logits wanted), in batch order."""
        b = self._batch
        for i, (seq, tok, pos, wanted) in enumerate(cells):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, wanted
            b.seq_id[i][0] = seq
        b.n_tokens = len(cells)
        code = self.lib.llama_decode(self._ctx, b)
        if code != 0:
            raise RolloutBackendError(
                f"llama_decode returned {code} for {len(cells)} tokens{self.log.tail()}"
            )

    def _logits(self, rows: int) -> torch.Tensor:
        """The last decode's `rows` output rows (rows, V) float32, copied out of llama.cpp."""
        ptr = self.lib.llama_get_logits(self._ctx)
        view = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return torch.from_numpy(view.copy())

    def _forget(self, seq: int) -> None:
        """A finished answer's cells go (a prompt's stay while another sequence holds them)."""
        self.lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
