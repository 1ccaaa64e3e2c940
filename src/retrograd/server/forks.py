"""`fork_from` (formats.md §9.3): a new run that starts from another run's adapter.

`{"run": ID, "checkpoint": C?}` takes the adapter that run wrote: the one exported beside
checkpoint C (`step-N`, a checkpoint id such as `step-000000000040`, `best`), or `final` (its
`[output].path`) or `latest` (the checkpoint a resume would pick); without C, its final adapter,
else its latest checkpoint's. `{"path": P}` takes an adapter GGUF at P (inside the path roots).
The new run starts from those weights as `[lora] init_adapter`, with a fresh optimizer, step
counter and schedule: what `retrograd train` does with `init_adapter` (a checkpoint's optimizer
state belongs to its own run and is not carried over). Its document is the one sent, or, with
`{run}` and no document, the source run's own document (its output and checkpoint folders
dropped, so the new run gets its own, and so is an [observe] directory; what the server's
catalogue filled in referenced by its id again, to be resolved anew); `params` are laid over it
either way. The adapter fixes
rank, alpha, seed, targets and dtype, so those keys are dropped from `[lora]`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from retrograd.server.documents import check_file
from retrograd.server.problems import FieldError, Problem, not_found, pointer
from retrograd.server.store import RunRecord

FROM_ADAPTER = ("rank", "alpha", "seed", "targets", "dtype")
_STEP = re.compile(r"^step-(\d+)$")


def _invalid(message: str, at: str = "") -> Problem:
    return Problem(
        "invalid-request",
        f"fork_from: {message}",
        [FieldError(pointer("fork_from", *([at] if at else [])), "invalid_value", message)],
    )


def source(fork: Any, store, server) -> tuple[Path, dict[str, Any] | None, str]:
    """(adapter, the source run's document or None, why) for a fork_from object."""
    if not isinstance(fork, dict) or set(fork) not in ({"run"}, {"run", "checkpoint"}, {"path"}):
        raise _invalid('must be {"run": ID, "checkpoint"?: C} or {"path": ADAPTER.gguf}')
    if "path" in fork:
        if not isinstance(fork["path"], str) or not fork["path"]:
            raise _invalid("must be a path to an adapter GGUF", "path")
        adapter = check_file(Path(fork["path"]), server, ("fork_from", "path"))
        return adapter, None, f"fork_from {adapter.name}"
    run_id = fork["run"]
    if not isinstance(run_id, str):
        raise _invalid("must be a run id", "run")
    record = store.runs.get(run_id)
    if record is None:
        raise not_found(f"fork_from: no run {run_id!r}")
    if record.effective_config.get("training", {}).get("trainable", "lora") != "lora":
        raise Problem(
            "conflict",
            f"fork_from: run {run_id} trains base tensors; only LoRA runs can be forked",
            [FieldError(pointer("fork_from", "run"), "conflict", "not a LoRA run")],
        )
    checkpoint = fork.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise _invalid("must be a checkpoint id (step-N, best), final or latest", "checkpoint")
    adapter = _adapter(record, checkpoint)
    if adapter is None:
        what = f"checkpoint {checkpoint!r}" if checkpoint else "an adapter"
        raise Problem(
            "conflict" if checkpoint is None else "not-found",
            f"fork_from: run {run_id} has no {what} with an exported adapter",
            [FieldError(pointer("fork_from", "checkpoint" if checkpoint else "run"),
                        "conflict" if checkpoint is None else "not_found",
                        f"run {run_id} has no {what} to start from")],
        )  # fmt: skip
    return (
        adapter,
        _own_document(record),
        f"fork_from run {run_id}" + (f" checkpoint {checkpoint}" if checkpoint else ""),
    )


def _adapter(record: RunRecord, checkpoint: str | None) -> Path | None:
    from retrograd.server.openai_routes import _exports, _final, _latest

    if checkpoint is None:
        return _final(record) or _latest(record)
    if checkpoint == "final":
        return _final(record)
    if checkpoint == "latest":
        return _latest(record)
    exports = dict(_exports(record))
    found = _STEP.match(checkpoint)
    if found:  # step-40 and step-000000000040 name the same checkpoint
        checkpoint = f"step-{int(found[1])}"
    return exports.get(checkpoint)


def _own_document(record: RunRecord) -> dict[str, Any]:
    """The source run's document without the folders that were its own, and with what the
    server's catalogue filled in referenced by id again (`_references`)."""
    document = copy.deepcopy(record.document)
    for derived in ("output", "checkpoint"):
        document.pop(derived, None)
    observe = document.get("observe")
    if isinstance(observe, dict):  # a recipe's trajectories went to its own folder
        observe.pop("directory", None)
    _references(document, record.provenance)
    return document


_CATALOGUED = re.compile(r"\[\[(\w+)\]\] (.+)")  # a provenance reason: "[[judge]] gemma"


def _references(document: dict[str, Any], provenance: dict[str, dict[str, str]]) -> None:
    """Each catalogue entry the server resolved into `document` (its provenance says which:
    `[[reward]] plurals` at grpo.reward_command, `[[mcp_server]] files` at
    agent.mcp_servers.0) made its `{"id": ...}` reference again, as the client sent it: the
    resolved tables are the operator's to declare, and the fork resolves them anew."""
    for place, origin in provenance.items():
        found = _CATALOGUED.fullmatch(origin.get("reason", ""))
        if found is None:
            continue
        *parents, last = place.split(".")
        table: Any = document
        for key in parents:
            table = table[int(key)] if isinstance(table, list) else table.get(key, {})
        reference = {"id": found[2]}
        if last == "reward_command":  # with reward_mode and, unless the client set it, the timeout
            section = parents[0]
            for key in ("reward_command", "reward_mode", "reward_timeout_seconds"):
                if provenance.get(f"{section}.{key}", {}).get("source") != "override":
                    table.pop(key, None)
            table["reward"] = reference
        elif isinstance(table, list):
            table[int(last)] = reference
        else:
            table[last] = reference


def apply(document: dict[str, Any], adapter: Path, run_dir: Path) -> dict[str, Any]:
    """The document starting from `adapter`: init_adapter set, the adapter's own keys dropped,
    an [observe] without a directory given one in the new run's folder."""
    out = copy.deepcopy(document)
    observe = out.get("observe")
    if isinstance(observe, dict) and "directory" not in observe:
        observe["directory"] = str(run_dir / "observe")
    lora = out.setdefault("lora", {})
    if not isinstance(lora, dict):
        raise _invalid("[lora] must be a table")
    for name in FROM_ADAPTER:
        lora.pop(name, None)
    lora["init_adapter"] = str(adapter)
    checkpoint = out.get("checkpoint")
    if isinstance(checkpoint, dict):
        checkpoint.pop("resume_from", None)
    return out
