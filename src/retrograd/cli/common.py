"""Flags every command shares (--model, --device) and how they are described; the model
placeholder of commands that read a run file but load no model."""

from __future__ import annotations

import argparse
from pathlib import Path

DEVICE_HELP = "auto (a GPU if PyTorch sees one, else the CPU), cpu, or gpu (fail without one)"


def add_model_flag(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        metavar="MODEL.gguf",
        help="the GGUF model file (quantized or not)",
    )


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help=DEVICE_HELP)


def peek_run_file(config: str) -> dict | None:
    """The run file's TOML before it is validated, or None when it cannot be read or parsed
    (nested too deep included: parse_toml checks that before tomllib recurses), for load_run
    to report."""
    from retrograd.config.load import parse_toml
    from retrograd.errors import ConfigError

    try:
        return parse_toml(Path(config).read_text(encoding="utf-8"), config)
    except (OSError, UnicodeDecodeError, ConfigError):
        return None


def placeholder_model(config: str) -> str | None:
    """The run file needs a [model].path to validate; a command that never loads a model
    (tools list, judge eval) validates a file without one with a placeholder."""
    data = peek_run_file(config)
    if data is None:
        return None  # load_run reports it
    model = data.get("model")
    return None if isinstance(model, dict) and model.get("path") else "model.gguf"
