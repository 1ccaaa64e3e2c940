"""What every sandbox tool shares: the Tool interface, argument checks, the rendering of a
command's result, and the workspace path rule (formats.md §4.1).

A tool acts on the sandbox of its own trajectory through `Sandbox.exec` and on nothing else,
so the same code runs in a local temporary directory and in a container. Its observation is
tokenized into the trajectory and trained on: it must be a deterministic function of the
arguments and the workspace (no ids, host paths, pids or timings), and its wording is frozen.
A changed wording, description or schema is a new tool version, never an edit of `id@1`.

Whatever a model writes is refused here with an observation before it reaches `exec`: a
string that is not text (a lone surrogate), a NUL byte or more than ARG_LIMIT bytes where the
string becomes a command-line argument, a path out of the workspace (absolute, `..`, or through
a symlink, which the sandbox's shell resolves: `INSIDE`). Error observations repeat a
model-written string through `quoted`, so a 100,000-character path is not echoed whole.
"""

from __future__ import annotations

import codecs
import copy
from abc import ABC, abstractmethod
from pathlib import PurePosixPath
from typing import Any

from retrograd.agent.types import ExecResult, Observation, Sandbox, ToolSpec, quoted
from retrograd.text import is_text

TRUNCATED = "[output truncated]"
# Bytes of one model-written argument that travels as one argv element: Linux refuses an
# element over 128 KiB (MAX_ARG_STRLEN), and a container engine's command line adds its own.
ARG_LIMIT = 100_000
# A shell function for scripts that take a workspace path as "$1": `inside "$1"` fails when
# the path, its symlinks followed as the kernel follows them, leads out of the working
# directory. The deepest existing ancestor is resolved with `cd -P`; the part below it does
# not exist yet (so holds no symlink), save its first component, which may be a dangling one.
# A link is read with GNU find's %l (what the images promise), at most 40 deep, as ELOOP.
INSIDE = r"""inside() {
  root=$(pwd -P) || return 1; p=$1; n=0
  while [ -L "$p" ]; do
    n=$((n + 1)); [ "$n" -le 40 ] || return 1
    case $p in /*) q=$p;; *) q=./$p;; esac
    t=$(find "$q" -maxdepth 0 -printf '%l/') || return 1; t=${t%/}
    case $t in /*) p=$t;; *) case $p in */*) p=${p%/*}/$t;; *) p=$t;; esac;; esac
  done
  a=$p
  while [ ! -d "$a" ]; do
    case $a in */*) a=${a%/*}; [ -n "$a" ] || a=/;; *) a=.;; esac
  done
  r=$(cd -P -- "$a" && pwd -P) || return 1
  case $r/ in "$root"/*) ;; *) return 1;; esac
  [ "$a" = "$p" ] && return 0
  case $a in .) tail=$p;; /) tail=${p#/};; *) tail=${p#"$a"/};; esac
  case /$tail/ in */../*) return 1;; esac
  [ -L "${a%/}/${tail%%/*}" ] && return 1
  return 0
}
"""
OUTSIDE = 97  # a script's exit status when `inside` refused its path


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


def known_args(arguments: Any, spec: ToolSpec) -> dict[str, Any]:
    """`arguments` when they are an object whose keys the tool's schema names."""
    if not isinstance(arguments, dict):
        raise Refused("arguments must be a JSON object")
    properties = spec.input_schema.get("properties", {})
    for key in arguments:
        if key not in properties:
            takes = ", ".join(properties) or "no arguments"
            raise Refused(f"unknown argument '{quoted(str(key))}'; {spec.name} takes {takes}")
    return arguments


def string_arg(
    arguments: dict[str, Any], name: str, default: str | None = None, *, data: bool = False
) -> str:
    """A string argument; required unless a default is given. It must be text; unless it is
    `data` (it travels on stdin), also free of NUL and at most ARG_LIMIT bytes."""
    if name not in arguments:
        if default is not None:
            return default
        raise Refused(f"missing required argument '{name}'")
    value = arguments[name]
    if not isinstance(value, str):
        raise Refused(f"argument '{name}' must be a string")
    _check_text(name, value, data)
    return value


def string_list_arg(arguments: dict[str, Any], name: str) -> list[str]:
    """An optional list of strings, each a command-line argument (ARG_LIMIT bytes in all); a
    wrong shape is refused, never silently dropped."""
    value = arguments.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Refused(f"argument '{name}' must be an array of strings")
    for item in value:
        _check_text(name, item, data=False)
    total = sum(len(item.encode()) for item in value)
    if total > ARG_LIMIT:
        raise Refused(f"argument '{name}' is too long ({total} bytes; at most {ARG_LIMIT})")
    return value


def _check_text(name: str, value: str, data: bool) -> None:
    if not is_text(value):
        raise Refused(f"argument '{name}' holds a lone surrogate, which is not text")
    if data:
        return
    if "\x00" in value:
        raise Refused(f"argument '{name}' holds a NUL byte, which a command line cannot carry")
    size = len(value.encode())
    if size > ARG_LIMIT:
        raise Refused(f"argument '{name}' is too long ({size} bytes; at most {ARG_LIMIT})")


def workspace_path(path: str) -> str:
    """`path` when it names a place in the workspace; absolute paths and `..` are refused.
    A symlink out of it is refused by the script that uses the path (`INSIDE`)."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise Refused(f"path '{quoted(path)}' is outside the workspace")
    return path


def outside(path: str) -> Refused:
    """What a script's OUTSIDE exit status means."""
    return Refused(f"path '{quoted(path)}' leads outside the workspace")


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
