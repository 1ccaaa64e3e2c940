"""llama.cpp, through llama-cpp-python, as the oracle for logits: the exact-comparison settings.

f32 KV cache and flash attention off, as research/llama-cpp-facts.md prescribes for a
digit-for-digit comparison; logits for every position. llama.cpp's own logging is silenced.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

_QUIET = None


def quiet() -> None:
    """Silence llama.cpp's log output (model loading dumps hundreds of lines otherwise)."""
    global _QUIET
    import llama_cpp

    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))


def open_llama(path: Path, n_ctx: int = 512, threads: int = 2, exact: bool = True, **kw):
    import llama_cpp

    quiet()
    args = dict(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
        seed=0,
    )
    if exact:
        args.update(type_k=0, type_v=0, flash_attn=False)  # GGML_TYPE_F32 = 0
    args.update(kw)
    return llama_cpp.Llama(**args)


def llama_logits(path: Path, ids: list[int], exact: bool = True, **kw) -> np.ndarray:
    """(len(ids), n_vocab) float32 logits, row i predicting token i + 1."""
    llm = open_llama(path, n_ctx=max(64, len(ids)), exact=exact, **kw)
    llm.reset()
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
    llm.close()
    return out
