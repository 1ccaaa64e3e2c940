"""What a run shows while it trains: terminal progress and metric sinks (TensorBoard, W&B).

Loops build one `Metrics` and report steps, evaluations and checkpoint saves to it; metric names
live in `names`. `log.configure_logging` turns on the `retrograd` logger's stderr lines of
[run].verbose. The [observe] rollout directory (formats.md §6) is `rollouts.ObserveWriter`,
imported from its module (it reads the rollout records).
Importing this package imports neither torch nor wandb, and configures nothing.
"""

from retrograd.observe import names
from retrograd.observe.log import configure_logging
from retrograd.observe.memory import peak_memory
from retrograd.observe.metrics import Metrics
from retrograd.observe.run_info import RunInfo

__all__ = ["Metrics", "RunInfo", "configure_logging", "names", "peak_memory"]
