"""Tiny GGUF models for every supported architecture, written with gguf-py.

Two or three layers, n_embd 256 (a multiple of the 256-element K-quant blocks), GQA, a small
SPM vocabulary with byte tokens so that llama.cpp accepts the file. Quantized variants are made
from the F32 file with llama.cpp's own quantizer (`quantize`), as real files are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB = 256, 512, 4, 2, 64, 512


@dataclass
class TinySpec:
    arch: str
    n_layer: int = 2
    window: int = 0  # sliding window (gemma2, gemma3)
    rope_freqs: bool = False  # llama 3 style frequency factors
    qkv_bias: bool = False
    tied: bool = True
    extra: dict = field(default_factory=dict)


SPECS: dict[str, TinySpec] = {
    "llama": TinySpec("llama", tied=False),
    "llama3": TinySpec("llama", rope_freqs=True),
    "qwen2": TinySpec("qwen2", qkv_bias=True),
    "qwen3": TinySpec("qwen3", tied=False),
    "gemma3": TinySpec("gemma3", n_layer=3, window=8),
    "gemma2": TinySpec("gemma2", n_layer=2, window=8),
    "phi3": TinySpec("phi3", tied=False),
}

# Families written by their own modules (tests/factories/tiny_<group>.py): name -> writer
# (path, seed, chat_template) -> path. They register themselves here on import.
WRITERS: dict = {}
FAMILY_MODULES = ("tiny_dense", "tiny_moe", "tiny_recurrent", "tiny_gdn", "tiny_lfm2")


def _load_family_writers() -> None:
    import importlib

    for module in FAMILY_MODULES:
        try:
            importlib.import_module(f"tests.factories.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"tests.factories.{module}":
                raise


def names() -> list[str]:
    """Every tiny model the factory writes: SPECS and the registered families."""
    _load_family_writers()
    return sorted(set(SPECS) | set(WRITERS))


def add_tokenizer(w: gguf.GGUFWriter, chat_template: str | None = None) -> None:
    """The tiny SPM vocabulary, special ids and an optional chat template."""
    tokens, scores, types = vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def vocab() -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: unk, bos, eos, 256 byte tokens, then word pieces."""
    # llama.cpp looks "<|endoftext|>" up by name in models called phi3.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|endoftext|>"]
    types = [2, 3, 3] + [6] * 256 + [3]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["▁" + c for c in letters] + list(letters)
    pieces += ["▁" + a + b for a in "etaoinshr" for b in "etaoinshr"]
    for p in pieces:
        if len(tokens) == N_VOCAB:
            break
        tokens.append(p)
        types.append(1)
    while len(tokens) < N_VOCAB:
        tokens.append(f"▁w{len(tokens)}")
        types.append(1)
    scores = [0.0] * 3 + [-1000.0] * 256 + [0.0] + [-float(i) for i in range(len(tokens) - 260)]
    return tokens, scores, types


def rand(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def attention_header(
    path: Path,
    arch: str,
    name: str,
    n_layer: int,
    eps: float,
    rope_base: float,
    general_name: str | None = None,
) -> gguf.GGUFWriter:
    """A writer with what the tiny attention models share: N_EMBD, N_FF, N_HEAD, N_HEAD_KV and
    HEAD_DIM, a 256-token context, F32 weights, and the given layers, norm eps and rope base."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}" if general_name is None else general_name)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_base)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def write_tiny(
    path: Path,
    name: str,
    seed: int = 0,
    chat_template: str | None = None,
    general_name: str | None = None,
) -> Path:
    """Write the F32 tiny model `name` (a key of SPECS) to path, with `chat_template` as its
    tokenizer.chat_template when given (none otherwise, as the Gemma test model) and
    `general_name` as its general.name when given."""
    if name not in SPECS:
        _load_family_writers()
        return WRITERS[name](path, seed, chat_template)
    spec = SPECS[name]
    arch = spec.arch
    rng = np.random.default_rng(seed)
    eps = 1e-6 if arch.startswith("gemma") else 1e-5
    rope_base = 1e6 if arch == "gemma3" else 1e4
    w = attention_header(path, arch, name, spec.n_layer, eps, rope_base, general_name)
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    if spec.window:
        w.add_sliding_window(spec.window)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    add_tokenizer(w, chat_template)

    w.add_tensor(
        "token_embd.weight",
        rand(rng, N_VOCAB, N_EMBD, scale=1.0 if arch.startswith("gemma") else 0.5)
        / (16.0 if arch.startswith("gemma") else 1.0),
    )
    w.add_tensor("output_norm.weight", norm_weight(rng, N_EMBD))
    if not spec.tied:
        w.add_tensor("output.weight", rand(rng, N_VOCAB, N_EMBD))
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    q_len, kv_len = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", norm_weight(rng, N_EMBD))
        if arch == "phi3":
            w.add_tensor(b + "attn_qkv.weight", rand(rng, q_len + 2 * kv_len, N_EMBD))
        else:
            w.add_tensor(b + "attn_q.weight", rand(rng, q_len, N_EMBD))
            w.add_tensor(b + "attn_k.weight", rand(rng, kv_len, N_EMBD))
            w.add_tensor(b + "attn_v.weight", rand(rng, kv_len, N_EMBD))
        if spec.qkv_bias:
            w.add_tensor(b + "attn_q.bias", rand(rng, q_len, scale=0.1))
            w.add_tensor(b + "attn_k.bias", rand(rng, kv_len, scale=0.1))
            w.add_tensor(b + "attn_v.bias", rand(rng, kv_len, scale=0.1))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(b + "attn_q_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(b + "attn_k_norm.weight", norm_weight(rng, HEAD_DIM))
        w.add_tensor(b + "attn_output.weight", rand(rng, N_EMBD, q_len))
        w.add_tensor(b + "ffn_norm.weight", norm_weight(rng, N_EMBD))
        if arch == "phi3":
            w.add_tensor(b + "ffn_up.weight", rand(rng, 2 * N_FF, N_EMBD))
        else:
            w.add_tensor(b + "ffn_gate.weight", rand(rng, N_FF, N_EMBD))
            w.add_tensor(b + "ffn_up.weight", rand(rng, N_FF, N_EMBD))
        w.add_tensor(b + "ffn_down.weight", rand(rng, N_EMBD, N_FF))
        if arch.startswith("gemma"):
            w.add_tensor(b + "post_attention_norm.weight", norm_weight(rng, N_EMBD))
            w.add_tensor(b + "post_ffw_norm.weight", norm_weight(rng, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: Path, dst: Path, ftype: str, threads: int = 2) -> Path:
    """Re-encode src with llama.cpp's quantizer, on `threads` threads; ftype names a
    LLAMA_FTYPE_* (e.g. MOSTLY_Q4_K_M).

    `pure` keeps every matrix in the requested type (llama.cpp's mixes otherwise pick other
    types for some tensors); ALL_F32 makes the dequantized F32 copy that exactness tests run
    llama.cpp on.
    """
    import llama_cpp

    from tests.oracles.llama_oracle import quiet

    quiet()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.nthread = threads
    params.allow_requantize = True
    params.pure = not ftype.endswith(("_M", "_S", "_L"))
    tmp = dst.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {ftype}) failed with {rc}")
    tmp.replace(dst)
    return dst
