"""Small element-wise kernels fused by `torch.compile`, with an eager fallback.

A few hot spots are chains of element-wise operations over large tensors (a cross-entropy
tile's cast, max, exp and sum; attention's mask and softmax). Eager PyTorch runs each as its
own pass over memory; `torch.compile` fuses a chain into one loop. `fused(fn)` wraps such a
function: the first call compiles it (Inductor needs a C++ compiler on the CPU, Triton on a
GPU); when compiling fails, or `RETRO_COMPILE=0`, the plain function runs instead and the
numbers stay the same up to float rounding. Compiled code is cached on disk by PyTorch, so
only the first process on a machine pays the compile time (seconds per function).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)


def compile_enabled() -> bool:
    """RETRO_COMPILE=0 runs every fused kernel eagerly (the reference path in tests)."""
    return os.environ.get("RETRO_COMPILE", "1") not in ("0", "", "false")


def fused(fn: F) -> F:
    """`fn` compiled on first use, or `fn` itself when compiling is off or fails."""
    state: dict[str, Callable | None] = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not compile_enabled():
            return fn(*args, **kwargs)
        compiled = state.get("fn", ...)
        if compiled is ...:
            compiled = state["fn"] = torch.compile(fn, dynamic=None)
        if compiled is None:
            return fn(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # no compiler, an unsupported device: eager from now on
            state["fn"] = None
            log.warning("torch.compile unavailable for %s (%s); running eagerly", fn.__name__, exc)
            return fn(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
