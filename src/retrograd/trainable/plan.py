"""TrainPlan: what a run trains and what it leaves out, and why. Printed and checkpointed.

Built once at start from the run's [lora] section and the model; algorithms consume the plan,
never the config keys. Only the lora mode trains today; full, partial and hybrid modes are
validated by config/ and refused here with a clear message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from retrograd.errors import ConfigError
from retrograd.model.decoder import Decoder
from retrograd.trainable.lora import LoRA, apply_adapter_file, attach_lora, target_modules


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # base tensor, e.g. blk.3.attn_q.weight
    shape: tuple[int, int]  # (n_out, n_in)
    ggml_type: str


@dataclass(frozen=True)
class TrainPlan:
    mode: str  # lora
    rank: int
    alpha: float
    dtype: str  # storage of the exported adapter: f16 or f32
    trained: tuple[PlannedTensor, ...]
    excluded: tuple[tuple[str, str], ...]  # (tensor group, why)
    init_adapter: str | None = None

    @property
    def n_params(self) -> int:
        return sum(self.rank * (t.shape[0] + t.shape[1]) for t in self.trained)

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rank": self.rank,
            "alpha": self.alpha,
            "dtype": self.dtype,
            "trained": [t.name for t in self.trained],
            "excluded": [list(e) for e in self.excluded],
            "init_adapter": self.init_adapter,
        }

    def describe(self) -> list[str]:
        groups: dict[str, int] = {}
        for t in self.trained:
            key = re.sub(r"^blk\.\d+\.", "blk.*.", t.name)
            groups[key] = groups.get(key, 0) + 1
        lines = [
            f"LoRA rank {self.rank}, alpha {self.alpha:g} (scale {self.alpha / self.rank:g}), "
            f"{self.n_params:,} trained parameters, exported as {self.dtype}"
            + (f", starting from {self.init_adapter}" if self.init_adapter else "")
        ]
        lines += [f"  trains {name} ({n})" for name, n in sorted(groups.items())]
        lines += [f"  leaves {name}: {why}" for name, why in self.excluded]
        return lines


def build_lora_plan(
    decoder: Decoder, lora_cfg, *, init_adapter=None
) -> tuple[TrainPlan, dict[str, LoRA]]:
    """Attach the run's adapters (fresh, or read from init_adapter) and describe them."""
    if init_adapter is not None:
        adapters = apply_adapter_file(decoder, init_adapter)
        for lo in adapters.values():
            lo.requires_grad_(True)
        first = next(iter(adapters.values()))
        rank, alpha = first.rank, first.alpha
    else:
        rank, alpha = lora_cfg.rank, lora_cfg.alpha
        adapters = attach_lora(decoder, list(lora_cfg.targets), rank, alpha, lora_cfg.seed)
    modules = target_modules(decoder)
    trained = tuple(
        PlannedTensor(
            f"{n}.weight", tuple(modules[n].frozen.shape), modules[n].frozen.ggml_type.name
        )
        for n in adapters
    )
    excluded = [("token_embd.weight", "input embedding: llama.cpp adapters on it are not trained")]
    if decoder.output is None:
        excluded.append(("output (tied to token_embd)", "shares storage with the input embedding"))
    excluded.append(("*_norm.weight", "norms: llama.cpp ignores adapters on them"))
    untargeted = sorted({re.sub(r"^blk\.\d+\.", "blk.*.", n) for n in modules if n not in adapters})
    excluded += [(f"{n}.weight", "not in [lora].targets") for n in untargeted]
    dtype = getattr(lora_cfg, "dtype", "f16") if lora_cfg is not None else "f16"
    plan = TrainPlan(
        "lora",
        rank,
        float(alpha),
        dtype,
        trained,
        tuple(excluded),
        None if init_adapter is None else str(init_adapter),
    )
    return plan, adapters


def check_mode(mode: str) -> None:
    if mode != "lora":
        raise ConfigError(
            f"[training].trainable = {mode!r}: this version trains LoRA adapters only; "
            'use trainable = "lora" (full, partial and hybrid runs validate but do not train yet)'
        )


def trained_parameters(adapters: dict[str, LoRA]) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in plan order: names as in the adapter GGUF."""
    out = []
    for base, lo in adapters.items():
        out.append((f"{base}.weight.lora_a", lo.lora_a))
        out.append((f"{base}.weight.lora_b", lo.lora_b))
    return out
