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
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from retrograd import compute

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)


def compile_enabled() -> bool:
    """Whether the compute plan compiles (RETRO_COMPILE=0 runs every fused kernel eagerly:
    the reference path in tests)."""
    return compute.current().compile


RECOMPILE_LIMIT = 512  # shapes one fused function may compile for (PyTorch's default: 8)
# NOTE: past the limit PyTorch silently runs new shapes eagerly, whose rounding differs: a
# process that loads several models (the test suite) must never reach it.


def _configure_dynamo() -> None:
    """Process-wide, once: more shapes per function, and no automatic dynamic shapes.

    NOTE: with automatic dynamic shapes, a second size seen in a dimension compiled as a
    constant (another model's width) turns that dimension variable from then on, and the
    kernels' rounding would depend on what the process ran before; `fused` marks the
    dimensions that vary instead. This also applies to other torch.compile users in the
    process, who then get a new specialization per shape unless they mark dimensions too.
    """
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT
    )
    config.automatic_dynamic_shapes = False


def fused(fn: F | None = None, *, dynamic: dict[int, tuple[int, ...]] | None = None):
    """`fn` compiled on first use, or `fn` itself when compiling is off or fails.

    dynamic: positional argument -> its dimensions that vary between calls (the rows, a key
    count); every other dimension is compiled as a constant. NOTE:
    a reduction over a dimension compiled as a variable may be tiled after the size PyTorch
    saw first, so its rounding could depend on what the process ran before; reductions over
    constant dimensions give the same numbers in every process (losses reproduce, resume is
    exact).
    """
    if fn is None:
        return functools.partial(fused, dynamic=dynamic)
    state: dict[str, Callable | None] = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # NOTE: under a dispatch mode (preflight's device audit) compiling fails; run eagerly
        # for that call only, not from then on.
        if not compile_enabled() or _get_current_dispatch_mode() is not None:
            return fn(*args, **kwargs)
        compiled = state.get("fn", ...)
        if compiled is ...:
            _configure_dynamo()
            compiled = state["fn"] = torch.compile(fn)
        if compiled is None:
            return fn(*args, **kwargs)
        for i, dims in (dynamic or {}).items():
            if isinstance(args[i], torch.Tensor):
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(args[i], d)
        try:
            if "compiled" in state:
                return compiled(*args, **kwargs)
            t0 = time.perf_counter()
            out = compiled(*args, **kwargs)
            state["compiled"] = None
            log.debug("compiled %s in %.2f s (first call)", fn.__name__, time.perf_counter() - t0)
            return out
        except Exception as exc:  # no compiler, an unsupported device: eager from now on
            state["fn"] = None
            log.warning("torch.compile unavailable for %s (%s); running eagerly", fn.__name__, exc)
            return fn(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call
