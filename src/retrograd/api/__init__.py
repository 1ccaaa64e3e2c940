"""The Python door to training (docs/python.md, "Training from Python"): `Trainer`, a model
held between fits whose configuration is the run file's section classes, and `RolloutGroup`,
one group of a caller's own rollouts for `Trainer.train_grpo_batch`.

The command line (cli/train.py), the run server (server/child.py) and this package differ
only in the Door they pass to the algorithm table's loops (algorithms/door.py); nothing here
trains by a loop of its own. Importing it loads pydantic but not torch.
"""

from retrograd.api.batch import RolloutGroup
from retrograd.api.trainer import Trainer, list_backends

__all__ = ["RolloutGroup", "Trainer", "list_backends"]
