"""RunDocument: the whole run file's schema, one typed attribute per TOML section.

The config every reader returns and a Python caller builds is its subclass RunConfig
(load.py), which adds the loader's doors: `load_run` / `validate_run` / `RunConfig(...)`
apply the cross-section rules and the command-line overrides; `RunDocument.model_validate`
alone checks each section but not the rules between them.
"""

from __future__ import annotations

from retrograd.config.agent import AgentSection
from retrograd.config.algorithms import (
    DistillSection,
    GrpoSection,
    PpoSection,
    PreferenceSection,
    SftSection,
)
from retrograd.config.core import (
    LoraSection,
    ModelSection,
    OutputSection,
    ReferenceSection,
    RunSection,
    TrainableSection,
)
from retrograd.config.fields import Section, key, optional_key
from retrograd.config.report import table_root
from retrograd.config.tracking import (
    CheckpointSection,
    EvaluationSection,
    MetricsSection,
    ObserveSection,
)
from retrograd.config.training import OptimizerSection, TrainingSection

# The section each algorithm reads; the other algorithm sections are refused.
ALGORITHM_SECTIONS = {
    "sft": "sft",
    "ppo": "ppo",
    "grpo": "grpo",
    "distill": "distill",
    "preference": "preference",
    "agent_grpo": "agent",
}
# Algorithms that record rollouts for [observe].
OBSERVE_ALGORITHMS = ("ppo", "grpo", "agent_grpo")
# Algorithms whose optimizer window is a whole context: gradient_accumulation is pinned.
PINNED_ACCUMULATION = ("ppo", "grpo", "agent_grpo", "preference")


@table_root
class RunDocument(Section):
    """A run file: [run] chooses the algorithm, and with it the section that describes it."""

    run: RunSection = key(description="The algorithm of the run.")
    model: ModelSection = key(ModelSection(), "The base model and the device.")
    output: OutputSection = key(description="Where the trained result is written.")
    lora: LoraSection | None = optional_key(
        "The adapter. Required when training.trainable is lora (the default) or hybrid; "
        "refused otherwise."
    )
    trainable: TrainableSection | None = optional_key(
        "Base tensors trained with training.trainable = partial or hybrid; refused otherwise."
    )
    training: TrainingSection = key(TrainingSection(), "Optimizer, schedule and memory knobs.")
    optimizer: OptimizerSection = key(
        OptimizerSection(), "Settings of the muon or gefen optimizer."
    )
    evaluation: EvaluationSection | None = optional_key("Held-out evaluation and early stop.")
    checkpoint: CheckpointSection | None = optional_key("Resumable checkpoints.")
    metrics: MetricsSection | None = optional_key("TensorBoard and W&B export.")
    observe: ObserveSection | None = optional_key(
        "Rollout records for the viewer (ppo, grpo and agent_grpo)."
    )
    reference: ReferenceSection | None = optional_key(
        "The frozen reference model of a KL penalty or a dpo/ipo loss."
    )
    sft: SftSection | None = optional_key("Supervised fine-tuning (run.algorithm = sft).")
    ppo: PpoSection | None = optional_key("PPO (run.algorithm = ppo).")
    grpo: GrpoSection | None = optional_key("GRPO (run.algorithm = grpo).")
    distill: DistillSection | None = optional_key(
        "Distillation from a teacher (run.algorithm = distill)."
    )
    preference: PreferenceSection | None = optional_key(
        "Preference optimisation (run.algorithm = preference)."
    )
    agent: AgentSection | None = optional_key("Agentic GRPO (run.algorithm = agent_grpo).")

    @property
    def algorithm(self) -> str:
        return self.run.algorithm

    @property
    def algorithm_section(self) -> Section:
        """The section of the run's algorithm ([sft], [grpo], [agent], ...)."""
        return getattr(self, ALGORITHM_SECTIONS[self.run.algorithm])


SECTION_NAMES = tuple(RunDocument.model_fields)
