"""What a run writes, checked before the model loads, and kept when the final write fails.

A run reads inputs (the model, data files, the run file, an initial adapter, a reference or
teacher model...) and writes outputs ([output].path, the checkpoint directory, metric
directories). `check_outputs` refuses, before anything is loaded, an output that is or
contains an input, an output path that is an existing directory or a name the checkpoint
writer uses, and a folder that cannot be written. `keep_result` saves the trained adapter
somewhere else when the final export fails, so that the training is never lost.

Inputs are found by walking the validated run file: every path outside the output keys is an
input, so a section added later is covered without a list to keep in step.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel

from retrograd import environ
from retrograd.errors import ConfigError

# (section, key) of the paths a run writes; every other path in the run file is read.
OUTPUT_KEYS = {
    ("output", "path"),
    ("checkpoint", "directory"),
    ("metrics", "tensorboard_dir"),
    ("metrics", "wandb_export_dir"),
    ("observe", "directory"),
}
NOT_INPUTS = OUTPUT_KEYS | {("checkpoint", "resume_from")}  # read from inside the directory
# Files the checkpoint writer puts in its directory besides the .state directories.
CHECKPOINT_EXPORT = re.compile(r"^(step-\d+|best)\.gguf$")


def run_inputs(cfg, run_file: str | Path | None = None) -> dict[str, Path]:
    """{where it is set: path} of every file or folder the run reads."""
    found: dict[str, Path] = {}
    for name in type(cfg).model_fields:
        section = getattr(cfg, name)
        if not isinstance(section, BaseModel):
            continue
        for key in type(section).model_fields:
            if (name, key) not in NOT_INPUTS:
                _walk(getattr(section, key), f"[{name}].{key}", found)
    if run_file is not None:
        found["the run file"] = Path(run_file)
    return found


def _walk(value, where: str, found: dict[str, Path]) -> None:
    if isinstance(value, Path):
        found[where] = value
    elif isinstance(value, BaseModel):
        for key in type(value).model_fields:
            _walk(getattr(value, key), f"{where}.{key}", found)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(item, f"{where}[{i}]", found)
    elif isinstance(value, dict):
        for k, item in value.items():
            _walk(item, f"{where}.{k}", found)


def run_outputs(cfg) -> dict[str, Path]:
    """{key: path} of what the run writes."""
    out = {}
    for section, key in sorted(OUTPUT_KEYS):
        table = getattr(cfg, section, None)
        path = getattr(table, key, None) if table is not None else None
        if path is not None:
            out[f"[{section}].{key}"] = Path(path)
    return out


def check_outputs(cfg, run_file: str | Path | None = None) -> None:
    """Refuse outputs that would destroy an input or cannot be written (ConfigError)."""
    inputs = run_inputs(cfg, run_file)
    outputs = run_outputs(cfg)
    problems = []
    for key, out in outputs.items():
        for where, src in inputs.items():
            if _same(out, src):
                problems.append(f"{key} = {out}: is {where}; writing it would destroy that input")
            elif _inside(src, out):
                problems.append(f"{key} = {out}: contains {where} ({src})")
    result = outputs.get("[output].path")
    if result is not None:
        problems += _result_problems(cfg, result)
    if problems:
        raise ConfigError("\n".join(problems) + "\nchoose another output path")
    if (environ.get("RANK") or 0) != 0:
        # NOTE: under torchrun rank 0 alone probes (and writes) the outputs: a probe removes the
        # folders it made, which pulled a folder from under another rank's probe.
        return
    for key, out in outputs.items():
        folder = out.parent if key == "[output].path" else out
        _check_writable(key, out, folder)


def _result_problems(cfg, result: Path) -> list[str]:
    problems = []
    if result.is_dir():
        problems.append(f"[output].path = {result}: is an existing directory; name a file")
    ck = cfg.checkpoint
    if (
        ck is not None
        and _same(result.parent, ck.directory)
        and CHECKPOINT_EXPORT.match(result.name)
    ):
        problems.append(
            f"[output].path = {result}: the checkpoint writer uses this name in "
            f"[checkpoint].directory"
        )
    return problems


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` lies under `folder` (after resolving links)."""
    p, f = os.path.realpath(path), os.path.realpath(folder)
    return p != f and p.startswith(f.rstrip(os.sep) + os.sep)


def check_output_file(key: str, path: str | Path, inputs: dict[str, Path]) -> None:
    """One output written outside a run (the Python API's save): refused when it is one of
    `inputs` ({where it is set: path}: the model, the last run's files) or lies inside one
    of them, or is a folder; its folder must be writable."""
    path = Path(path)
    for where, src in inputs.items():
        if _same(path, src):
            raise ConfigError(f"{key} {path}: is {where}; writing it would destroy that input")
    check_writable(key, path)


def check_writable(key: str, path: str | Path) -> None:
    """One output outside a run file (a command's --out): not a folder, its folder writable."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{key} {path}: a folder; name a file")
    _check_writable(key, path, path.parent)


def _check_writable(key: str, path: Path, folder: Path) -> None:
    """Create `folder` if needed and a file in it, as the run will, then remove what was made:
    a run refused later (bad data) leaves no empty folders behind."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".retrograd-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{key} = {path}: cannot write in {folder} ({e.strerror or e}); "
            "choose a writable folder"
        ) from None
    finally:
        for made in missing:  # deepest first
            try:
                made.rmdir()
            except OSError:
                break


def rescue_paths(output: Path, run_file: str | Path | None) -> list[Path]:
    """Where a result that could not be written to `output` is kept, in order of preference:
    beside the run file, then in the system's temporary folder."""
    name = f"{output.stem}.rescued{output.suffix or '.gguf'}"
    places = [Path(run_file).parent / name] if run_file is not None else []
    return places + [Path(tempfile.gettempdir()) / name]
