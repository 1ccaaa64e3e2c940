"""The run file: one pydantic model per TOML section, the rules between sections, the schema.

    cfg = load_run("run.toml", model=args.model, device=args.device)
    cfg.training.lr, cfg.grpo.group_size, cfg.lora.targets, ...

Every problem of a file is raised at once as a ConfigError, one `run.toml: [section].key =
value: rule` per line. The section classes exported here are the Python API's configuration
(docs/python.md): each is its TOML table, checked the same way, and a RunConfig built from
them is checked as a loaded file is (config/load.py); `RunConfig.from_toml` and
`RunConfig.to_toml` read and write run files. This package never imports torch, so
validation and `config-schema` take a fraction of a second.
"""

from retrograd.config.agent import (
    AgentSection,
    CollectApi,
    ContainerEnvironment,
    ContainerLimits,
    ContainerPool,
    HttpEnvironment,
    LocalEnvironment,
    McpServer,
    ScenarioGeneration,
    ToolDef,
    ToolsConfig,
    ToolsetDef,
)
from retrograd.config.algorithms import (
    DistillOffline,
    DistillOnPolicy,
    DynamicSampling,
    GrpoSampling,
    GrpoSection,
    KlSchedule,
    OverlongPenalty,
    PpoCritic,
    PpoSampling,
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
from retrograd.config.judge import (
    CommandJudge,
    JudgeCompaction,
    JudgeContext,
    JudgeStrategy,
    RulerJudge,
)
from retrograd.config.load import (
    RunConfig,
    build_run,
    check_sections,
    load_run,
    parse_toml,
    validate_run,
)
from retrograd.config.schema import json_schema
from retrograd.config.selectors import Selection, select_tensors
from retrograd.config.tracking import (
    CheckpointSection,
    EvaluationSection,
    MetricsSection,
    ObserveSection,
)
from retrograd.config.training import (
    GefenSection,
    MuonSection,
    OptimizerSection,
    TrainingSection,
)

# RunConfig and every table of a run file: the configuration classes of the Python API, also
# at the package root (tests/unit/config/test_config_python.py holds them to the run file's
# tables).
CLASSES = (
    RunConfig,
    RunSection,
    ModelSection,
    OutputSection,
    LoraSection,
    TrainableSection,
    TrainingSection,
    OptimizerSection,
    MuonSection,
    GefenSection,
    EvaluationSection,
    CheckpointSection,
    MetricsSection,
    ObserveSection,
    ReferenceSection,
    SftSection,
    PpoSection,
    PpoCritic,
    PpoSampling,
    GrpoSection,
    GrpoSampling,
    OverlongPenalty,
    KlSchedule,
    DynamicSampling,
    CommandJudge,
    RulerJudge,
    JudgeStrategy,
    JudgeContext,
    JudgeCompaction,
    DistillOnPolicy,
    DistillOffline,
    PreferenceSection,
    AgentSection,
    McpServer,
    ContainerEnvironment,
    LocalEnvironment,
    HttpEnvironment,
    ToolsConfig,
    ToolDef,
    ToolsetDef,
    ContainerLimits,
    ContainerPool,
    CollectApi,
    ScenarioGeneration,
)

__all__ = [
    *(cls.__name__ for cls in CLASSES),
    "Selection",
    "build_run",
    "check_sections",
    "json_schema",
    "load_run",
    "parse_toml",
    "select_tensors",
    "validate_run",
]
