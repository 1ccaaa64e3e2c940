"""Write a LoRA adapter as the GGUF a stock llama.cpp loads with `--lora`.

The layout is llama.cpp's own (research/llama-cpp-facts.md, convert_lora_to_gguf.py): metadata
`general.architecture`, `general.type = "adapter"`, `adapter.type = "lora"`,
`adapter.lora.alpha` (FLOAT32), `general.name`, `general.quantization_version`; tensors
`<base>.lora_a` (r, n_in) and `<base>.lora_b` (n_out, r) in row-major terms, no transpose;
for a 3-D expert tensor one pair per expert, stacked: (n_expert, r, n_in) and (n_expert,
n_out, r), which llama.cpp applies to each token's selected experts (build_lora_mm_id).
llama.cpp applies `y = W x + (alpha / r) B (A x)`, r read from lora_b. This module knows no
model: it checks names and shapes against each other, not against the base GGUF.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION

from retrograd.errors import GGUFError
from retrograd.gguf.writer import write_gguf

ADAPTER_DTYPES = {"f16": np.float16, "f32": np.float32}
_F16_MAX = float(np.finfo(np.float16).max)


def write_lora_adapter(
    path: str | Path,
    *,
    architecture: str,
    tensors: Mapping[str, tuple[np.ndarray, np.ndarray]],
    alpha: float,
    dtype: str = "f16",
    name: str | None = None,
) -> Path:
    """Write `tensors` {base name: (A (r, n_in), B (n_out, r))} as a llama.cpp LoRA GGUF
    (expert tensors: A (n_expert, r, n_in), B (n_expert, n_out, r)).

    Base names are the model's tensor names (`blk.3.attn_q.weight`). `dtype` is `f16` or `f32`.
    alpha 0 means "no alpha/rank scaling" to llama.cpp (and to our reader). The file is written
    atomically; non-finite values, or values f16 cannot hold, are refused.
    """
    path = Path(path)
    if dtype not in ADAPTER_DTYPES:
        raise GGUFError(f"{path.name}: adapter dtype {dtype!r}: must be f16 or f32")
    if not tensors:
        raise GGUFError(f"{path.name}: an adapter needs at least one tensor pair")
    out: dict[str, np.ndarray] = {}
    for base in sorted(tensors, key=_tensor_order):
        a, b = tensors[base]
        _check_pair(path.name, base, a, b)
        out[base + ".lora_a"] = _stored(path.name, base + ".lora_a", a, dtype)
        out[base + ".lora_b"] = _stored(path.name, base + ".lora_b", b, dtype)
    metadata = {
        "general.type": "adapter",
        "general.name": name if name is not None else path.stem,
        "general.quantization_version": GGML_QUANT_VERSION,
        "adapter.type": "lora",
        "adapter.lora.alpha": float(alpha),
    }
    return write_gguf(path, architecture=architecture, metadata=metadata, tensors=out)


def _tensor_order(name: str) -> tuple[int, str]:
    """Block order (blk.2 before blk.10), then name, as llama.cpp's converter lists them."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), name
    return -1, name


def _check_pair(where: str, base: str, a: np.ndarray, b: np.ndarray) -> None:
    if not base.endswith(".weight"):
        raise GGUFError(f"{where}: {base}: a LoRA target is a base weight name ending in .weight")
    if base.endswith("_norm.weight"):
        raise GGUFError(f"{where}: {base}: llama.cpp ignores adapters on norm weights")
    if base == "token_embd.weight":
        # llama.cpp expects another layout for the embedding; we never train it.
        raise GGUFError(f"{where}: {base}: adapters on the input embedding are not exported")
    same_experts = a.ndim == 2 or a.shape[0] == b.shape[0]
    if (
        a.ndim not in (2, 3)
        or b.ndim != a.ndim
        or not same_experts
        or a.shape[-2] != b.shape[-1]
        or a.shape[-2] == 0
    ):
        raise GGUFError(
            f"{where}: {base}: A {tuple(a.shape)} and B {tuple(b.shape)} must be (r, n_in) and "
            f"(n_out, r) with the same rank r (experts: (n_expert, r, n_in), (n_expert, n_out, r))"
        )


def _stored(where: str, name: str, x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise GGUFError(f"{where}: {name} holds non-finite values (the run diverged)")
    if dtype == "f16" and x.size and np.abs(x).max() > _F16_MAX:
        raise GGUFError(
            f"{where}: {name}: values up to {np.abs(x).max():.3g} overflow f16; "
            f'use [lora].dtype = "f32"'
        )
    return np.ascontiguousarray(x.astype(ADAPTER_DTYPES[dtype]))
