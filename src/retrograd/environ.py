"""Every environment variable retrograd reads: one table, one parser per kind.

`VARIABLES` lists each variable with its kind, default and meaning; `read()` parses them all
into one frozen `Environ` (the compute plan is built from it, retrograd/compute.py), `get()`
parses one (for readers outside the compute plan: the container CLI, torchrun's ranks). A
value that is not one of its kind's words is a ConfigError naming the variable and what it
may be, never read silently as on or off. docs/configuration.md's environment table is
generated from `VARIABLES` (`python -m retrograd.environ docs/configuration.md`).

Knows names and spellings only: nothing here imports torch or knows what a value does.
Variables another program owns (OpenMP's, in retrograd/threads.py; DOCKER_HOST) stay there.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from retrograd.errors import ConfigError

Kind = Literal["flag", "choice", "int", "dtype", "argv"]

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no", "")
DTYPES = {
    "float32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
}


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, how its value is spelled, and what it does.

    kind: flag (1, true, on, yes / 0, false, off, no or empty), choice (one of `choices`, or
    a flag's word for on/off; empty = the default), int (at least `minimum`), dtype (a compute
    type's name), argv (a command line, split as a shell would)."""

    name: str
    field: str  # the Environ field it fills
    kind: Kind
    default: object
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int = 1


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "RETRO_DTYPE",
        "dtype",
        "dtype",
        None,
        "compute type of every command: `float32`, `bfloat16` or `float16` (`f32`, `bf16`, "
        "`f16`); unset, the fast one the device has (docs/models.md)",
    ),
    Variable(
        "RETRO_THREADS",
        "threads",
        "int",
        None,
        "CPU threads (intra-op); overrides `[training].threads` and `load(threads=)`; unset, "
        "PyTorch's own count within the CPUs the process may use",
    ),
    Variable(
        "RETRO_COMPILE",
        "compile",
        "flag",
        True,
        "`0` runs every fused kernel and the decode graph eagerly (the reference path of the "
        "equality tests, docs/exactness.md)",
    ),
    Variable(
        "RETRO_DEQUANT_CACHE",
        "dequant_cache",
        "choice",
        "auto",
        "the dequantized-weight cache: `auto` (on when it fits in 40% of free memory, else "
        "8-bit rows when they fit in 60%, else off), `on` (`1`), `off` (`0`), `int8` (weights "
        "kept as int8 rows with a scale each; docs/exactness.md); overrides `load(cache=)`",
        choices=("auto", "on", "off", "int8"),
    ),
    Variable(
        "RETRO_DEVICE_SAMPLING",
        "device_sampling",
        "flag",
        True,
        "`0` copies the logits to the host and chooses tokens there in float64 (the oracle)",
    ),
    Variable(
        "RETRO_DEVICE_LOGPROBS",
        "device_logprobs",
        "flag",
        True,
        "`0` computes sampled tokens' log-probabilities on the host in float64",
    ),
    Variable(
        "RETRO_FAST_TOP_P",
        "fast_top_p",
        "flag",
        True,
        "`0` sorts every nucleus row's whole vocabulary instead of searching the most likely "
        "tokens first (the same tokens, slower)",
    ),
    Variable(
        "RETRO_GENERATION_PREFIX_CACHE",
        "prefix_cache",
        "flag",
        True,
        "`0` keeps no keys and values between an agent's turns: every turn prefills again",
    ),
    Variable(
        "RETRO_REQUIRE_GPU_RESIDENT",
        "require_gpu_resident",
        "flag",
        False,
        "`1` is `[training].require_gpu_resident = true` for every run",
    ),
    Variable(
        "RETRO_CONTAINER_CLI",
        "container_cli",
        "argv",
        None,
        "the container command line of sandbox environments (`sudo podman`); unset, docker "
        "when DOCKER_HOST is set, else podman, else docker",
    ),
    Variable("RANK", "rank", "int", None, "set by torchrun: this process's rank", minimum=0),
    Variable("WORLD_SIZE", "world_size", "int", None, "set by torchrun: the number of ranks"),
    Variable(
        "LOCAL_RANK",
        "local_rank",
        "int",
        None,
        "set by torchrun: the rank on this machine",
        minimum=0,
    ),
)

BY_NAME = {v.name: v for v in VARIABLES}


@dataclass(frozen=True)
class Environ:
    """The parsed value of every variable of `VARIABLES` (its default where unset)."""

    dtype: str | None = None  # "float32", "bfloat16" or "float16"
    threads: int | None = None
    compile: bool = True
    dequant_cache: str = "auto"  # auto, on, off
    device_sampling: bool = True
    device_logprobs: bool = True
    fast_top_p: bool = True
    prefix_cache: bool = True
    require_gpu_resident: bool = False
    container_cli: tuple[str, ...] | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None


def read(environ: Mapping[str, str] | None = None) -> Environ:
    """Every variable of `VARIABLES`, parsed; ConfigError names the first bad one."""
    environ = os.environ if environ is None else environ
    return Environ(**{v.field: parse(v, environ.get(v.name)) for v in VARIABLES})


def get(name: str, environ: Mapping[str, str] | None = None):
    """One variable's parsed value (its default where unset)."""
    environ = os.environ if environ is None else environ
    return parse(BY_NAME[name], environ.get(name))


def setting(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """ "NAME=value" when the variable has a value that is not blank (where a plan's choice
    came from), else None."""
    environ = os.environ if environ is None else environ
    value = environ.get(name, "").strip()
    return f"{name}={value}" if value else None


def parse(var: Variable, value: str | None):
    """The value of `var` spelled `value` (None: unset -> the default)."""
    if value is None:
        return var.default
    return PARSERS[var.kind](var, value)


def _flag(var: Variable, value: str) -> bool:
    word = value.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise ConfigError(f"{var.name}={value}: must be 1, true, on, yes or 0, false, off, no")


def _choice(var: Variable, value: str) -> str:
    word = value.strip().lower()
    if not word:
        return var.default
    if word in var.choices:
        return word
    if word in ON and "on" in var.choices:
        return "on"
    if word in OFF and "off" in var.choices:
        return "off"
    allowed = ", ".join(var.choices)
    raise ConfigError(f"{var.name}={value}: must be {allowed} (or 1 for on, 0 for off)")


def _int(var: Variable, value: str) -> int | None:
    text = value.strip()
    if not text:
        return var.default
    try:
        number = int(text)
    except ValueError:
        what = "a positive" if var.minimum > 0 else "a non-negative"
        raise ConfigError(f"{var.name}={value!r}: must be {what} integer") from None
    if number < var.minimum:
        raise ConfigError(f"{var.name}={text}: must be at least {var.minimum}")
    return number


def _dtype(var: Variable, value: str) -> str | None:
    text = value.strip()
    if not text:
        return var.default
    name = DTYPES.get(text.lower())
    if name is None:
        raise ConfigError(f"{var.name}={text}: must be float32, bfloat16 or float16")
    return name


def _argv(var: Variable, value: str) -> tuple[str, ...] | None:
    text = value.strip()
    if not text:
        return var.default
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise ConfigError(f"{var.name}={value}: not a command line ({e})") from None


PARSERS = {"flag": _flag, "choice": _choice, "int": _int, "dtype": _dtype, "argv": _argv}

BEGIN = (
    "<!-- BEGIN GENERATED ENVIRONMENT TABLE: python -m retrograd.environ docs/configuration.md -->"
)
END = "<!-- END GENERATED ENVIRONMENT TABLE -->"
KIND_WORDS = {
    "flag": "on/off",
    "choice": "one of",
    "int": "integer",
    "dtype": "type",
    "argv": "command line",
}


def table() -> str:
    """Markdown: one row per variable of `VARIABLES`."""
    rows = ["| variable | kind | default | what it does |", "| --- | --- | --- | --- |"]
    for v in VARIABLES:
        kind = KIND_WORDS[v.kind]
        if v.choices:
            kind = f"{kind} {', '.join(v.choices)}"
        default = "unset" if v.default is None else _spelled(v.default)
        rows.append(f"| `{v.name}` | {kind} | {default} | {v.doc} |")
    return "\n".join(rows) + "\n"


def _spelled(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def rewrite(page: str) -> str:
    """`page` with the part between BEGIN and END replaced by `table()`."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError(f"the page has no {BEGIN!r} ... {END!r} markers")
    return pattern.sub(lambda _: f"{BEGIN}\n\n{table()}\n{END}", page)


def main(argv: list[str]) -> None:
    (path,) = argv
    page = Path(path)
    text = rewrite(page.read_text(encoding="utf-8"))
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(page)


if __name__ == "__main__":
    main(sys.argv[1:])
