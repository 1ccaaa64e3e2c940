"""Building blocks shared by every section model: the base class and the field types.

A section is a frozen, strict pydantic model that forbids unknown keys. Strict means TOML's own
types are kept: `epochs = 1.0` is not an integer and `verbose = "yes"` is not a boolean. Paths are
the one exception; they arrive as strings and resolve against the run file's directory through
the validation context (`{"base_dir": ...}`); without a context they stay as written.
Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
)

from retrograd.config.report import construction_error


class Section(BaseModel):
    """Base of every TOML table: unknown keys refused, TOML types kept, values immutable,
    floats finite (TOML writes nan and inf; no key means them, and JSON cannot carry them)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        """Built in Python: the section's own checks, each problem named as the run file
        names its key (`[grpo].group_size = 1: must be at least 2`), raised as ConfigError."""
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise construction_error(type(self), error) from None

    # NOTE: pydantic calls a model's own __init__ when it validates a nested table unless the
    # __init__ carries this mark (BaseModel's does). Marked, loading a file collects pydantic's
    # errors of every section as before, and only a call in Python comes through here.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def is_set(self, key: str) -> bool:
        """True when the run file wrote `key` itself rather than leaving the default."""
        return key in self.model_fields_set


def _resolve_path(value: Path, info: ValidationInfo) -> Path:
    if str(value) in ("", "."):
        raise ValueError("must not be empty")
    base = (info.context or {}).get("base_dir")
    if base is not None and not value.is_absolute():
        return Path(base) / value
    return value


# A path written in the run file: relative paths resolve against the file's directory.
FilePath = Annotated[Path, Strict(False), AfterValidator(_resolve_path)]


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# A path, or a list of paths (mcp_config, tool definition files).
FilePaths = Annotated[
    list[FilePath], BeforeValidator(_one_or_many, json_schema_input_type=str | list[str])
]

# A string or a list of strings, kept as a list (selectors, targets).
Names = Annotated[list[str], BeforeValidator(_one_or_many, json_schema_input_type=str | list[str])]

# An argument list run without a shell: reward programs, command judges, MCP servers. Relative
# program paths are NOT rewritten: they resolve against the working directory, as the original.
Argv = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]

Text = Annotated[str, Field(min_length=1)]


def key(default: Any = ..., description: str = "", **constraints: Any) -> Any:
    """A field with its description; `...` marks a required key."""
    return Field(default, description=description, **constraints)


def optional_key(description: str, **constraints: Any) -> Any:
    """A key whose absence means "none" or "derived"; the description says which."""
    return Field(None, description=description, **constraints)


# Names a chat template reserves for itself; template_variables may not set them.
RESERVED_TEMPLATE_VARIABLES = (
    "messages",
    "tools",
    "bos_token",
    "eos_token",
    "add_generation_prompt",
)


def _template_variables(value: dict[str, Any]) -> dict[str, Any]:
    taken = [name for name in value if name in RESERVED_TEMPLATE_VARIABLES]
    if taken:
        raise ValueError(
            f"{', '.join(taken)} is set by Retrograd itself; choose another variable name"
        )
    return value


TemplateVariables = Annotated[dict[str, Any], AfterValidator(_template_variables)]
