"""Llama-3-shaped GGUF models with random weights, at real sizes, written as a stream.

The shapes of Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B (layers, heads, key-value heads,
widths, the 128,256-token vocabulary, rope base 500,000 with llama 3 frequency factors, tied
embeddings at 1B and 3B), plus a tiny one for tests. The tokenizer is the real Llama 3 one:
every `tokenizer.*` key of llama.cpp's vocab-only `ggml-vocab-llama-bpe.gguf` (see
llama_vendor.py), with the real chat template of the model the shape copies.

The F16 file is written one tensor at a time, each in chunks of rows drawn from a generator
seeded by (seed, tensor index): tensor infos first, then the data, so that writing an 8B model
holds one chunk in memory, not 16 GB, and a tensor's values do not depend on the chunk size.
Weights are N(0, 1/fan_in) (a product keeps its input's scale, so activations stay finite
through the layers and the logits are about unit-sized), norms are ones. `build` quantizes with
llama.cpp's quantizer and deletes the F16 file. Knows nothing about what the models measure.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from retrograd.gguf.writer import atomic_path

N_VOCAB = 128256
ROPE_BASE = 500000.0
RMS_EPS = 1e-5
CHUNK_ELEMENTS = 1 << 24  # 16 Mi values a chunk: 64 MiB in float32 while drawn
VOCAB_FILE = "ggml-vocab-llama-bpe.gguf"


@dataclass(frozen=True)
class LlamaShape:
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    tied: bool
    rope_factor: float  # llama 3 rope scaling: 32 for 3.2, 8 for 3.1
    template: str  # chat template file in llama.cpp's models/templates
    context: int = 131072

    def matrices(self) -> list[tuple[str, int, int]]:
        """(GGUF name, rows, columns) of every matrix, in file order."""
        q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        out = [("token_embd.weight", N_VOCAB, self.n_embd)]
        for il in range(self.n_layer):
            b = f"blk.{il}."
            out += [
                (b + "attn_q.weight", q, self.n_embd),
                (b + "attn_k.weight", kv, self.n_embd),
                (b + "attn_v.weight", kv, self.n_embd),
                (b + "attn_output.weight", self.n_embd, q),
                (b + "ffn_gate.weight", self.n_ff, self.n_embd),
                (b + "ffn_up.weight", self.n_ff, self.n_embd),
                (b + "ffn_down.weight", self.n_embd, self.n_ff),
            ]
        if not self.tied:
            out.append(("output.weight", N_VOCAB, self.n_embd))
        return out

    def block_params(self) -> int:
        """Parameters of the layers' matrices (the non-embedding matmul weights)."""
        return sum(r * c for n, r, c in self.matrices() if n.startswith("blk."))

    def head_params(self) -> int:
        """Parameters of the output product (the embedding's when tied)."""
        return N_VOCAB * self.n_embd

    def params(self) -> int:
        """Every parameter of the file, norms and rope factors included."""
        norms = (2 * self.n_layer + 1) * self.n_embd
        return sum(r * c for _, r, c in self.matrices()) + norms + self.head_dim // 2


TEMPLATE_32 = "meta-llama-Llama-3.2-3B-Instruct.jinja"
SHAPES: dict[str, LlamaShape] = {
    "tiny": LlamaShape("tiny", 2, 256, 512, 4, 2, 64, False, 32.0, TEMPLATE_32, 4096),
    "1b": LlamaShape("1b", 16, 2048, 8192, 32, 8, 64, True, 32.0, TEMPLATE_32),
    "3b": LlamaShape("3b", 28, 3072, 8192, 24, 8, 128, True, 32.0, TEMPLATE_32),
    "8b": LlamaShape("8b", 32, 4096, 14336, 32, 8, 128, False, 8.0, "meta-llama-Llama-3.1-8B-Instruct.jinja"),
}  # fmt: skip


def rope_factors(shape: LlamaShape) -> np.ndarray:
    """Llama 3's per-frequency rope factors (`rope_freqs.weight`), as llama.cpp's converter
    computes them: low frequency factor 1, high 4, original context 8192."""
    low, high, old = 1.0, 4.0, 8192
    freqs = ROPE_BASE ** -(np.arange(0, shape.head_dim, 2) / shape.head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(shape.rope_factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / shape.rope_factor + smooth))
    return np.array(out, dtype=np.float32)


def add_header(w: gguf.GGUFWriter, shape: LlamaShape, vocab: Path, template: str) -> None:
    w.add_name(f"llama-shaped-{shape.name}-random")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(N_VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, vocab)
    w.add_chat_template(template)


def copy_tokenizer(w: gguf.GGUFWriter, vocab: Path) -> None:
    """Every `tokenizer.*` key of the vocab file, with the types llama.cpp writes them in (read
    by our reader: gguf-py's takes 25 s and 650 MB over 400k strings)."""
    from retrograd.gguf import GGUFFile

    for key, value in GGUFFile(vocab).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, np.ndarray):  # token types (INT32) or scores (FLOAT32)
            w.add_array(key, value.tolist())
        else:
            w.add_array(key, list(value))


def tensors(shape: LlamaShape) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, numpy shape, numpy dtype) of every tensor, in file order: F16 matrices, F32
    norms and rope factors."""
    out: list[tuple[str, tuple[int, ...], type]] = []
    for name, rows, cols in shape.matrices():
        if name.startswith("blk."):
            il = name.split(".")[1]
            if name.endswith("attn_q.weight"):
                out.append((f"blk.{il}.attn_norm.weight", (shape.n_embd,), np.float32))
            if name.endswith("ffn_gate.weight"):
                out.append((f"blk.{il}.ffn_norm.weight", (shape.n_embd,), np.float32))
        out.append((name, (rows, cols), np.float16))
    out.append(("output_norm.weight", (shape.n_embd,), np.float32))
    out.append(("rope_freqs.weight", (shape.head_dim // 2,), np.float32))
    return out


def chunks(
    shape: LlamaShape, index: int, name: str, dims: tuple[int, ...], seed: int, size: int
) -> Iterator[np.ndarray]:
    """The tensor's values, a block of rows at a time (about `size` values each)."""
    if name == "rope_freqs.weight":
        yield rope_factors(shape)
        return
    if len(dims) == 1:
        yield np.ones(dims, dtype=np.float32)
        return
    rows, cols = dims
    rng = np.random.default_rng([seed, index])
    step = max(1, size // cols)
    for r in range(0, rows, step):
        part = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        part *= 1.0 / math.sqrt(cols)
        yield part.astype(np.float16)


def write_f16(
    path: Path, shape: LlamaShape, vendor: Path, seed: int = 0, chunk: int = CHUNK_ELEMENTS
) -> Path:
    """Write the F16 model to path (atomically), one chunk of rows in memory at a time;
    `vendor` is llama.cpp's models folder (llama_vendor.llama_vendor_dir())."""
    template = (vendor / "templates" / shape.template).read_text(encoding="utf-8")
    plan = tensors(shape)
    w = gguf.GGUFWriter(None, "llama")
    add_header(w, shape, vendor / VOCAB_FILE, template)
    for name, dims, dtype in plan:
        w.add_tensor_info(name, dims, np.dtype(dtype), math.prod(dims) * np.dtype(dtype).itemsize)
    with atomic_path(path) as tmp:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        (out,) = w.fout
        for index, (name, dims, dtype) in enumerate(plan):
            w.write_padding(out, out.tell())  # each tensor starts aligned, as write_tensor_data
            for part in chunks(shape, index, name, dims, seed, chunk):
                part.tofile(out)
            w.write_padding(out, math.prod(dims) * np.dtype(dtype).itemsize)
        w.close()
    return path


def build(
    shape: LlamaShape,
    dst: Path,
    vendor: Path,
    ftype: str = "MOSTLY_Q4_K_M",
    seed: int = 0,
    threads: int = 2,
) -> Path:
    """The model quantized by llama.cpp to `ftype` at dst; the F16 file beside it is deleted."""
    from tests.factories.tiny_gguf import quantize

    f16 = dst.with_name(dst.stem + "-f16.gguf")
    try:
        write_f16(f16, shape, vendor, seed)
        return quantize(f16, dst, ftype, threads)
    finally:
        f16.unlink(missing_ok=True)
