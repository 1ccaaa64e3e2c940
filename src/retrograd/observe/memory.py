"""Peak memory of this process, for the run summary: max RSS and, once CUDA was used, its peak.

Never imports torch: a process that did not import it did not use CUDA.
"""

from __future__ import annotations

import resource
import sys


def peak_memory() -> dict[str, int]:
    """Bytes: `max_rss` always, `cuda_max_allocated` when CUDA was initialised in this process."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = {"max_rss": rss if sys.platform == "darwin" else rss * 1024}  # Linux counts KiB
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated())
    return peak


def format_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


def describe(peak: dict[str, int]) -> str:
    """`1.20 GiB RSS, 3.40 GiB CUDA` for the summary table."""
    parts = [f"{format_bytes(peak['max_rss'])} RSS"]
    if "cuda_max_allocated" in peak:
        parts.append(f"{format_bytes(peak['cuda_max_allocated'])} CUDA")
    return ", ".join(parts)
