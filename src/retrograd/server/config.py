"""The server's own TOML (formats.md §9.1): every key, its default, its catalogues.

`load_server_config` reads the file (or none), applies the command-line flags and
RETROGRAD_SERVER_TOKEN, and refuses what cannot start: an unknown key (named with its table and
the closest known key), a bad budget, a duplicate catalogue id, a non-loopback bind without
`auth_token` and `path_roots`. It knows nothing about runs or HTTP, and imports no torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError

from retrograd.config.agent import (
    ContainerEnvironment,
    HttpEnvironment,
    LocalEnvironment,
    McpServer,
)
from retrograd.config.fields import Argv, FilePath, Section, Text, key, optional_key
from retrograd.config.judge import CommandJudge, RulerJudge
from retrograd.config.load import parse_toml
from retrograd.config.report import issues_from_pydantic
from retrograd.errors import ConfigError
from retrograd.openai_app.local import is_loopback

DEFAULT_BIND = "127.0.0.1:8471"
TOKEN_ENV = "RETROGRAD_SERVER_TOKEN"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """4096, "4096", "6GiB", "1.5 GB" -> bytes; ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError('must be a byte count (4096) or a size ("6GiB")')
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if isinstance(value, str):
        found = _SIZE.match(value)
        if found and found[2].upper() in UNITS:
            return int(float(found[1]) * UNITS[found[2].upper()])
    raise ValueError(
        f'must be a byte count (4096) or a size ("6GiB", "512MiB", "2GB"), not {value!r}'
    )


@dataclass(frozen=True)
class Budget:
    """A memory budget: all of the device, a number of bytes, or a fraction of the total."""

    kind: Literal["all", "bytes", "fraction"]
    value: float = 1.0

    def bytes_of(self, total: int | None) -> int | None:
        """The budget in bytes against `total` (None when unknown and not fixed)."""
        if self.kind == "bytes":
            return int(self.value)
        if total is None:
            return None
        return int(total * (1.0 if self.kind == "all" else self.value))

    def describe(self) -> str | int | float:
        return (
            "all"
            if self.kind == "all"
            else (int(self.value) if self.kind == "bytes" else self.value)
        )


def parse_budget(value: Any) -> Budget:
    """ "all" | bytes (4096, "6GiB") | a fraction of the total in (0, 1] (0.8)."""
    if isinstance(value, Budget):
        return value
    if isinstance(value, str) and value.strip().lower() == "all":
        return Budget("all")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"a fraction must be in (0, 1], not {value}")
        return Budget("fraction", value)
    try:
        return Budget("bytes", parse_bytes(value))
    except ValueError:
        raise ValueError(
            f'must be "all", a size ("6GiB", 4096) or a fraction of the total (0.8), not {value!r}'
        ) from None


BudgetValue = Annotated[
    Budget, BeforeValidator(parse_budget, json_schema_input_type=str | int | float)
]
ByteSize = Annotated[int, BeforeValidator(parse_bytes, json_schema_input_type=str | int)]


class Serving(Section):
    """[serving]: the OpenAI routes that serve runs' weights."""

    enabled: bool = key(True, "Serve runs' weights on /v1/chat/completions.")
    idle_seconds: float = key(300.0, "Unload a served model after this long unused.", ge=0)
    device_wait_seconds: float = key(
        0.0, "How long a load waits for a run holding the device; 0 refuses at once.", ge=0
    )
    queue: int = key(8, "Requests waiting for a served model.", ge=1)
    max_body_bytes: ByteSize = key(4 << 20, "Largest request body of the OpenAI routes.", ge=1)


class _Entry(Section):
    id: Text = key(description="What clients name in their run documents.")
    description: str = key("", "Shown to clients in the catalogue listing.")


class RewardEntry(_Entry):
    """[[reward]]: a reward program clients reference as {"reward": {"id": ...}}."""

    command: Argv = key(description="The program, as an argument list (no shell).")
    cwd: FilePath | None = optional_key("Working directory; the server's when left out.")
    timeout_seconds: float = key(30.0, "Deadline for one batch of rewards.", gt=0)
    mode: Literal["persistent", "oneshot"] = key("persistent", "persistent or oneshot.")


class CommandJudgeEntry(_Entry, CommandJudge):
    """[[judge]] with type = "command"."""


class RulerJudgeEntry(_Entry, RulerJudge):
    """[[judge]] with type = "ruler"."""


JudgeEntry = Annotated[CommandJudgeEntry | RulerJudgeEntry, Field(discriminator="type")]


class McpServerEntry(_Entry, McpServer):
    """[[mcp_server]]: an MCP server; `name` defaults to the id."""

    name: Text | None = optional_key("Server name (its tools are NAME__TOOL); the id by default.")


class ContainerEnvironmentEntry(_Entry, ContainerEnvironment):
    """[[environment]] with type = "container"."""


class HttpEnvironmentEntry(_Entry, HttpEnvironment):
    """[[environment]] with type = "http"."""


class LocalEnvironmentEntry(_Entry, LocalEnvironment):
    """[[environment]] with type = "local"."""


EnvironmentEntry = Annotated[
    ContainerEnvironmentEntry | HttpEnvironmentEntry | LocalEnvironmentEntry,
    Field(discriminator="type"),
]


class ServerConfig(Section):
    """The server TOML: process, limits, storage, auth and the catalogues."""

    bind: Text = key(DEFAULT_BIND, "HOST:PORT to listen on; port 0 picks a free one.")
    state_dir: FilePath = key(
        Path("runs"), "Where runs keep run.json, events and outputs.", validate_default=True
    )
    vram_budget: BudgetValue = key(
        Budget("all"), 'GPU memory runs may use: "all", a size or a fraction.'
    )
    ram_budget: BudgetValue = key(
        Budget("fraction", 0.8), 'Host memory runs may use: "all", a size or a fraction.'
    )
    margin: float = key(0.1, "Share of each budget held back from plans.", ge=0, lt=1)
    max_concurrent_runs: int = key(1, "Runs training at once; later ones queue.", ge=1)
    calibrate_runs: bool = key(True, "Measure a plan's memory before a run starts.")
    path_roots: list[FilePath] = key([], "Folders client paths must lie in; [] allows any.")
    allow_local_paths: bool | None = optional_key(
        "Let clients name files on this machine; on when bound to loopback."
    )
    auth_token: Text | None = optional_key(
        f"Bearer token every /v1 request must carry; or set {TOKEN_ENV}. Without one, /v1 "
        "answers only requests to a loopback name that no page served from another machine sent."
    )
    command_timeout_seconds: float = key(300.0, "Wait for a live run's answer.", gt=0)
    request_timeout_seconds: float = key(60.0, "Longest request (event streams exempt).", gt=0)
    max_body_bytes: ByteSize = key(1 << 20, "Largest request body.", ge=1)
    max_concurrent_requests: int = key(
        256, "Requests served at once, and event streams open at once; more get 429.", ge=1
    )
    redact_error_paths: bool | None = optional_key(
        "Hide file paths in error documents; on when not bound to loopback."
    )
    max_dataset_bytes: ByteSize = key(1 << 30, "Largest uploaded dataset.", ge=1)
    max_datasets_bytes: ByteSize = key(20 << 30, "All uploaded datasets together.", ge=1)
    upload_idle_timeout_seconds: float = key(60.0, "An upload idle this long is dropped.", gt=0)
    ui: bool = key(True, "Serve the web page under /.")
    observe_target_updates: int = key(100, "Updates whose rollout texts a recipe run keeps.", ge=1)
    serving: Serving = key(Serving(), "The OpenAI routes serving runs' weights.")
    reward: list[RewardEntry] = key([], "Reward programs clients may reference by id.")
    judge: list[JudgeEntry] = key([], "Judges clients may reference by id.")
    mcp_server: list[McpServerEntry] = key([], "MCP servers clients may reference by id.")
    environment: list[EnvironmentEntry] = key([], "Agent environments clients may reference by id.")

    @property
    def host_port(self) -> tuple[str, int]:
        return split_bind(self.bind)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host_port[0])

    @property
    def local_paths(self) -> bool:
        return self.loopback if self.allow_local_paths is None else self.allow_local_paths

    @property
    def redact(self) -> bool:
        return (not self.loopback) if self.redact_error_paths is None else self.redact_error_paths

    def catalogue(self, kind: str) -> dict[str, Any]:
        """{id: entry} of `reward`, `judge`, `mcp_server` or `environment`."""
        return {entry.id: entry for entry in getattr(self, kind)}


CATALOGUES = ("reward", "judge", "mcp_server", "environment")


def split_bind(bind: str) -> tuple[str, int]:
    """ "127.0.0.1:8471", "[::1]:0", "localhost:80" -> (host, port); ValueError otherwise."""
    found = re.match(r"^(?:\[([^\]]+)\]|([^:\[\]]+)):(\d{1,5})$", bind.strip())
    if found is None or int(found[3]) > 65535:
        raise ValueError(f"bind = {bind!r}: must be HOST:PORT, e.g. 127.0.0.1:8471 or [::1]:8471")
    return found[1] or found[2], int(found[3])


def load_server_config(
    path: str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ServerConfig:
    """The server's configuration from `path` (defaults when None), the command-line
    `overrides` ({key: value} as TOML would hold them) and the environment's token.
    ConfigError lists every problem, one `server.toml: [table].key = value: rule` a line."""
    source = str(path) if path is not None else "the server configuration"
    data: dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"{source}: cannot read the server configuration: {error}") from None
        data = parse_toml(text, source)
        base_dir = path.resolve().parent
    data |= {k: v for k, v in (overrides or {}).items() if v is not None}
    environ = os.environ if environ is None else environ
    if "auth_token" not in data and environ.get(TOKEN_ENV):
        data["auth_token"] = environ[TOKEN_ENV]
    try:
        config = ServerConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as error:
        found = issues_from_pydantic(error.errors(), ServerConfig, ())
        raise ConfigError("\n".join(issue.render(source) for issue in found)) from None
    problems = _problems(config)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return config


def _problems(config: ServerConfig) -> list[str]:
    problems = []
    try:
        host, _port = config.host_port
    except ValueError as error:
        return [str(error)]
    for kind in CATALOGUES:
        seen: set[str] = set()
        for i, entry in enumerate(getattr(config, kind)):
            if entry.id in seen:
                problems.append(f'[{kind}][{i}].id = "{entry.id}": used twice; ids must be unique')
            seen.add(entry.id)
    if not is_loopback(host):
        if config.auth_token is None:
            problems.append(
                f'bind = "{config.bind}": not a loopback address; set auth_token '
                f"(or {TOKEN_ENV}) so that only clients with the token reach the runs"
            )
        if not config.path_roots:
            problems.append(
                f'bind = "{config.bind}": not a loopback address; set path_roots to the '
                "folders clients may read and write"
            )
    return problems
