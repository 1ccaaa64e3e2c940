"""Base tensors trained in place (full, partial, hybrid), in their storage type.

A trained tensor is a matrix of a `Linear` (which then reads it instead of the file's bytes),
a bias, or a norm weight. Each is one Parameter the optimizer updates:
- F32 storage: the float32 tensor itself;
- F16/BF16 storage with a master copy (master_weights = f32, or auto): a float32 Parameter
  that the forward pass rounds to the storage type on every use, so the model computes with
  exactly the weights it will export, and small updates accumulate in float32 (4 bytes per
  parameter more than training the stored type directly);
- F16/BF16 with master_weights = off: the 16-bit tensor itself (AdamW and SGD update it).
Norms and biases are float32 in the decoder whatever their storage, and are rounded to it only
on export. Quantized tensors, the input embedding and rotary constants never reach this module
(plan.py excludes them). This module knows the decoder's modules, not optimizers or files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from retrograd.model.decoder import Decoder
from retrograd.model.layers import Linear, RMSNorm

STORAGE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class TrainedTensor:
    """One trained base tensor: its GGUF name, the Parameter trained, how it is stored."""

    name: str  # blk.3.attn_q.weight
    param: nn.Parameter
    storage: str  # F32, F16 or BF16: the type the file stores and the export writes
    kind: str  # matrix, bias or norm

    @property
    def master(self) -> bool:
        """Whether `param` is an f32 master copy of a 16-bit tensor."""
        return self.storage != "F32" and self.param.dtype == torch.float32

    def stored(self) -> torch.Tensor:
        """The values in the storage type, on the CPU (what the export writes)."""
        return self.param.detach().to(STORAGE[self.storage]).cpu()


def candidates(decoder: Decoder) -> dict[str, tuple[nn.Module, str]]:
    """GGUF name -> (module, kind) of every base tensor this decoder can train."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for name, module in decoder.named_modules():
        if isinstance(module, Linear):
            out[f"{name}.weight"] = (module, "matrix")
            if module.bias is not None:
                out[f"{name}.bias"] = (module, "bias")
        elif isinstance(module, RMSNorm) and name:
            out[f"{_norm_file_name(decoder, name)}.weight"] = (module, "norm")
    return out


def _norm_file_name(decoder: Decoder, name: str) -> str:
    """The file's name of the norm module at `name`: two keep a fixed module name whatever the
    architecture calls them (arch.py: lfm2's final norm is token_embd_norm; gpt-oss and the
    qwen3.5/qwen3-next families store their pre-FFN norm as post_attention_norm)."""
    arch = decoder.cfg.arch
    if name == "output_norm":
        return arch.output_norm
    layer, _, part = name.rpartition(".")
    if part == "ffn_norm" and layer.startswith("blk."):
        return f"{layer}.{arch.ffn_norm_tensor}"
    return name


def master_dtype(storage: str, master_weights: str) -> torch.dtype:
    """The Parameter's dtype for a matrix stored as `storage` under [training].master_weights."""
    if storage == "F32" or master_weights in ("auto", "f32"):
        return torch.float32
    return STORAGE[storage]


def attach(
    decoder: Decoder, names: list[tuple[str, str]], master_weights: str
) -> list[TrainedTensor]:
    """Make each (name, storage type) trainable; returns them in the given order."""
    found = candidates(decoder)
    out = []
    for name, storage in names:
        module, kind = found[name]
        if kind == "matrix":
            dtype = master_dtype(storage, master_weights)
            # NOTE: a float32 tensor dequantizes to a view of the read-only memory map: clone
            dense = module.frozen.dequantize(torch.float32).to(dtype)
            param = nn.Parameter(dense.clone(memory_format=torch.contiguous_format))
            module.train_weight(param, STORAGE[storage])
            decoder.base_trained = True
        else:
            param = module.bias if kind == "bias" else module.weight
            param.data = param.data.clone()  # own memory, not the file's read-only map
            param.requires_grad_(True)
        out.append(TrainedTensor(name, param, storage, kind))
    if decoder.base_trained:
        decoder.token_embd.cache.clear()  # dense copies of replaced weights would go stale
    return out
