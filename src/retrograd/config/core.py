"""Sections every run shares: [run], [model], [output], [lora], [trainable], [reference].

Each model checks its own keys (types, ranges, syntax). Rules that read two sections, such as
"[lora] is refused when training.trainable is full", live in `rules_*.py`; the tensor names a
[trainable] selector must match are checked by `selectors.py` once the model is open.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from retrograd.config.fields import FilePath, Names, Section, key, optional_key

Algorithm = Literal["sft", "ppo", "grpo", "distill", "preference", "agent_grpo"]
Device = Literal["auto", "cpu", "gpu"]
OutputKind = Literal["adapter", "trainable", "model"]

# LoRA target aliases and the GGUF projection each stands for.
LORA_ALIASES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "qkv": "attn_qkv",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
    "ffn_gate": "ffn_gate",
}
PROJECTIONS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_qkv",
    "ffn_up",
    "ffn_down",
    "ffn_gate",
)
DEFAULT_TARGETS = ["q", "k", "v", "o", "ffn_up", "ffn_down", "ffn_gate"]
MODULE_GROUPS = ("attn", "ffn")

_LAYERS = re.compile(r"^(all|last:[1-9][0-9]*|[0-9]+\.\.[0-9]+)$")


def is_tensor_pattern(name: str) -> bool:
    """A pattern names tensors (`blk.*.attn_q.weight`); an alias is one bare word."""
    return "." in name or "*" in name or "?" in name or "[" in name


class RunSection(Section):
    """[run]: which algorithm the file describes."""

    algorithm: Algorithm = key(
        description="Training algorithm; it selects the section that describes it "
        "([sft], [ppo], [grpo], [distill], [preference], or [agent] for agent_grpo)."
    )
    verbose: bool = key(False, "Log more while the run works.")


class ModelSection(Section):
    """[model]: the base GGUF and the device it runs on."""

    path: FilePath | None = optional_key(
        "Base model GGUF. Required unless given on the command line with --model."
    )
    device: Device = key(
        "auto", "auto uses a GPU when one is present, else the CPU; gpu fails without one."
    )


class OutputSection(Section):
    """[output]: where the trained result goes, and in what form."""

    path: FilePath = key(description="File the result is written to.")
    kind: OutputKind | None = optional_key(
        "adapter (a LoRA GGUF llama.cpp loads; lora only), trainable (the trained base tensors, "
        "plus the adapter for hybrid; full, partial, hybrid) or model (a standalone GGUF; full "
        "and partial). Default: adapter for lora, trainable otherwise."
    )


class LoraSection(Section):
    """[lora]: the adapter, for training.trainable = lora or hybrid."""

    rank: int = key(8, "Adapter rank.", ge=1, le=4096)
    alpha: float = key(16.0, "Scale numerator; the adapter is scaled by alpha / rank.", gt=0)
    seed: int = key(42, "Seed of the adapter initialisation and of the SFT shuffle.", ge=0)
    targets: Names = key(
        DEFAULT_TARGETS,
        "Tensors that get an adapter: aliases (q, k, v, o, qkv, ffn_up, ffn_down, ffn_gate), "
        "GGUF tensor patterns such as blk.*.attn_q.weight, or auto for the architecture's own "
        "choice. `retrograd inspect` lists the candidates.",
        min_length=1,
    )
    dtype: Literal["f16", "f32"] = key("f16", "Storage type of the adapter: f16 or f32.")
    init_adapter: FilePath | None = optional_key(
        "Start from the weights of an existing adapter GGUF (no optimizer state). The adapter "
        "fixes rank, alpha and targets, so the other keys and --resume are refused with it."
    )

    @field_validator("targets")
    @classmethod
    def _targets(cls, targets: list[str]) -> list[str]:
        if "auto" in targets and len(targets) > 1:
            raise ValueError("auto stands alone; list aliases or patterns instead")
        for name in targets:
            if name != "auto" and name not in LORA_ALIASES and name not in PROJECTIONS:
                if not is_tensor_pattern(name):
                    raise ValueError(
                        f'"{name}" is neither an alias ({", ".join(LORA_ALIASES)}) nor a '
                        "tensor pattern such as blk.*.attn_q.weight"
                    )
        return targets


class TrainableSection(Section):
    """[trainable]: base tensors trained by training.trainable = partial or hybrid."""

    layers: str = key(
        "all", "Layers to train: all, last:<n>, or <first>..<last> (inclusive, from 0)."
    )
    modules: Names | None = optional_key(
        "Projections to train: attn, ffn, one projection such as attn_q, a GGUF tensor pattern, "
        "or a list of these. Not allowed for hybrid."
    )
    norms: bool = key(False, "Train the normalisation weights of the selected layers.")
    biases: bool = key(
        False,
        "Train the biases of the selected modules (for hybrid: of every module in the "
        "selected layers).",
    )
    output_head: bool = key(
        False,
        "Train the output projection (and its bias). Impossible when the model ties it to the "
        "input embedding. Not allowed for hybrid.",
    )

    @field_validator("layers")
    @classmethod
    def _layers(cls, layers: str) -> str:
        if not _LAYERS.match(layers):
            raise ValueError('must be "all", "last:<n>" or "<first>..<last>"')
        if ".." in layers:
            first, last = (int(part) for part in layers.split(".."))
            if first > last:
                raise ValueError(f"first layer {first} is after last layer {last}")
        return layers

    @field_validator("modules")
    @classmethod
    def _modules(cls, modules: list[str] | None) -> list[str] | None:
        for name in modules or ():
            if name not in MODULE_GROUPS and name not in PROJECTIONS:
                if not is_tensor_pattern(name):
                    raise ValueError(
                        f'"{name}" is not attn, ffn, a projection ({", ".join(PROJECTIONS)}) '
                        "or a tensor pattern"
                    )
        return modules

    def layer_range(self, n_layers: int) -> range:
        """The selected layer indices for a model with `n_layers` blocks (may be empty)."""
        if self.layers == "all":
            return range(n_layers)
        if self.layers.startswith("last:"):
            return range(max(0, n_layers - int(self.layers[5:])), n_layers)
        first, last = (int(part) for part in self.layers.split(".."))
        return range(first, last + 1)


class ReferenceSection(Section):
    """[reference]: the frozen model a KL penalty or a dpo/ipo loss compares against."""

    model: FilePath = key(
        description="Reference GGUF. It must use the same tokenizer as the trained model."
    )
    ctx: int | None = optional_key(
        "Context length of the reference; at least training.ctx, which is the default.", ge=1
    )
