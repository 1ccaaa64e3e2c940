"""A client's run document, made into what a run executes: the server's checks and additions.

`POST /v1/runs` sends a whole run document (JSON `config`, or TOML) and `params` (a partial
document laid over it). Before the run-file loader sees it, this module
- refuses server-declared fields (programs, endpoints, keys: `server-declared`) and replaces
  catalogue references (`reward = {id = "..."}`, `judge = {id = "..."}`, `[agent]
  environment = {id = "..."}` and `mcp_servers = [{id = "..."}, ...]`) by the entries the
  operator declared (`unknown-catalog-id` for an id nobody declared);
- fills what a served run needs and a file run leaves to its author: [output].path and a
  [checkpoint] under the run's own folder, so that every run can be resumed and downloaded;
- validates with the loader (every problem at once, as `errors[]`);
- checks every path against `path_roots` and `allow_local_paths`, and every output against
  the server's state directory (`forbidden-path`).
The result records where each top-level value came from (provenance). Nothing here runs a loop.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from retrograd.checkpoint.outputs import NOT_INPUTS, OUTPUT_KEYS
from retrograd.config import RunConfig, validate_run
from retrograd.errors import ConfigError
from retrograd.server.config import ServerConfig
from retrograd.server.problems import FieldError, Problem, issues_to_errors, pointer

# (section path, key) -> what a client references instead
SERVER_DECLARED = {
    ("ppo", "reward_command"): "reward = { id = ... } (GET /v1/rewards)",
    ("grpo", "reward_command"): "reward = { id = ... } (GET /v1/rewards)",
    ("grpo", "judge"): "judge = { id = ... } (GET /v1/judges)",
    ("agent", "judge"): "judge = { id = ... } (GET /v1/judges)",
    ("agent", "mcp_servers"): "mcp_servers = [{ id = ... }] (GET /v1/mcp-servers)",
    ("agent", "mcp_config"): "mcp_servers = [{ id = ... }] (GET /v1/mcp-servers)",
    ("agent", "environment"): "environment = { id = ... } (GET /v1/environments)",
    ("agent", "collect_api"): "nothing: a served run does not collect",
    ("agent", "scenario_generation"): "nothing: a served run does not generate scenarios",
}
# Every served run gets a checkpoint every this many optimizer steps unless it says otherwise.
DEFAULT_CHECKPOINT_STEPS = 50
# What PATCH /v1/runs/{id} may change during a run (formats.md §9.3).
PATCHABLE = {
    "training": ("lr",),
    "evaluation": ("every_iterations", "patience"),
    "checkpoint": ("every_steps", "mode"),
}
# The values the server derives (GET /v1/defaults): what a client leaves out, filled in.
DERIVED = [
    {
        "path": "output.path",
        "rule": "<state_dir>/<run id>/output/adapter.gguf when the document sets none",
        "applies_to": "every run",
        "client_can_set": True,
        "thresholds": {},
    },
    {
        "path": "checkpoint",
        "rule": f'directory = "<state_dir>/<run id>/checkpoints", mode = "steps", '
        f"every_steps = {DEFAULT_CHECKPOINT_STEPS} when the document has no [checkpoint]",
        "applies_to": "every run",
        "client_can_set": True,
        "thresholds": {"every_steps": DEFAULT_CHECKPOINT_STEPS},
    },
    {
        "path": "<section>.reward_command, reward_mode, reward_timeout_seconds",
        "rule": "from the [[reward]] entry named by <section>.reward = {id}",
        "applies_to": "ppo, grpo",
        "client_can_set": False,
        "thresholds": {},
    },
    {
        "path": "grpo.judge, agent.judge",
        "rule": "the [[judge]] entry named by <section>.judge = {id}",
        "applies_to": "grpo, agent_grpo",
        "client_can_set": False,
        "thresholds": {},
    },
    {
        "path": "agent.environment",
        "rule": "the [[environment]] entry named by agent.environment = {id}",
        "applies_to": "agent_grpo",
        "client_can_set": False,
        "thresholds": {},
    },
    {
        "path": "agent.mcp_servers",
        "rule": "the [[mcp_server]] entries named by agent.mcp_servers = [{id}, ...] (name: the id)",
        "applies_to": "agent_grpo",
        "client_can_set": False,
        "thresholds": {},
    },
]
REWARD_SECTIONS = ("ppo", "grpo")
# What a client sees of a catalogue entry's keys: the `headers` and `env` values it was declared
# with (a remote MCP server's or an environment's bearer token, a local MCP server's API key).
HIDDEN = "(declared by the server; hidden)"
# (section, key, catalogue) of the tables a client names by id
TABLES = (
    ("grpo", "judge", "judge"),
    ("agent", "judge", "judge"),
    ("agent", "environment", "environment"),
)


@dataclass(frozen=True)
class Prepared:
    """A validated run: the document its process validates again, the config, provenance."""

    document: dict[str, Any]
    config: RunConfig
    provenance: dict[str, dict[str, str]]
    base_dir: Path
    where: str = "config"  # the document's JSON pointer in the request ("" for TOML)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`, tables merged key by key (lists and values replaced)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def prepare(
    document: dict[str, Any],
    params: dict[str, Any] | None,
    server: ServerConfig,
    run_dir: Path,
    where: str = "config",
    datasets=None,
    own: list[Path] = (),
) -> Prepared:
    """What `POST /v1/runs` turns into a run; Problem for every refusal. `where` is the JSON
    pointer of the document in the request ("" for a TOML body); `datasets` (datasets.py)
    turns a dataset id written where a path goes into its file; `own` are more folders of
    the server's own that the run may read (a forked run's adapter)."""
    prefix = (where,) if where else ()
    provenance: dict[str, dict[str, str]] = {}
    doc = merge(document, params or {})
    _leaves(document, (), "override", provenance)
    _leaves(params or {}, (), "override", provenance)
    _refuse_declared(doc, prefix)
    _resolve_catalogue(doc, server, prefix, provenance)
    _add_run_folders(doc, run_dir, provenance)
    if datasets is not None:
        doc = _dataset_files(doc, datasets)
    base_dir = server.path_roots[0] if server.path_roots else Path.cwd()
    try:
        config = validate_run(doc, source="the run document", base_dir=base_dir)
    except ConfigError as error:
        issues = getattr(error, "issues", None)
        errors = issues_to_errors(issues, RunConfig, prefix) if issues else []
        raise Problem("invalid-request", str(error), errors) from None
    own = [run_dir, *own] + ([datasets.root] if datasets is not None else [])
    operator = [k for k, v in provenance.items() if v.get("reason", "").startswith("[[")]
    check_paths(config, server, prefix, own, operator)
    return Prepared(doc, config, provenance, base_dir, where)


def _dataset_files(value: Any, datasets) -> Any:
    """The document with every known dataset id (`ds_...`) replaced by its file's path."""
    if isinstance(value, dict):
        return {k: _dataset_files(v, datasets) for k, v in value.items()}
    if isinstance(value, list):
        return [_dataset_files(v, datasets) for v in value]
    if isinstance(value, str) and value.startswith("ds_") and datasets.view(value) is not None:
        return str(datasets.data_path(value))
    return value


def _leaves(doc: Any, at: tuple[str, ...], source: str, out: dict[str, dict[str, str]]) -> None:
    if isinstance(doc, dict) and doc:
        for k, v in doc.items():
            _leaves(v, (*at, str(k)), source, out)
    elif at:
        out[".".join(at)] = {"source": source}


def _refuse_declared(doc: dict[str, Any], prefix: tuple[str, ...]) -> None:
    errors = []
    for (section, name), instead in SERVER_DECLARED.items():
        table = doc.get(section)
        if isinstance(table, dict) and name in table and not _referenced(name, table[name]):
            errors.append(
                FieldError(
                    pointer(*prefix, section, name),
                    "server_declared",
                    f"[{section}].{name} is declared by the server operator; reference {instead}",
                )
            )
    if errors:
        raise Problem(
            "server-declared",
            "the document sets fields only the server's configuration may declare",
            errors,
        )


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"id"}


def _referenced(name: str, value: Any) -> bool:
    """Whether a declared field holds catalogue references only (resolved later)."""
    if name == "mcp_servers":
        return isinstance(value, list) and all(_is_reference(v) for v in value)
    return name != "reward_command" and _is_reference(value)


def _resolve_catalogue(
    doc: dict[str, Any],
    server: ServerConfig,
    prefix: tuple[str, ...],
    provenance: dict[str, dict[str, str]],
) -> None:
    """`reward = {id}`, `judge = {id}`, `environment = {id}` and `mcp_servers = [{id}, ...]`
    replaced by the catalogue's entries."""
    errors = []
    for section in REWARD_SECTIONS:
        table = doc.get(section)
        if not isinstance(table, dict) or "reward" not in table:
            continue
        ref = table.pop("reward")
        entry = _entry(server, "reward", ref, pointer(*prefix, section, "reward"), errors)
        if entry is not None:
            table["reward_command"] = list(entry.command)
            table["reward_mode"] = entry.mode
            table.setdefault("reward_timeout_seconds", entry.timeout_seconds)
            provenance[f"{section}.reward_command"] = {
                "source": "derived",
                "reason": f"[[reward]] {entry.id}",
            }
    for section, key, kind in TABLES:
        table = doc.get(section)
        if not isinstance(table, dict) or not _is_reference(table.get(key)):
            continue
        where = pointer(*prefix, section, key, "id")
        entry = _entry(server, kind, table[key], where, errors)
        if entry is not None:
            table[key] = _declared(entry)
            provenance[f"{section}.{key}"] = {
                "source": "derived",
                "reason": f"[[{kind}]] {entry.id}",
            }
    agent = doc.get("agent")
    servers = agent.get("mcp_servers") if isinstance(agent, dict) else None
    for i, ref in enumerate(servers if isinstance(servers, list) else []):
        where = pointer(*prefix, "agent", "mcp_servers", str(i), "id")
        entry = _entry(server, "mcp_server", ref, where, errors)
        if entry is not None:
            servers[i] = {**_declared(entry), "name": entry.name or entry.id}
            provenance[f"agent.mcp_servers.{i}"] = {
                "source": "derived",
                "reason": f"[[mcp_server]] {entry.id}",
            }
    if errors:
        raise Problem("unknown-catalog-id", "the document references undeclared entries", errors)


def hide_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A run's effective config or document as a client is shown it: the values of
    [agent.environment].headers and of each [[agent.mcp_servers]] entry's `headers` and `env`
    (only the server's catalogue fills them: a client's own are server-declared) replaced by
    HIDDEN, their names kept. The run's process reads the real ones from run.json."""
    agent = config.get("agent")
    if not isinstance(agent, dict):
        return config
    agent = dict(agent)
    environment = agent.get("environment")
    if isinstance(environment, dict):
        agent["environment"] = _hidden(environment, ("headers",))
    servers = agent.get("mcp_servers")
    if isinstance(servers, list):
        agent["mcp_servers"] = [_hidden(s, ("headers", "env")) for s in servers]
    return {**config, "agent": agent}


def _hidden(table: Any, keys: tuple[str, ...]) -> Any:
    if not isinstance(table, dict):
        return table
    hidden = {k: dict.fromkeys(table[k], HIDDEN) for k in keys if isinstance(table.get(k), dict)}
    return {**table, **hidden}


def _declared(entry) -> dict[str, Any]:
    """A catalogue entry as the run file's table: its backend keys, without id and description."""
    return entry.model_dump(mode="json", exclude={"id", "description"}, exclude_unset=True)


def _entry(server: ServerConfig, kind: str, ref: Any, where: str, errors: list) -> Any:
    if not _is_reference(ref) or not isinstance(ref["id"], str):
        errors.append(
            FieldError(where, "invalid_value", f'must be {{"id": "..."}} naming a [[{kind}]]')
        )
        return None
    found = server.catalogue(kind).get(ref["id"])
    if found is None:
        known = ", ".join(server.catalogue(kind)) or "none declared"
        errors.append(
            FieldError(where, "unknown_catalog_id", f"no [[{kind}]] has id {ref['id']!r} ({known})")
        )
    return found


def _add_run_folders(
    doc: dict[str, Any], run_dir: Path, provenance: dict[str, dict[str, str]]
) -> None:
    """[output].path and [checkpoint] under the run's folder when the document leaves them out."""
    output = doc.setdefault("output", {})
    if isinstance(output, dict) and "path" not in output:
        output["path"] = str(run_dir / "output" / "adapter.gguf")
        provenance["output.path"] = {"source": "derived", "reason": "the run's folder"}
    if "checkpoint" not in doc:
        doc["checkpoint"] = {
            "directory": str(run_dir / "checkpoints"),
            "mode": "steps",
            "every_steps": DEFAULT_CHECKPOINT_STEPS,
        }
        for k in doc["checkpoint"]:
            provenance[f"checkpoint.{k}"] = {
                "source": "derived",
                "reason": "every served run can be resumed",
            }


def config_paths(value: Any, at: tuple[str | int, ...] = ()) -> list[tuple[tuple, Path]]:
    """Every (place, path) of a validated run config."""
    if isinstance(value, Path):
        return [(at, value)]
    found = []
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found += config_paths(getattr(value, name), (*at, name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found += config_paths(item, (*at, i))
    elif isinstance(value, dict):
        for k, item in value.items():
            found += config_paths(item, (*at, k))
    return found


def inside(path: Path, root: Path) -> bool:
    """Whether `path`, symlinks and `..` resolved, lies in `root` (also resolved)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def check_file(path: Path, server: ServerConfig, place: tuple[str, ...]) -> Path:
    """A file a request names (relative: against the first path root), refused like a run's
    paths when outside the roots or missing."""
    base = server.path_roots[0] if server.path_roots else Path.cwd()
    path = path if path.is_absolute() else base / path
    where = pointer(*place)
    key = ".".join(place)
    if not server.local_paths:
        raise Problem(
            "forbidden-path",
            "this server takes no local paths",
            [FieldError(where, "needs_opt_in", f"{key}: allow_local_paths = false")],
        )
    if server.path_roots and not any(inside(path, root) for root in server.path_roots):
        raise Problem(
            "forbidden-path",
            "the request names a path the server may not use",
            [
                FieldError(
                    where, "forbidden_path", f"{key} = {path}: outside the server's path_roots"
                )
            ],
        )
    if not path.is_file():
        raise Problem(
            "invalid-request",
            "the request names a file that does not exist",
            [FieldError(where, "path_not_found", f"{path}: no such file")],
        )
    return path


def check_paths(
    config: RunConfig,
    server: ServerConfig,
    prefix: tuple[str, ...],
    own: list[Path],
    operator: list[str] = (),
) -> None:
    """Every path of the run inside a path root (the run's own folder always is), none at all
    when the server does not take local paths, no output in the server's state directory but
    in the run's folder (own[0]); then every file the run reads must exist.
    `operator`: the places ("agent.environment") the server's catalogue filled, whose paths
    are the operator's."""
    errors = []
    run_dir = own[0] if own else None
    for place, path in config_paths(config):
        key = ".".join(str(p) for p in place)
        if tuple(place[:2]) in OUTPUT_KEYS and _of_the_state(path, server, run_dir):
            errors.append(
                FieldError(
                    pointer(*prefix, *place),
                    "forbidden_path",
                    f"{key} = {path}: inside the server's state directory (runs, datasets); "
                    "a run writes there only in its own folder",
                )
            )
            continue
        if any(inside(path, folder) for folder in own):  # the run's folder, the datasets
            continue
        if any(key == o or key.startswith(o + ".") for o in operator):
            continue
        where = pointer(*prefix, *place)
        if not server.local_paths:
            errors.append(
                FieldError(
                    where,
                    "needs_opt_in",
                    f"{key}: this server takes no local paths (allow_local_paths = false)",
                )
            )
        elif server.path_roots and not any(inside(path, root) for root in server.path_roots):
            errors.append(
                FieldError(
                    where, "forbidden_path", f"{key} = {path}: outside the server's path_roots"
                )
            )
    if errors:
        raise Problem("forbidden-path", "the document names paths the server may not use", errors)
    missing = [
        FieldError(pointer(*prefix, *place), "path_not_found", f"{path}: no such file or folder")
        for place, path in config_paths(config)
        if tuple(place[:2]) not in NOT_INPUTS and not path.exists()
    ]
    if missing:
        raise Problem("invalid-request", "the document names files that do not exist", missing)


def _of_the_state(path: Path, server: ServerConfig, run_dir: Path | None) -> bool:
    """Whether an output lies in the server's state directory but not in the run's folder:
    there it would replace another run's record or files, or an uploaded dataset's bytes."""
    if not inside(path, Path(server.state_dir)):
        return False
    return run_dir is None or not inside(path, run_dir)


def marked_schema() -> dict[str, Any]:
    """The run file's JSON Schema with the server's marks: `x-retrograd-server-declared` on
    the fields clients may not send, `x-retrograd-patchable` on those PATCH may change."""
    from retrograd.config import json_schema

    schema = json_schema()

    def properties(section: str) -> dict[str, Any]:
        prop = schema["properties"][section]
        refs = [prop.get("$ref")] + [o.get("$ref") for o in prop.get("anyOf", [])]
        ref = next((r for r in refs if r), None)
        return schema["$defs"][ref.rsplit("/", 1)[1]]["properties"] if ref else {}

    for section, name in SERVER_DECLARED:
        properties(section)[name]["x-retrograd-server-declared"] = True
    for section, names in PATCHABLE.items():
        for name in names:
            properties(section)[name]["x-retrograd-patchable"] = True
    return schema
