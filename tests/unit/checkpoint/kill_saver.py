"""Save checkpoints in a loop until killed: step-N for N = start, start + 1, ..., and best each time.

Usage: python kill_saver.py DIRECTORY START. Prints "saved N" after each pair lands.
"""

from __future__ import annotations

import sys

from retrograd.checkpoint import save_checkpoint, step_id
from tests.unit.checkpoint.sample_state import make_state


def main() -> None:
    directory, step = sys.argv[1], int(sys.argv[2])
    while True:
        state = make_state(step, seed=step, optimizer_bytes=2 << 20)
        save_checkpoint(directory, step_id(step), state)
        save_checkpoint(directory, "best", state)
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
