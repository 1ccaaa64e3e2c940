"""The process tuning every side of a benchmark gets: what a Retrograd process gives itself.

Importing retrograd turns on transparent huge pages for PyTorch's large CPU buffers
(THP_MEM_ALLOC_ENABLE=1, which PyTorch reads once, at its first allocation), and loading a
model sets glibc's allocator thresholds (`configure_allocator`: freed large blocks stay in the
process), and importing it sets OpenMP's wait policy (retrograd/threads.py: PASSIVE unless the
caller's environment chose one). A peer measured without them takes page faults we do not, or
spins where we sleep, so a benchmark gives every process of every side the same settings
through `tune`, called before torch is imported. Knows nothing about the sides it tunes.
"""

from __future__ import annotations

import os
import sys

# What `import retrograd` sets (src/retrograd/__init__.py), forced on rather than defaulted, so
# that a caller's environment cannot give one side a different setting.
ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def tune() -> str:
    """Apply our process tuning to this process; return what was applied, for the report."""
    if "torch" in sys.modules:
        raise RuntimeError("bench.tuning.tune() must run before torch is imported")
    os.environ.update(ENV)
    # the very functions `import retrograd` and our model loader call, so every side gets the
    # same wait policy and mallopt values
    from retrograd.model.device import configure_allocator
    from retrograd.threads import apply_wait_policy, wait_policy

    apply_wait_policy()
    configure_allocator()
    thp = os.environ["THP_MEM_ALLOC_ENABLE"]
    return (
        f"THP_MEM_ALLOC_ENABLE={thp}, glibc mallopt as retrograd's loader sets it, "
        f"OpenMP wait policy {wait_policy()}"
    )
