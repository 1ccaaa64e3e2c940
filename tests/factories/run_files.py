"""Run files for the end-to-end tests: the head every algorithm's run file shares, then its own
tables.

`write_run_file(tmp, "grpo", model, {"training": {...}, "grpo": {...}, "grpo.sampling": ...})`
writes tmp/run.toml: [run] algorithm, [model] on the CPU (or `device`), [output]
out/adapter.gguf, a rank-4 [lora] on q, v and ffn_down, then each table in order, a dict as
`key = value` lines (a value of None leaves its key out) and a string as the table's body as it
is. `extra` adds whole tables as text after them ({"metrics": 'tensorboard_dir = "tb"'}); an
"output" or "lora" entry there replaces the head's table instead, and None leaves it out (a run
that trains base tensors: {"lora": None, "output": {"path": "out/m.gguf", "kind": "model"}}).
"""

from __future__ import annotations

import json
from pathlib import Path

# the head's tables an `extra` entry may replace or (None) leave out
HEAD: dict[str, dict] = {
    "output": {"path": "out/adapter.gguf"},
    "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "ffn_down"]},
}


def toml(d: dict) -> str:
    """A TOML table's body, one JSON-encoded `key = value` a line; None leaves the key out."""
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in d.items() if v is not None)


def write_run_file(
    tmp: Path,
    algorithm: str,
    model: Path,
    tables: dict[str, dict | str],
    extra: dict[str, str | dict | None] | None = None,
    tail: str = "",
    device: str = "cpu",
) -> Path:
    """tmp/run.toml for `algorithm`; `tail` is text after every table (sub-tables of a section
    that the tables do not hold, such as [agent.environment]); `device` is [model].device."""
    extra = dict(extra or {})
    head = {name: extra.pop(name, table) for name, table in HEAD.items()}
    body = "\n".join(
        f"[{name}]\n{toml(t) if isinstance(t, dict) else t}"
        for name, t in {**head, **tables, **extra}.items()
        if t is not None
    )
    path = tmp / "run.toml"
    path.write_text(f"""
[run]
algorithm = "{algorithm}"
[model]
path = "{model}"
device = "{device}"
{body}
{tail}
""")
    return path
