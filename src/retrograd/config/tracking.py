"""Sections that watch a run rather than shape it: [evaluation], [checkpoint], [metrics], [observe].

Which algorithm may use which of them, and the checkpoint modes that need [evaluation], are
cross-section rules (`rules_train.py`).
"""

from __future__ import annotations

from typing import Literal

from retrograd.config.fields import FilePath, Section, key, optional_key

CheckpointMode = Literal["steps", "best_eval", "steps_and_best_eval"]


class EvaluationSection(Section):
    """[evaluation]: a held-out file, scored during training, that can stop it early."""

    data: FilePath = key(
        description="Held-out file in the training data's format (prompts, pairs, scenarios...)."
    )
    every_iterations: int = key(
        1, "Evaluate every N epochs (SFT, preference) or updates (rollout algorithms).", ge=1
    )
    max_examples: int | None = optional_key(
        "Rollout algorithms only: most prompts evaluated, spread evenly across the file. "
        "All when left out.",
        ge=1,
    )
    patience: int | None = optional_key(
        "Stop after this many evaluations in a row without improvement. Never when left out.",
        ge=1,
    )
    min_delta: float = key(0.0, "Smallest change that counts as an improvement.", ge=0)


class CheckpointSection(Section):
    """[checkpoint]: resumable .state directories written during the run."""

    directory: FilePath = key(description="Directory the checkpoints are written to.")
    mode: CheckpointMode = key(
        description="steps (every every_steps optimizer steps), best_eval (the best evaluation "
        "only) or steps_and_best_eval. The last two need [evaluation]."
    )
    every_steps: int | None = optional_key(
        "Optimizer steps between checkpoints. Required by steps modes, refused by best_eval.",
        ge=1,
    )
    resume_from: FilePath | None = optional_key(
        "Checkpoint to resume from, as `retrograd train --resume`."
    )


class MetricsSection(Section):
    """[metrics]: where training curves go besides the terminal."""

    tensorboard_dir: FilePath | None = optional_key("TensorBoard log directory.")
    wandb_export_dir: FilePath | None = optional_key(
        "Offline Weights & Biases export, uploaded later with `wandb sync`."
    )


class ObserveSection(Section):
    """[observe]: a browsable record of rollouts (ppo, grpo and agent_grpo only)."""

    directory: FilePath = key(description="Output directory; created when missing.")
    every: int = key(1, "Record the rollout texts every N updates.", ge=1)
    max_text_chars: int = key(0, "Cut recorded texts to N characters; 0 keeps them whole.", ge=0)
    enabled: bool = key(True, "false keeps the table in the file but exports nothing.")
