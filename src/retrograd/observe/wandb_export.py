"""W&B sink: an offline W&B run that `wandb sync` uploads, plus formats.md's own two files.

`<wandb_export_dir>/run.json` holds the RunInfo; `metrics.jsonl` holds one JSON event a line:
`run_started{metadata}`, `step{epoch, global_step, values:[{name, value}]}`,
`run_finished{global_step}`, `run_failed{message}`. The offline run itself is wandb's own
`<wandb_export_dir>/wandb/offline-run-*/` directory. This module only sees finite values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrograd.errors import ConfigError
from retrograd.observe.run_info import RunInfo

MISSING_WANDB = "[metrics].wandb_export_dir needs the wandb package: pip install 'retrograd[wandb]'"
PROJECT = "retrograd"


def import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(MISSING_WANDB) from e
    return wandb


class WandbExport:
    """Writes run.json, metrics.jsonl and an offline wandb run into `directory`."""

    def __init__(self, directory: str | Path, run_info: RunInfo, *, project: str = PROJECT):
        wandb = import_wandb()  # before touching the disk: a missing extra leaves nothing behind
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        metadata = run_info.to_dict()
        (self.directory / "run.json").write_text(json.dumps(metadata, indent=2) + "\n")
        # Appended: a resumed run continues the same log after its own run_started.
        self._events = open(self.directory / "metrics.jsonl", "a", encoding="utf-8")
        self._event({"event": "run_started", "metadata": metadata})
        # NOTE: console="off" keeps wandb from wrapping stdout under the live progress display.
        settings = wandb.Settings(console="off", silent=True)
        self._run = wandb.init(
            mode="offline",
            dir=str(self.directory),
            project=project,
            config=metadata,
            settings=settings,
        )
        self.run_dir = Path(self._run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def _event(self, record: dict[str, Any]) -> None:
        self._events.write(json.dumps(record) + "\n")
        self._events.flush()

    def step(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None:
        if not values:
            return
        listed = [{"name": name, "value": value} for name, value in values.items()]
        self._event({"event": "step", "epoch": epoch, "global_step": global_step, "values": listed})
        self._run.log(dict(values), step=global_step)

    def finish(self, global_step: int) -> None:
        self._event({"event": "run_finished", "global_step": global_step})
        self._events.close()
        self._run.finish(exit_code=0)

    def fail(self, message: str) -> None:
        self._event({"event": "run_failed", "message": message})
        self._events.close()
        self._run.finish(exit_code=1)
