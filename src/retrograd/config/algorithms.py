"""Algorithm sections: [sft], [ppo], [grpo], [distill] and [preference] ([agent] is in agent.py).

Each model checks its keys one at a time. Rules between keys (grpo's clip range order, the keys
a preference loss reads) are in `rules_algorithms.py`, so that every broken rule of a file is
reported at once; distill's two modes are two models, chosen by `mode`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Discriminator, Tag, field_validator

from retrograd.config.fields import (
    Argv,
    FilePath,
    Section,
    TemplateVariables,
    key,
    optional_key,
)
from retrograd.config.judge import Judge

RewardMode = Literal["persistent", "oneshot"]
PromptOrder = Literal["sequential", "shuffled"]
ISLevel = Literal["token", "sequence"]


class SftSection(Section):
    """[sft]: supervised fine-tuning on chat JSONL or plain text."""

    data: FilePath = key(description="Training file: chat JSONL or plain text.")
    data_format: Literal["text", "jsonl"] | None = optional_key(
        "text or jsonl; inferred from the extension (or the first line) when left out."
    )
    shuffle: bool = key(True, "Shuffle the rows at each epoch, seeded from lora.seed.")
    template_variables: TemplateVariables = key(
        {},
        "Variables passed to the chat template, e.g. { enable_thinking = false }. Use the ones "
        "of the agentic run this warm-starts, or it teaches a format that is not sampled.",
    )


class PpoSampling(Section):
    """[ppo.sampling]: how PPO answers are sampled (every key required)."""

    temperature: float = key(description="Sampling temperature.", ge=0)
    top_p: float = key(description="Nucleus sampling mass, in (0, 1].", gt=0, le=1)
    max_new_tokens: int = key(description="Most tokens per answer.", ge=1)
    seed: int = key(description="Sampling seed.", ge=0)


class GrpoSampling(Section):
    """[grpo.sampling] / [distill.sampling]: temperature and top_p stay at 1.0, as the loss assumes."""

    temperature: float = key(
        description="Must be 1.0: the policy ratio assumes unmodified sampling."
    )
    top_p: float = key(description="Must be 1.0: the policy ratio assumes unmodified sampling.")
    max_new_tokens: int = key(description="Most tokens per answer.", ge=1)
    seed: int = key(description="Sampling seed.", ge=0)

    @field_validator("temperature", "top_p")
    @classmethod
    def _unmodified(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("must be 1.0 (the policy ratio and KL assume unmodified sampling)")
        return value


class PpoCritic(Section):
    """[ppo.critic]: the value head and GAE."""

    enabled: bool = key(True, "Use a value head and GAE advantages.")
    gamma: float = key(1.0, "Discount, in (0, 1].", gt=0, le=1)
    gae_lambda: float = key(0.95, "GAE lambda, in [0, 1].", ge=0, le=1)
    value_lr: float = key(0.01, "Learning rate of the value head.", gt=0)
    value_epochs: int = key(8, "Value head passes per update.", ge=1)
    feature_dtype: Literal["f32", "f16", "bf16"] = key(
        "f32", "Stored feature type: f32, or f16 / bf16 for half the host memory."
    )


class _RewardKeys(Section):
    # Required in a run file; the Python API may give reward functions instead (load.py).
    SUPPLIED_BY: ClassVar[dict[str, str]] = {"reward_command": "rewards"}

    prompts: FilePath = key(description="Chat JSONL prompts, each ending with a user message.")
    reward_command: Argv | None = optional_key(
        "Reward program, as an argument list; relative programs resolve against the working "
        "directory, not the run file."
    )
    reward_mode: RewardMode = key(
        "persistent", "persistent (one process for the run) or oneshot (one per batch)."
    )
    reward_timeout_seconds: float = key(300.0, "Deadline for one batch of rewards.", gt=0)


class PpoSection(_RewardKeys):
    """[ppo]: PPO with a reward program and an optional critic."""

    updates: int = key(description="Rollout batches (updates) in the run.", ge=1)
    rollout_batch_size: int = key(description="Answers per update.", ge=1)
    ppo_epochs: int = key(description="Optimizer passes over each batch.", ge=1)
    clip_range: float = key(description="Clip range, in (0, 1); 0.2 is usual.", gt=0, lt=1)
    kl_coefficient: float = key(
        description="Penalty toward the policy that sampled the batch; at least 0.", ge=0
    )
    reference_kl_coefficient: float = key(
        0.0,
        "Penalty toward the reference (the base model without the adapter, or "
        "[reference].model) on every pass, as GRPO's kl_coefficient: it holds the text the "
        "reward does not score near the reference's; at least 0, 0 turns it off.",
        ge=0,
    )
    critic: PpoCritic = key(PpoCritic(), "Value head settings.")
    sampling: PpoSampling = key(description="Sampling settings (all keys required).")


class OverlongPenalty(Section):
    """[grpo.overlong_penalty]: a penalty rising over the last tokens of the budget."""

    buffer_tokens: int = key(
        description="Tokens at the end of max_new_tokens over which the penalty rises.", ge=1
    )
    max_penalty: float = key(description="Penalty at the full budget; above 0.", gt=0)


class KlSchedule(Section):
    """[grpo.kl_schedule]: KL warm-up and an optional adaptive target."""

    warmup_updates: int = key(0, "Updates over which the KL coefficient ramps up linearly.", ge=0)
    target: float | None = optional_key(
        "KL the adaptive controller steers toward; fixed coefficient when left out.", gt=0
    )


class DynamicSampling(Section):
    """[grpo.dynamic_sampling]: resample prompts whose group carries no signal."""

    max_resample_factor: int = key(
        description="Most prompts sampled per update, as a multiple of prompts_per_update "
        "(at least 2).",
        ge=2,
    )


def _baseline(value: Any) -> Any:
    return "leave_one_out" if value == "rloo" else value


class GrpoSection(_RewardKeys):
    """[grpo]: group-relative policy optimisation with a reward program and an optional judge."""

    updates: int = key(description="Updates in the run.", ge=1)
    prompts_per_update: int = key(description="Prompts per update.", ge=1)
    group_size: int = key(description="Answers per prompt, from 2 to 256.", ge=2, le=256)
    grpo_epochs: int = key(description="Optimizer passes per update.", ge=1)
    clip_range_low: float = key(description="Lower clip, in (0, 1), e.g. 0.2.", gt=0, lt=1)
    clip_range_high: float = key(
        description="Upper clip, at least clip_range_low, e.g. 0.28.", gt=0
    )
    importance_sampling_level: ISLevel = key(
        "token", "token, or sequence (GSPO: one length-normalised ratio per answer)."
    )
    kl_coefficient: float = key(description="KL penalty toward the reference; 0 disables it.", ge=0)
    mask_truncated: bool = key(False, "Leave answers cut at max_new_tokens out of the loss.")
    baseline: Annotated[
        Literal["mean", "leave_one_out"],
        BeforeValidator(_baseline, json_schema_input_type=Literal["mean", "leave_one_out", "rloo"]),
    ] = key("mean", "Group baseline: mean, or leave_one_out (alias rloo).")
    prompt_order: PromptOrder = key("sequential", "sequential or shuffled.")
    max_stalled_updates: int = key(
        25, "Stop after this many updates in a row without signal; 0 never stops.", ge=0
    )
    judge_weight: float | None = optional_key(
        "Weight of the judge's verdict in the reward; required with [grpo.judge].", ge=0
    )
    judge_failure: Literal["drop_group", "fail"] = key(
        "drop_group", "With a judge: drop the group, or fail the run, when the judge fails."
    )
    max_judge_dropped_fraction: float = key(
        0.5, "With a judge: largest share of groups an update may lose.", ge=0, le=1
    )
    sampling: GrpoSampling = key(description="Sampling settings (all keys required).")
    overlong_penalty: OverlongPenalty | None = optional_key(
        "Penalise answers that run into the end of the token budget."
    )
    kl_schedule: KlSchedule | None = optional_key(
        "KL warm-up and adaptive target; needs kl_coefficient > 0."
    )
    dynamic_sampling: DynamicSampling | None = optional_key(
        "Replace groups without signal by fresh prompts."
    )
    judge: Judge | None = optional_key("A command or LLM judge adding a verdict to the reward.")


class _DistillCommon(Section):
    teacher_path: FilePath = key(description="Teacher GGUF; it must use the student's tokenizer.")


class DistillOnPolicy(_DistillCommon):
    """[distill] with mode = on_policy: the student samples, the teacher scores every token."""

    mode: Literal["on_policy"] = key("on_policy", "on_policy or topk_offline.")
    prompts: FilePath = key(description="Chat JSONL prompts.")
    updates: int = key(description="Updates in the run.", ge=1)
    prompts_per_update: int = key(description="Prompts per update.", ge=1)
    samples_per_prompt: int = key(1, "Answers per prompt, from 1 to 256.", ge=1, le=256)
    distill_epochs: int = key(1, "Optimizer passes per update.", ge=1)
    clip_range_low: float = key(0.2, "Lower clip; used only when distill_epochs > 1.", gt=0, lt=1)
    clip_range_high: float = key(
        0.28, "Upper clip, at least clip_range_low; used only when distill_epochs > 1.", gt=0
    )
    weight_clip: float = key(5.0, "Cap on one token's weight, in nats.", gt=0)
    kl_coefficient: float = key(0.0, "Extra KL penalty toward the reference.", ge=0)
    mask_truncated: bool = key(False, "Leave answers cut at max_new_tokens out of the loss.")
    prompt_order: PromptOrder = key("sequential", "sequential or shuffled.")
    sampling: GrpoSampling = key(description="As [grpo.sampling] (all keys required).")


class DistillOffline(_DistillCommon):
    """[distill] with mode = topk_offline: train on a teacher's stored top-k predictions."""

    mode: Literal["topk_offline"] = key(description="on_policy or topk_offline.")
    data: FilePath = key(description="Chat JSONL corpus.")
    sidecar: FilePath = key(description="The .topk file `retrograd distill-teacher` wrote.")
    offline_epochs: int = key(1, "Passes over the corpus.", ge=1)


def _distill_mode(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "on_policy" if not isinstance(value, DistillOffline) else "topk_offline"
    mode = value.get("mode", "on_policy")
    return mode if mode in ("on_policy", "topk_offline") else None


DistillSection = Annotated[
    Annotated[DistillOnPolicy, Tag("on_policy")] | Annotated[DistillOffline, Tag("topk_offline")],
    Discriminator(
        _distill_mode,
        custom_error_type="invalid_mode",
        custom_error_message="must be on_policy or topk_offline",
    ),
]
DISTILL_MODES = {"on_policy": DistillOnPolicy, "topk_offline": DistillOffline}

# Keys each preference loss reads beyond the common ones.
PREFERENCE_LOSS_KEYS = {
    "reference": ("dpo", "ipo"),
    "label_smoothing": ("dpo",),
    "gamma_beta_ratio": ("simpo",),
}


class PreferenceSection(Section):
    """[preference]: preference optimisation (dpo, ipo, simpo or orpo) on chosen/rejected pairs."""

    data: FilePath = key(description="Preference JSONL: prompt, chosen and rejected per line.")
    loss: Literal["dpo", "ipo", "simpo", "orpo"] = key("dpo", "dpo, ipo, simpo or orpo.")
    beta: float | None = optional_key(
        "Loss temperature: 0.1, or 2.0 for simpo. For orpo, the weight of the odds-ratio term.",
        gt=0,
    )
    reference: Literal["initial", "base"] | None = optional_key(
        "dpo and ipo: score against the initial policy (initial, the default) or the base model "
        "without adapter (base). Leave it out when a [reference] section names the model."
    )
    label_smoothing: float = key(0.0, "dpo only, in [0, 0.5).", ge=0, lt=0.5)
    gamma_beta_ratio: float = key(0.5, "simpo only: the target margin.", ge=0)
    shuffle: bool = key(True, "Shuffle the pairs at each epoch, seeded from lora.seed.")
    pairs_per_step: int | None = optional_key("Most pairs per optimizer step.", ge=1)
    logps_drop_warn: float = key(
        2.0, "Nats the chosen answers may lose, with the rejected ones, before a warning.", ge=0
    )

    @property
    def effective_beta(self) -> float:
        """beta, or the loss's default when the file leaves it out."""
        if self.beta is not None:
            return self.beta
        return 2.0 if self.loss == "simpo" else 0.1
