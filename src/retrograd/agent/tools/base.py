"""What every sandbox tool shares: the Tool interface, argument checks, the rendering of a
command's result, and the workspace path rule (formats.md §4.1).

A tool acts on the sandbox of its own trajectory through `Sandbox.exec` and on nothing else,
so the same code runs in a local temporary directory and in a container. Its observation is
tokenized into the trajectory and trained on: it must be a deterministic function of the
arguments and the workspace (no ids, host paths, pids or timings), and its wording is frozen.
A changed wording, description or schema is a new tool version, never an edit of `id@1`.
"""

from __future__ import annotations

import codecs
import copy
from abc import ABC, abstractmethod
from pathlib import PurePosixPath
from typing import Any

from retrograd.agent.types import ExecResult, Observation, Sandbox, ToolSpec

TRUNCATED = "[output truncated]"


class Tool(ABC):
    """One callable tool: `spec` is what the model sees, `call` what happens."""

    spec: ToolSpec

    @abstractmethod
    def call(self, sandbox: Sandbox, arguments: dict[str, Any]) -> Observation:
        """Run one call. A refused argument or a failed command is an error observation;
        raises EnvironmentFailure only when the sandbox or the tool itself is broken."""

    def presented(self, name: str, description: str | None) -> Tool:
        """This tool under another exposed name (and description); behaviour and schema stay."""
        clone = copy.copy(self)
        clone.spec = ToolSpec(name, description or self.spec.description, self.spec.input_schema)
        return clone


def object_schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


class Refused(Exception):
    """An argument the tool will not run with; its message is the observation."""


def string_arg(arguments: dict[str, Any], name: str, default: str | None = None) -> str:
    """A string argument; required unless a default is given."""
    if name not in arguments:
        if default is not None:
            return default
        raise Refused(f"missing required argument '{name}'")
    value = arguments[name]
    if not isinstance(value, str):
        raise Refused(f"argument '{name}' must be a string")
    return value


def string_list_arg(arguments: dict[str, Any], name: str) -> list[str]:
    """An optional list of strings; a wrong shape is refused, never silently dropped."""
    value = arguments.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Refused(f"argument '{name}' must be an array of strings")
    return value


def workspace_path(path: str) -> str:
    """`path` when it stays inside the workspace; absolute paths and `..` are refused.
    NOTE: a symlink inside the workspace can still point out of it; a container's own
    isolation is what bounds that, a local environment has none."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise Refused(f"path '{path}' is outside the workspace")
    return path


def decode(data: bytes, cut: bool = False) -> str:
    """UTF-8 text of a stream; when `cut`, a character split by the cap is left out."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=not cut)


def cap_marker(text: str, truncated: bool) -> str:
    """A payload the sandbox cut at its output cap, marked as such."""
    return text + "\n" + TRUNCATED if truncated else text


def render_exec(result: ExecResult) -> Observation:
    """A command's result as the model reads it, whichever tool ran it."""
    lines = []
    if result.timed_out:
        lines.append("command timed out and was killed")
    if result.exit_code is None:
        lines.append("exit code: killed by a signal")
    else:
        lines.append(f"exit code: {result.exit_code}")
    for label, stream in (("stdout", result.stdout), ("stderr", result.stderr)):
        text = decode(stream, result.truncated)
        if text.strip():
            lines.append(f"{label}:\n{text.rstrip()}")
    if result.truncated:
        lines.append(TRUNCATED)
    return Observation("".join(line + "\n" for line in lines), is_error=not result.ok)
