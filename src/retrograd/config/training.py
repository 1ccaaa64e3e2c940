"""[training] and [optimizer.muon] / [optimizer.gefen]: how the weights are updated.

The memory knobs are described here; how they interact with each algorithm (the pinned
gradient accumulation of rollout algorithms, fan-out against group_size) is in `rules_train.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, field_validator

from retrograd.config.fields import Section, key, optional_key

TrainableMode = Literal["lora", "full", "partial", "hybrid"]
Optimizer = Literal["adamw", "sgd", "muon", "gefen"]
FANOUT_WORDS = ("auto", "off", "max")


def _fanout(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError('must be "auto", "off", "max" or an integer of at least 2')
    if isinstance(value, str) and value not in FANOUT_WORDS:
        raise ValueError('must be "auto", "off", "max" or an integer of at least 2')
    if isinstance(value, int) and value < 2:
        raise ValueError('an integer fan-out must be at least 2; use "off" to disable packing')
    return value


Fanout = Annotated[
    str | int,
    BeforeValidator(_fanout, json_schema_input_type=Literal["auto", "off", "max"] | int),
]


class TrainingSection(Section):
    """[training]: what is trained, with which optimizer, and how memory is traded for speed."""

    trainable: TrainableMode = key(
        "lora",
        "What is trained: lora (an adapter), full (every float base tensor), partial (the base "
        "tensors [trainable] selects) or hybrid (an adapter plus norms and biases).",
    )
    optimizer: Optimizer = key(
        "adamw",
        "adamw, sgd, muon or gefen. muon and gefen update f32 weights only and read their own "
        "[optimizer.<name>] table.",
    )
    lr: float = key(0.0001, "Learning rate.", gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = key(
        "constant", "constant, or linear / cosine decay to zero by the end of the run."
    )
    warmup_steps: int = key(0, "Optimizer steps of linear warm-up.", ge=0)
    weight_decay: float = key(0.0, "Decoupled weight decay, from 0 to 1.", ge=0, le=1)
    max_grad_norm: float = key(1.0, "Clip the global gradient norm to this value.", gt=0)
    epochs: int = key(
        1,
        "Passes over the SFT, offline distillation or preference data. Rollout algorithms "
        "count their own updates.",
        ge=1,
    )
    ctx: int = key(128, "Context length in tokens.", ge=1)
    micro_batch: int = key(
        32, "Tokens in one forward and backward pass: the main memory knob.", ge=1
    )
    gradient_accumulation: int = key(
        1,
        "Passes per optimizer step; micro_batch x gradient_accumulation must divide ctx. "
        "Rollout and preference runs fix it to ctx / micro_batch: leave it out there.",
        ge=1,
    )
    threads: int | None = optional_key(
        "CPU threads; leave it out to choose automatically. 0 is refused.", ge=1
    )
    generation_concurrency: int | None = optional_key(
        "Answers generated at once (grpo, agent_grpo, distill); lower it to save memory. "
        "Derived when left out.",
        ge=1,
    )
    generation_batch: int | None = optional_key(
        "Generation batch size: prompt positions per prefill pass (grpo, ppo, agent_grpo, "
        "distill). Derived when left out: the largest keeping the output logits within 64 MiB, "
        "at most ctx and 512, at least generation_concurrency.",
        ge=1,
    )
    shared_prefix_fanout: Fanout = key(
        "auto",
        "Packing of sequences that share a prompt (GRPO answers, preference pairs): auto, off, "
        "max, or an exact integer of at least 2.",
    )
    fast_sampling_context: bool = key(
        True,
        "Generate with a kv_dtype KV cache and the fused attention kernel; false samples "
        "bit-exactly (an f32 cache).",
    )
    kv_dtype: Literal["f16", "f32"] = key(
        "f16",
        "KV cache type, f16 or f32, of generation and of a window's earlier training passes; "
        "f32 where the device needs it.",
    )
    rollout_backend: Literal["in_process", "llama_cpp"] = key(
        "in_process",
        "What samples the answers of ppo and grpo: in_process (our sampler on the training "
        "model's weights) or llama_cpp (llama.cpp's batched decoding of the GGUF "
        "as stored, the adapter applied after each update; needs llama-cpp-python and "
        "trainable = lora).",
    )
    rollout_is_cap: float = key(
        2.0,
        "Cap C of the truncated importance weights min(pi_old / pi_sampler, C) that correct "
        "each token's surrogate term when the sampler is not the trainer (rollout_backend = "
        "llama_cpp); at least 1.",
        ge=1,
    )
    gradient_checkpointing: bool = key(False, "Recompute activations to save memory.")
    checkpoint_every_n_layers: int = key(
        4, "Layers between stored activations when gradient checkpointing.", ge=1
    )
    checkpoint_dtype: Literal["f32", "f16", "bf16"] = key(
        "f32", "Type of stored activations; other than f32 needs gradient_checkpointing."
    )
    chunked_cross_entropy: bool = key(
        True, "Compute the loss in vocabulary tiles to save memory (sft and rollout algorithms)."
    )
    chunked_ce_tiles: int = key(8, "Number of vocabulary tiles.", ge=1)
    chunked_ce_seq_chunk: int = key(
        512, "Tokens per tile chunk; 0 computes all tokens at once.", ge=0
    )
    master_weights: Literal["auto", "f32", "off"] = key(
        "auto",
        "Keep an f32 master copy of f16/bf16 base weights: auto, f32 or off. Costs 4 bytes per "
        "trained parameter.",
    )
    require_gpu_resident: bool = key(
        False, "Fail when any training operation would fall back to the CPU."
    )
    parallel: Literal["none", "ddp", "fsdp2"] | None = optional_key(
        "Under torchrun: ddp (every rank holds the model, the ranks share each step's passes "
        "and sum their gradients) or fsdp2 (the frozen weights sharded too); none runs one "
        "process and is refused with several ranks. Left out: ddp with several ranks, none "
        "alone (docs/distributed.md)."
    )
    dist_timeout_seconds: int = key(
        1800,
        "Seconds a rank waits in a collective for the others before the run fails (a rank "
        "that died stops the rest within it).",
        ge=1,
    )
    max_gpu_duty_cycle: float = key(
        1.0, "Largest share of wall time spent with work on the GPU, in (0, 1].", gt=0, le=1
    )

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        if value == 0 and not isinstance(value, bool):
            raise ValueError("0 is refused; leave threads out to choose automatically")
        return value


class MuonSection(Section):
    """[optimizer.muon]: Muon for 2-D hidden matrices, AdamW for everything else."""

    momentum: float = key(0.95, "Momentum coefficient, in [0, 1).", ge=0, lt=1)
    nesterov: bool = key(True, "Use Nesterov momentum.")
    ns_steps: int = key(5, "Newton-Schulz iterations, from 1 to 32.", ge=1, le=32)
    ns_epsilon: float = key(1e-7, "Epsilon of the Newton-Schulz normalisation.", gt=0)
    fallback_learning_rate: float = key(
        0.001,
        "Absolute AdamW learning rate of the parameters Muon does not handle (LoRA factors, "
        "vectors, embeddings).",
        gt=0,
    )


class GefenSection(Section):
    """[optimizer.gefen]: experimental, block-wise second moments for less optimizer memory."""

    variant: Literal["shared_v", "quantized_m"] = key(
        "shared_v",
        "shared_v, or quantized_m (8-bit first moment). Checkpoints of one variant do not "
        "resume with the other.",
    )
    block_size: int = key(1024, "Elements per block: a power of two, at most 2^30.", ge=1, le=2**30)
    min_numel: int = key(4096, "Parameters with fewer elements use AdamW.", ge=0)
    beta1: float = key(0.9, "First-moment coefficient, in [0, 1).", ge=0, lt=1)
    beta2: float = key(0.999, "Second-moment coefficient, in [0, 1).", ge=0, lt=1)
    eps: float = key(1e-8, "Epsilon of the update.", gt=0)
    codebook: Literal["uniform"] = key("uniform", "Only uniform is accepted.")
    codebook_levels: Literal[256] = key(256, "Only 256 is accepted.")
    partition: Literal["fixed"] = key("fixed", "Only fixed is accepted.")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value


class OptimizerSection(Section):
    """[optimizer]: holds only the table of the optimizer training.optimizer names."""

    muon: MuonSection | None = optional_key("Settings of Muon; only with optimizer = muon.")
    gefen: GefenSection | None = optional_key("Settings of Gefen; only with optimizer = gefen.")
