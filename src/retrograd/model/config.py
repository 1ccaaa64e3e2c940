"""ModelConfig: the hyper-parameters of a GGUF model, read as llama.cpp reads them.

Knows metadata keys and llama.cpp's defaults for absent keys; does not know torch or tensors
beyond their names and shapes. Unsupported architectures and rope schemes fail here, before
any weight is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from retrograd.errors import UnsupportedError
from retrograd.gguf import GGUFFile
from retrograd.model.arch import ARCHS, ArchFacts


@dataclass(frozen=True)
class ModelConfig:
    arch: ArchFacts
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key length
    head_dim_v: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_freq_scale: float  # 1 / linear scaling factor
    swa_window: int  # 0: no sliding window
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attn_scale: float  # multiplies q before q @ k^T
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    tied_output: bool

    @property
    def name(self) -> str:
        return self.arch.name

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch_name = g.architecture
        if arch_name not in ARCHS:
            raise UnsupportedError(
                f"{g.path.name}: architecture {arch_name!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHS))})"
            )
        arch = ARCHS[arch_name]
        key = g.arch_get

        def required(k: str):
            v = key(k)
            if v is None:
                raise UnsupportedError(f"{g.path.name}: missing metadata key {arch_name}.{k}")
            return v

        n_layer = int(required("block_count"))
        n_embd = int(required("embedding_length"))
        n_head = _per_layer_uniform(g, "attention.head_count", required("attention.head_count"))
        n_head_kv = _per_layer_uniform(
            g, "attention.head_count_kv", key("attention.head_count_kv", n_head)
        )
        n_ff = _per_layer_uniform(g, "feed_forward_length", required("feed_forward_length"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        head_dim_v = int(key("attention.value_length", n_embd // n_head))
        n_rot = int(key("rope.dimension_count", head_dim))
        _check_rope_scaling(g, arch_name)
        factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
        rope_base = float(key("rope.freq_base", 10000.0))

        window, swa_layers = _sliding_window(g, arch, n_layer)
        rope_base_swa = float(
            key("rope.freq_base_swa", 10000.0 if arch_name != "gemma2" else rope_base)
        )
        if n_layer == arch.big_model_head_scale_layers:
            attn_scale = 1.0 / (n_embd / n_head) ** 0.5
        else:
            attn_scale = 1.0 / head_dim**0.5
        n_vocab = int(key("vocab_size", 0) or len(g.get("tokenizer.ggml.tokens") or []))
        if not n_vocab:
            n_vocab = g.tensor("token_embd.weight").shape[0]
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_rot=n_rot,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 4096)),
            rms_eps=float(required("attention.layer_norm_rms_epsilon")),
            rope_base=rope_base,
            rope_base_swa=rope_base_swa,
            rope_freq_scale=1.0 / factor if factor else 1.0,
            swa_window=window,
            swa_layers=swa_layers,
            attn_scale=attn_scale,
            attn_softcap=float(key("attn_logit_softcapping", 50.0)) if arch.attn_softcap else 0.0,
            final_softcap=float(key("final_logit_softcapping", arch.final_softcap_default) or 0.0),
            tied_output=not g.has_tensor("output.weight"),
        )


def _per_layer_uniform(g: GGUFFile, k: str, v) -> int:
    """llama.cpp accepts per-layer arrays for some counts; we support uniform ones."""
    if isinstance(v, (list, tuple)) or hasattr(v, "shape"):
        values = {int(x) for x in v}
        if len(values) != 1:
            raise UnsupportedError(
                f"{g.path.name}: {g.architecture}.{k} varies across layers; not supported"
            )
        return values.pop()
    return int(v)


def _check_rope_scaling(g: GGUFFile, arch_name: str) -> None:
    kind = g.arch_get("rope.scaling.type", "linear") or "linear"
    if kind not in ("linear", "none"):
        raise UnsupportedError(
            f"{g.path.name}: {arch_name}.rope.scaling.type = {kind!r} is not supported "
            "(linear and none are)"
        )
    if g.has_tensor("rope_factors_long.weight") or g.has_tensor("blk.0.rope_factors_long.weight"):
        raise UnsupportedError(
            f"{g.path.name}: LongRoPE factors (rope_factors_long) are not supported"
        )


def _sliding_window(g: GGUFFile, arch: ArchFacts, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    """Window size and which layers use it, as llama.cpp's load_swa_pattern decides."""
    window = g.arch_get("attention.sliding_window")
    if arch.swa_pattern_default == 0 or (arch.swa_needs_key and not window):
        return 0, (False,) * n_layer
    window = int(window or arch.swa_default)
    pattern = g.arch_get("attention.sliding_window_pattern", arch.swa_pattern_default)
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "shape"):
        layers = tuple(bool(x) for x in pattern)[:n_layer]
    else:
        n = int(pattern)
        layers = tuple(n == 0 or (il % n < n - 1) for il in range(n_layer))
    return window, layers
