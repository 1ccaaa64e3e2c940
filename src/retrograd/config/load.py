"""Reading a run file: TOML, each section's own checks, the rules between them, the overrides;
and RunConfig, the checked run that every reader returns and a Python caller builds.

Everything wrong with a file is collected and raised once, as a ConfigError with one line per
problem. Paths in the file resolve against the file's directory; --model, --device and --resume
come from the command line (paths against the current directory). Nothing here opens a model:
checks that need its tensors are in `selectors.py`. `load_run` also applies [run].verbose.

Built in Python (`RunConfig(run=..., grpo=GrpoSection(...))`, `build_run`), a config goes
through `validate_run` on the document its sections make, so the rules between sections, the
refusals and the derived defaults apply exactly as to a loaded file; relative paths resolve
against the current directory and error lines start at the table (`[grpo].group_size = 1:
must be at least 2`). `supplied` names the parts a Python caller gives as objects instead of
keys (SUPPLIED_PARTS); a key such a part replaces may then be left out.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from retrograd import nesting
from retrograd.config.core import ModelSection
from retrograd.config.document import (
    ALGORITHM_SECTIONS,
    OBSERVE_ALGORITHMS,
    SECTION_NAMES,
    RunDocument,
)
from retrograd.config.report import (
    MAX_REPORTED,
    Issue,
    _models,
    capped,
    issues_from_pydantic,
    suggest,
    unreported,
)
from retrograd.config.resolved import resolved_lines
from retrograd.config.rule_base import Draft, issue
from retrograd.config.rules import run_rules
from retrograd.config.rules_train import OUTPUT_KINDS
from retrograd.config.training import GefenSection, MuonSection, OptimizerSection
from retrograd.config.write import document, dumps, section_document
from retrograd.errors import ConfigError

log = logging.getLogger(__name__)

# What a Python caller may supply instead of keys: reward functions (for reward_command), an
# agent environment (for [agent.environment]) and a verify function of finished episodes.
SUPPLIED_PARTS = ("rewards", "environment", "verify")

# Sections that always exist after loading, with their defaults when the file leaves them out.
DEFAULT_SECTIONS = {"model": ModelSection, "training": None, "optimizer": OptimizerSection}


class RunConfig(RunDocument):
    """A checked run: every section of a run file, the rules between them applied.

    Built in Python, `RunConfig(run=RunSection(algorithm="grpo"), grpo=GrpoSection(...),
    ...)` is checked as a loaded file is (each section, the rules between them, the derived
    defaults; relative paths against the current directory) and raises the same ConfigError
    lines, without the file name. `from_toml` reads a run file, `to_toml` writes one.
    """

    def __init__(self, /, **sections: Any) -> None:
        built = build_run(sections)
        super().__init__(**{name: getattr(built, name) for name in built.model_fields_set})

    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]  # see fields.Section

    @classmethod
    def from_toml(
        cls, path: str | Path, *, model: str | Path | None = None, device: str | None = None
    ) -> RunConfig:
        """Read and check a run file, as `retrograd train` does (`model` and `device` as its
        --model and --device); ConfigError lists every problem."""
        return load_run(path, model=model, device=device)

    def to_toml(self, path: str | Path | None = None) -> str:
        """The run file of this config, which `from_toml` reads back equal: the keys set on
        each section (written, passed, or derived by the loader), paths as held. With `path`,
        also written there (through a temporary name and a rename)."""
        text = dumps(document(self))
        if path is not None:
            from retrograd.gguf.writer import atomic_path

            with atomic_path(path) as tmp:
                tmp.write_text(text, encoding="utf-8")
        return text


def build_run(
    sections: Mapping[str, Any],
    *,
    supplied: Iterable[str] = (),
    base_dir: str | Path | None = None,
) -> RunConfig:
    """A RunConfig from sections (section objects or dicts; None leaves one out), checked as a
    run file is; relative paths against `base_dir`, else the current directory; `supplied` as
    `validate_run` takes it. ConfigError lists every problem."""
    misplaced = [line for name, value in sections.items() if (line := _misplaced(name, value))]
    if misplaced:
        raise ConfigError("\n".join(misplaced))
    doc = {
        name: section_document(value) if isinstance(value, BaseModel) else value
        for name, value in sections.items()
        if value is not None
    }
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    return validate_run(doc, source=None, base_dir=base, supplied=supplied)


def check_sections(
    sections: Mapping[str, Any], *, base_dir: str | Path | None = None
) -> dict[str, BaseModel]:
    """Some of a run's sections on their own (section objects or dicts; None leaves one
    out), each checked as build_run checks it but without the rules between sections, which
    need the whole run: -> {name: section}, relative paths against `base_dir` (else the
    current directory). ConfigError lists every problem, named as a run file names it."""
    found = [line for name, value in sections.items() if (line := _misplaced(name, value))]
    unknown = [name for name in sections if name not in SECTION_NAMES]
    found += [
        issue(name, None, "unknown section" + _section_hint(name)).render(None) for name in unknown
    ]
    if found:
        raise ConfigError("\n".join(found))
    context = {"base_dir": Path(base_dir) if base_dir is not None else Path.cwd()}
    out: dict[str, BaseModel] = {}
    issues: list[Issue] = []
    for name, value in sections.items():
        if value is None:
            continue
        data = section_document(value) if isinstance(value, BaseModel) else value
        try:
            out[name] = _adapter(name).validate_python(data, context=context)
        except ValidationError as error:
            issues += issues_from_pydantic(error.errors(), _adapter(name)._type, (name,))
    if issues:
        raise ConfigError("\n".join(item.render(None) for item in issues))
    return out


def _misplaced(name: str, value: Any) -> str | None:
    """`[grpo]: given a LoraSection; [grpo] is a GrpoSection`, for a section object passed
    under another section's name (an unknown name is reported as in a file)."""
    if not isinstance(value, BaseModel) or name not in RunDocument.model_fields:
        return None
    expected = _section_types(name)
    if type(value) in expected:
        return None
    names = " or ".join(cls.__name__ for cls in expected)
    return f"[{name}]: given a {type(value).__name__}; [{name}] is a {names}"


def _section_types(name: str) -> tuple[type, ...]:
    return tuple(_models(RunDocument.model_fields[name].annotation))


def load_run(
    path: str | Path,
    *,
    model: str | Path | None = None,
    device: str | None = None,
    resume: bool | str | Path | None = None,
) -> RunConfig:
    """Read and validate a run file; raise ConfigError listing every problem, one per line.

    `model` and `device` override [model] (a relative `model` resolves against the current
    directory); a truthy `resume` (train --resume) is checked against lora.init_adapter.
    [run].verbose is applied here: the `retrograd` logger writes to stderr while the last run
    file loaded says verbose = true (observe/log.py), starting with the resolved run.
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such run file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{source}: cannot read the run file: {error}") from None
    data = parse_toml(text, source)
    config = validate_run(
        data,
        source=source,
        base_dir=path.resolve().parent,
        model=model,
        device=device,
        resume=resume,
    )
    _apply_verbose(config, data, source, model=model, device=device)
    return config


def _apply_verbose(
    config: RunConfig, data: dict[str, Any], source: str, *, model: Any, device: Any
) -> None:
    """[run].verbose: turn the `retrograd` logger's stderr lines on (or back off), then log
    the resolved run. Here rather than in each command, so that every command that reads a
    run file honours the key; validate_run alone (the server checking a document) does not."""
    from retrograd.observe.log import configure_logging

    configure_logging(config.run.verbose)
    if not config.run.verbose:
        return
    flags = {"model.path": "--model", "model.device": "--device"}
    given = {"model.path": model, "model.device": device}
    overrides = {key: flag for key, flag in flags.items() if given[key] is not None}
    log.info("%s: the resolved run, key by key (origin in parentheses)", source)
    for line in resolved_lines(config, data, overrides):
        log.info("%s", line)


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML to a dict; a syntax error becomes `run.toml:LINE:COLUMN: invalid TOML: ...`, and
    so do nesting deeper than nesting.MAX_DEPTH (arrays and tables, dotted keys too), found
    before tomllib or any later reader recurses into it, and an integer of more digits than
    Python converts (a ValueError out of tomllib)."""
    try:
        nesting.check_toml(text)
        data = tomllib.loads(text)
        nesting.check_value(data)
        return data
    except nesting.TooDeep as error:
        where = f":{error.lineno}:{error.colno}" if error.doc else ""
        raise ConfigError(f"{source}{where}: invalid TOML: {error.msg}") from error
    except tomllib.TOMLDecodeError as error:
        message = str(error)
        found = re.search(r"\(at line (\d+), column (\d+)\)", message)
        if found is None:
            raise ConfigError(f"{source}: invalid TOML: {message}") from None
        reason = message[: found.start()].strip()
        raise ConfigError(f"{source}:{found[1]}:{found[2]}: invalid TOML: {reason}") from None
    except ValueError as error:  # an integer of more digits than int() converts (4300)
        where, at = re.search(r"[0-9_]{4301}", text), ""
        if where is not None:
            start = where.start()
            at = f":{text.count(chr(10), 0, start) + 1}:{start - text.rfind(chr(10), 0, start)}"
        raise ConfigError(f"{source}{at}: invalid TOML: {error}") from None


def validate_run(
    data: dict[str, Any],
    *,
    source: str | None = "run.toml",
    base_dir: str | Path | None = None,
    model: str | Path | None = None,
    device: str | None = None,
    resume: bool | str | Path | None = None,
    supplied: Iterable[str] = (),
) -> RunConfig:
    """Validate an already-parsed run document (from TOML or JSON); see `load_run`.

    `source` starts each error line (None: a config built in Python, the line starts at the
    table). `supplied` names what the Python API gives as objects rather than keys
    (SUPPLIED_PARTS): a key it replaces may then be left out."""
    context = {"base_dir": Path(base_dir)} if base_dir is not None else None
    draft, found = _sections(data, context, _not_applying(data))
    draft.resume = bool(resume)
    draft.supplied = _supplied(supplied)
    found += _presence(draft)
    found += _replaceable_keys(draft)
    found += _model_overrides(draft, model, device, python=source is None)
    if "run" in draft.sections and not draft.failed & {"run", "training"}:
        found += run_rules(draft)
    found = capped(found)
    if found:
        error = ConfigError("\n".join(item.render(source) for item in found))
        error.issues = found  # type: ignore[attr-defined]
        raise error
    return _resolved(RunConfig.model_validate(draft.sections))


@cache
def _adapter(name: str) -> TypeAdapter:
    return TypeAdapter(RunDocument.model_fields[name].annotation)


def _not_applying(data: dict[str, Any]) -> set[str]:
    """Sections the algorithm does not read: reported as such, their keys not checked."""
    run = data.get("run")
    algorithm = run.get("algorithm") if isinstance(run, dict) else None
    if algorithm not in ALGORITHM_SECTIONS:
        return set()
    skip = set(ALGORITHM_SECTIONS.values()) - {ALGORITHM_SECTIONS[algorithm]}
    return skip | ({"observe"} if algorithm not in OBSERVE_ALGORITHMS else set())


def _sections(
    data: dict[str, Any], context: dict | None, skip: set[str]
) -> tuple[Draft, list[Issue]]:
    found: list[Issue] = []
    sections: dict[str, Any] = {}
    failed: set[str] = set()
    for name, value in data.items():
        if name in skip:
            continue
        if name not in SECTION_NAMES:
            if len(found) >= MAX_REPORTED:  # counted, its suggestion left uncomputed
                found.append(unreported(1))
            elif isinstance(value, dict):
                found.append(issue(name, None, "unknown section" + _section_hint(name)))
            else:
                found.append(Issue((), name, "keys belong in a section such as [run]", value))
            continue
        try:
            sections[name] = _adapter(name).validate_python(value, context=context)
        except ValidationError as error:
            failed.add(name)
            found += issues_from_pydantic(error.errors(), _adapter(name)._type, (name,))
    for name, default in DEFAULT_SECTIONS.items():
        if name not in sections and name not in failed:
            sections[name] = default() if default else _adapter(name).validate_python({})
    return Draft(dict(data), sections, failed), found


def _supplied(parts: Iterable[str]) -> frozenset[str]:
    given = frozenset(parts)
    unknown = sorted(given - set(SUPPLIED_PARTS))
    if unknown:
        raise ValueError(f"supplied {unknown}: the parts are {', '.join(SUPPLIED_PARTS)}")
    return given


def _replaceable_keys(d: Draft) -> list[Issue]:
    """Keys a run file must write that a Python caller may replace by an object (a section
    class's SUPPLIED_BY: reward_command by reward functions): required unless supplied."""
    found = []
    for name, section in d.sections.items():
        for key, part in getattr(type(section), "SUPPLIED_BY", {}).items():
            if getattr(section, key) is None and part not in d.supplied:
                found.append(issue(name, key, "required"))
    return found


def _section_hint(name: str) -> str:
    hint = suggest(name, SECTION_NAMES)
    return hint.replace("did you mean ", "did you mean [").replace("?", "]?") if hint else ""


def _presence(d: Draft) -> list[Issue]:
    """Required sections, and sections the run's algorithm does not read."""
    found = [issue(name, None, "required") for name in ("run", "output") if not d.present(name)]
    if "run" not in d.sections:
        return found
    algorithm = d.sections["run"].algorithm
    own = ALGORITHM_SECTIONS[algorithm]
    if not d.present(own):
        found.append(issue(own, None, f'required by run.algorithm = "{algorithm}"'))
    for name in ALGORITHM_SECTIONS.values():
        if name != own and d.present(name):
            found.append(
                issue(name, None, f'does not apply to run.algorithm = "{algorithm}"; remove it')
            )
    if d.present("observe") and algorithm not in OBSERVE_ALGORITHMS:
        found.append(
            issue(
                "observe",
                None,
                f"only ppo, grpo and agent_grpo record rollouts, not {algorithm}; remove it",
            )
        )
    return found


def _model_overrides(
    d: Draft, model: str | Path | None, device: str | None, python: bool = False
) -> list[Issue]:
    section = d.sections.get("model")
    if section is None:
        return []
    update: dict[str, Any] = {}
    if model is not None:
        update["path"] = Path(model).absolute()
    if device is not None:
        if device not in ("auto", "cpu", "gpu"):
            raise ConfigError(f"--device {device}: must be auto, cpu or gpu")
        update["device"] = device
    if update:
        d.sections["model"] = section.model_copy(update=update)
    if d.sections["model"].path is None:
        where = "give ModelSection(path=...)" if python else "set it in the file or pass --model"
        return [issue("model", "path", f"required: {where}")]
    return []


def _resolved(config: RunConfig) -> RunConfig:
    """Fill in the defaults that depend on other keys, so later code never derives them."""
    update: dict[str, Any] = {}
    mode = config.training.trainable
    if config.output.kind is None:
        update["output"] = config.output.model_copy(update={"kind": OUTPUT_KINDS[mode][0]})
    name = config.training.optimizer
    if name in ("muon", "gefen") and getattr(config.optimizer, name) is None:
        table = MuonSection() if name == "muon" else GefenSection()
        update["optimizer"] = config.optimizer.model_copy(update={name: table})
    if config.reference is not None and config.reference.ctx is None:
        update["reference"] = config.reference.model_copy(update={"ctx": config.training.ctx})
    return config.model_copy(update=update) if update else config
