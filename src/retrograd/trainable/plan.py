"""TrainPlan: what a run trains and what it leaves out, and why. Printed and checkpointed.

Built once at start from the run's [training].trainable, [lora] and [trainable] sections and
the model; algorithms consume the plan (and the `Trained` parameters beside it), never the
config keys. lora trains adapters; full every float base tensor; partial the [trainable]
selection; hybrid an adapter plus the selected norms and biases. Quantized tensors, the input
embedding and rotary constants are never trained: the plan lists them with the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from retrograd.errors import ConfigError
from retrograd.model.decoder import Decoder
from retrograd.trainable.base import TrainedTensor, attach, candidates
from retrograd.trainable.lora import LoRA, apply_adapter_file, attach_lora, target_modules

LORA_SEED = 42  # [lora].seed's default: the SFT shuffle seed of runs without an adapter


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # base tensor, e.g. blk.3.attn_q.weight
    shape: tuple[int, ...]  # (n_out, n_in) for a matrix, (n,) for a norm or bias
    ggml_type: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TrainPlan:
    mode: str  # lora, full, partial or hybrid
    rank: int  # 0 without an adapter
    alpha: float
    dtype: str  # storage of the exported adapter: f16 or f32
    trained: tuple[PlannedTensor, ...]  # the adapter's target tensors
    excluded: tuple[tuple[str, str], ...]  # (tensor group, why)
    init_adapter: str | None = None
    base: tuple[PlannedTensor, ...] = ()  # base tensors trained in place
    master_weights: str = "off"  # resolved: f32 (a master copy of 16-bit tensors) or off
    seed: int = LORA_SEED  # [lora].seed: the adapter's initialisation and the SFT shuffle

    @property
    def n_params(self) -> int:
        lora = sum(self.rank * (t.shape[0] + t.shape[1]) for t in self.trained)
        return lora + sum(t.numel for t in self.base)

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rank": self.rank,
            "alpha": self.alpha,
            "dtype": self.dtype,
            "trained": [t.name for t in self.trained],
            "base": [[t.name, t.ggml_type] for t in self.base],
            "master_weights": self.master_weights,
            "excluded": [list(e) for e in self.excluded],
            "init_adapter": self.init_adapter,
        }

    def signature(self) -> dict:
        """What a checkpoint's trajectory records of the plan: resume refuses a change."""
        out = {}
        if self.rank:
            out["lora"] = {
                "rank": self.rank,
                "alpha": self.alpha,
                "seed": self.seed,
                "targets": [p.name for p in self.trained],
            }
        if self.mode != "lora":
            out["trainable"] = {
                "mode": self.mode,
                "base": [t.name for t in self.base],
                "master_weights": self.master_weights,
            }
        return out

    def describe(self) -> list[str]:
        lines = []
        if self.rank:
            lines.append(
                f"LoRA rank {self.rank}, alpha {self.alpha:g} (scale {self.alpha / self.rank:g}), "
                f"exported as {self.dtype}"
                + (f", starting from {self.init_adapter}" if self.init_adapter else "")
            )
            lines += [f"  trains {name} ({n})" for name, n in _groups(self.trained)]
        if self.base:
            types = sorted({t.ggml_type for t in self.base})
            master = ", f32 master copy" if self.master_weights == "f32" else ""
            lines.append(
                f"{self.mode}: {len(self.base)} base tensors in their storage type "
                f"({', '.join(types)}{master})"
            )
            lines += [f"  trains {name} ({n})" for name, n in _groups(self.base)]
        lines.insert(0, f"training.trainable = {self.mode}: {self.n_params:,} trained parameters")
        lines += [f"  leaves {name}: {why}" for name, why in self.excluded]
        return lines


def _groups(tensors) -> list[tuple[str, int]]:
    groups: dict[str, int] = {}
    for t in tensors:
        key = re.sub(r"^blk\.\d+\.", "blk.*.", t.name)
        groups[key] = groups.get(key, 0) + 1
    return sorted(groups.items())


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
        seed=getattr(lora_cfg, "seed", LORA_SEED),
    )
    return plan, adapters


def trained_parameters(adapters: dict[str, LoRA]) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in plan order: names as in the adapter GGUF."""
    out = []
    for base, lo in adapters.items():
        out.append((f"{base}.weight.lora_a", lo.lora_a))
        out.append((f"{base}.weight.lora_b", lo.lora_b))
    return out


@dataclass
class Trained:
    """The Parameters a plan trains: adapters by base name, and base tensors in plan order."""

    adapters: dict[str, LoRA]
    base: list[TrainedTensor]

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter): adapter factors as in the adapter GGUF, base tensors by name."""
        return trained_parameters(self.adapters) + [(t.name, t.param) for t in self.base]

    def matrices(self) -> list[torch.nn.Parameter]:
        """The 2-D hidden weight matrices (Muon's share): trained matrices but the head."""
        return [t.param for t in self.base if t.kind == "matrix" and t.name != "output.weight"]


def build_plan(model, cfg) -> tuple[TrainPlan, Trained]:
    """The run's plan over the loaded model, with its Parameters made trainable."""
    mode = cfg.training.trainable
    lora_cfg = cfg.lora
    init = lora_cfg.init_adapter if lora_cfg is not None else None
    if mode == "lora":
        plan, adapters = build_lora_plan(model.decoder, lora_cfg, init_adapter=init)
        return plan, Trained(adapters, [])
    names, excluded = base_selection(model, cfg)
    master = resolve_master_weights(cfg.training.master_weights, [t for _, t in names])
    base = attach(model.decoder, names, master)
    shapes = {t.name: tuple(t.param.shape) for t in base}
    planned = tuple(PlannedTensor(n, shapes[n], typ) for n, typ in names)
    adapters: dict[str, LoRA] = {}
    lora = None
    if mode == "hybrid":
        lora, adapters = build_lora_plan(model.decoder, lora_cfg, init_adapter=init)
        excluded = [e for e in lora.excluded if not e[0].endswith("_norm.weight")] + excluded
    plan = TrainPlan(
        mode,
        lora.rank if lora else 0,
        lora.alpha if lora else 0.0,
        lora.dtype if lora else "f32",
        lora.trained if lora else (),
        tuple(excluded),
        lora.init_adapter if lora else None,
        base=planned,
        master_weights=master,
        seed=getattr(lora_cfg, "seed", LORA_SEED),
    )
    return plan, Trained(adapters, base)


def resolve_master_weights(setting: str, types: list[str]) -> str:
    """[training].master_weights for these storage types: f32 (a master copy of each 16-bit
    tensor) or off. auto keeps a copy exactly where a 16-bit tensor trains."""
    if setting == "auto":
        return "f32" if any(t != "F32" for t in types) else "off"
    return setting


def base_selection(model, cfg) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(name, storage type)] the run trains, [(tensor group, why)] it leaves), from the
    file's tensors: every one for full, the [trainable] selectors for partial and hybrid."""
    from retrograd.config import select_tensors

    tensors = model.gguf.tensors
    mode = cfg.training.trainable
    if mode == "full":
        names, left = list(tensors), []
    else:
        sel = select_tensors(cfg.trainable, tensors, mode=mode, source="[trainable]")
        names, left = list(sel.trained), list(sel.excluded)
    found = candidates(model.decoder)
    trained = []
    for name in names:
        why = never_trained(name, tensors[name], name in found)
        if why is None:
            trained.append((name, tensors[name].type_name))
        else:
            left.append((name, why))
    if model.decoder.output is None and mode == "full":
        left.append(("output (tied to token_embd)", "shares storage with the input embedding"))
    if not trained:
        raise ConfigError(
            f'training.trainable = "{mode}": this model has no trainable base tensor '
            "(every one is quantized, the input embedding or a constant; `retrograd inspect` "
            "lists them)"
        )
    return trained, _grouped(left)


def never_trained(name: str, info, has_module: bool) -> str | None:
    """Why the base tensor `name` cannot train, or None when it can."""
    if name == "token_embd.weight":
        return "input embedding, never trained"
    if name.startswith("rope_") or ".rope_" in name:
        return "rotary constants, never trained"
    if not info.is_float:
        return f"quantized ({info.type_name}), never trained"
    if not has_module:
        return "not trainable in this version (expert tensors, recurrence constants)"
    return None


def _grouped(left: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Exclusions by tensor group (blk.*.attn_q.weight) and reason, with their counts."""
    counts: dict[tuple[str, str], int] = {}
    for name, why in left:
        key = (re.sub(r"^blk\.\d+\.", "blk.*.", name), why)
        counts[key] = counts.get(key, 0) + 1
    return [(f"{g} ({n})" if n > 1 else g, why) for (g, why), n in counts.items()]
