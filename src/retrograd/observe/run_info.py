"""What a run is, as the metric sinks describe it: W&B's config and `run.json` (formats.md §7.1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RunInfo:
    """The run.json fields. Rollout algorithms put their update count in `epochs`."""

    algorithm: str
    model: str
    train_data: str
    eval_data: str | None = None
    epochs: int | None = None
    learning_rate: float | None = None
    scheduler: str | None = None
    warmup_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
