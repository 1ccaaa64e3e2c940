"""The run file: one pydantic model per TOML section, the rules between sections, the schema.

    cfg = load_run("run.toml", model=args.model, device=args.device)
    cfg.training.lr, cfg.grpo.group_size, cfg.lora.targets, ...

Every problem of a file is raised at once as a ConfigError, one `run.toml: [section].key =
value: rule` per line. This package never imports torch, so validation and `config-schema`
take a fraction of a second.
"""

from retrograd.config.document import RunConfig
from retrograd.config.load import load_run, parse_toml, validate_run
from retrograd.config.schema import json_schema
from retrograd.config.selectors import Selection, select_tensors

__all__ = [
    "RunConfig",
    "Selection",
    "json_schema",
    "load_run",
    "parse_toml",
    "select_tensors",
    "validate_run",
]
