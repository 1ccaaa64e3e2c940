"""LoRA on the decoder's GGUF-named linears, and adapters read from llama.cpp LoRA GGUFs.

y = W x + scale * B (A x), with A (r, n_in) and B (n_out, r) as llama.cpp stores them
(research/llama-cpp-facts.md), scale = alpha / r. Expert tensors (n_expert, n_out, n_in) get
one pair per expert, stacked as llama.cpp's adapters hold them: A (n_expert, r, n_in), B
(n_expert, n_out, r), applied to the rows routed to each expert (moe.py). Targets are aliases
(q, k, v, o, qkv, ffn_gate, ffn_up, ffn_down, output; the ffn aliases also name the experts'
ffn_*_exps), tensor patterns (blk.*.attn_q.weight) or `auto`.
This module does not know optimizers or export; it attaches and reads adapters (and loads a
model with one: `load_adapted`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch import nn

from retrograd.errors import ConfigError, GGUFError
from retrograd.gguf import GGUFFile
from retrograd.model.arch import TARGET_ALIASES, auto_targets, match_targets
from retrograd.model.decoder import Decoder
from retrograd.model.dequant import dequantize
from retrograd.model.layers import Linear
from retrograd.model.loader import tensor_bytes
from retrograd.model.moe import Experts


class LoRA(nn.Module):
    """The low-rank update of one linear, or one per expert of an expert tensor (n_expert > 0:
    A and B gain a leading expert dimension). `enabled = False` makes its model the base model."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        rank: int,
        alpha: float,
        dtype: torch.dtype = torch.float32,
        device=None,
        n_expert: int = 0,
    ):
        super().__init__()
        lead = (n_expert,) if n_expert else ()
        self.lora_a = nn.Parameter(torch.zeros(*lead, rank, n_in, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(*lead, n_out, rank, dtype=dtype, device=device))
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank if alpha else 1.0  # llama.cpp: alpha 0 means no scaling
        self.enabled = True

    def reset(self, generator: torch.Generator) -> None:
        """PEFT's initialisation: A Kaiming-uniform (a = sqrt 5), B zero, so W starts unchanged."""
        bound = 1.0 / math.sqrt(self.lora_a.shape[-1])  # kaiming_uniform with a=sqrt(5)
        with torch.no_grad():
            a = torch.rand(self.lora_a.shape, generator=generator, dtype=torch.float32)
            self.lora_a.copy_((a * 2 - 1) * bound)
            self.lora_b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        return (x @ a.T) @ b.T * self.scale  # (..., n_out)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


@contextlib.contextmanager
def adapters_off(adapters: dict[str, LoRA]):
    """Within this block the model is its base model (the reference of a KL penalty): every
    adapter is switched off, no weight copied, and switched back on after."""
    was = {name: lora.enabled for name, lora in adapters.items()}
    for lora in adapters.values():
        lora.enabled = False
    try:
        yield
    finally:
        for name, lora in adapters.items():
            lora.enabled = was[name]


def linear_modules(decoder: Decoder) -> dict[str, Linear]:
    """GGUF base names (`blk.3.attn_q`, `output`) of every linear of the decoder."""
    out = {}
    for name, module in decoder.named_modules():
        if isinstance(module, Linear):
            out[name] = module
    return out


def target_modules(decoder: Decoder) -> dict[str, Linear | Experts]:
    """GGUF base names of every module an adapter can target: linears and expert tensors."""
    return {n: m for n, m in decoder.named_modules() if isinstance(m, (Linear, Experts))}


def resolve_targets(names: list[str], targets: list[str], auto: tuple[str, ...]) -> list[str]:
    """Linear base names selected by aliases, tensor patterns or `auto`, in model order."""
    chosen: set[str] = set()
    for target in targets:
        expanded = auto_targets(names, auto) if target == "auto" else (target,)
        for t in expanded:
            matched = match_targets(names, t)
            if not matched:
                raise ConfigError(
                    f"[lora].targets: {t!r} matches no tensor of this model "
                    f"(aliases: {', '.join(TARGET_ALIASES)}; or a pattern like blk.*.attn_q.weight)"
                )
            chosen.update(matched)
    return [n for n in names if n in chosen]


def attach_lora(
    decoder: Decoder,
    targets: list[str],
    rank: int,
    alpha: float,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, LoRA]:
    """Give each targeted linear (or expert tensor) a fresh adapter; returns them by base name."""
    modules = target_modules(decoder)
    chosen = resolve_targets(list(modules), targets, decoder.cfg.arch.lora_targets_auto)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in chosen:
        lin = modules[name]
        lora = LoRA(lin.in_features, lin.out_features, rank, alpha, dtype, n_expert=_experts(lin))
        lora.reset(gen)
        lin.lora = lora.to(decoder.device)
        out[name] = lin.lora
    return out


def load_adapted(path: str | Path, adapter: str | Path | None = None, **load):
    """A GGUF model (model.model.load's arguments) with a llama.cpp LoRA GGUF applied on top,
    frozen; without `adapter` the model alone."""
    from retrograd.model.model import load as load_model

    model = load_model(path, **load)
    if adapter is not None:
        apply_adapter_file(model.decoder, adapter)
    return model


def apply_adapter_file(decoder: Decoder, path: str | Path, scale: float = 1.0) -> dict[str, LoRA]:
    """Apply a llama.cpp LoRA GGUF (ours or converted elsewhere); its weights stay frozen."""
    g = GGUFFile(path)
    where = g.path.name
    if g.get("general.type") != "adapter" or g.get("adapter.type") != "lora":
        raise GGUFError(f"{where}: not a LoRA adapter (general.type = {g.get('general.type')!r})")
    if g.get("general.architecture") != decoder.cfg.name:
        raise GGUFError(
            f"{where}: adapter for {g.get('general.architecture')!r}, model is {decoder.cfg.name!r}"
        )
    alpha = g.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise GGUFError(f"{where}: adapter.lora.alpha = {alpha!r:.60}: must be a finite number")
    alpha = float(alpha)
    modules = target_modules(decoder)
    out = {}
    for name in sorted(t[: -len(".lora_a")] for t in g.tensors if t.endswith(".lora_a")):
        if name.endswith("_norm.weight"):
            continue  # llama.cpp ignores adapters on norms
        base = name.removesuffix(".weight")
        if base not in modules:
            raise GGUFError(
                f"{where}: {name}.lora_a targets a tensor this model has no linear for ({base})"
            )
        if name + ".lora_b" not in g.tensors:
            raise GGUFError(f"{where}: {name}.lora_a has no {name}.lora_b")
        a_info, b_info = g.tensor(name + ".lora_a"), g.tensor(name + ".lora_b")
        lin = modules[base]
        n_expert = _experts(lin)
        lead = (n_expert,) if n_expert else ()
        a_shape, b_shape = tuple(a_info.shape), tuple(b_info.shape)
        r = a_shape[-2] if len(a_shape) >= 2 else 0
        # the shapes are checked before anything is dequantized: the file may be anyone's
        want_a, want_b = (*lead, r, lin.in_features), (*lead, lin.out_features, r)
        if r < 1 or a_shape != want_a or b_shape != want_b:
            size = "x".join(str(d) for d in (*lead, lin.out_features, lin.in_features))
            raise GGUFError(
                f"{where}: {name}: lora_a {a_shape} and lora_b {b_shape} do not fit a {size} "
                f"weight at a rank of at least 1"
            )
        a, b = _dense(a_info), _dense(b_info)
        lora = LoRA(lin.in_features, lin.out_features, r, alpha, n_expert=n_expert)
        lora.scale *= scale
        with torch.no_grad():
            lora.lora_a.copy_(a)
            lora.lora_b.copy_(b)
        lora.requires_grad_(False)
        lin.lora = lora.to(decoder.device)
        out[base] = lin.lora
    if not out:
        raise GGUFError(f"{where}: adapter holds no lora_a/lora_b tensors")
    return out


def _experts(module: Linear | Experts) -> int:
    """The number of experts of an expert tensor; 0 for a plain linear."""
    return module.n_expert if isinstance(module, Experts) else 0


def _dense(info) -> torch.Tensor:
    return dequantize(tensor_bytes(info, torch.device("cpu")), info.ggml_type, info.shape)
