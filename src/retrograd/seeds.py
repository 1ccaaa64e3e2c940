"""The one seed derivation: (run seed, purpose, update, prompt, sample) -> seed.

Every random choice of a run (LoRA initialisation, data shuffles, sampling of each answer,
resampling, collect) takes its seed from `derive_seed`, so that a run repeats exactly and one
answer's randomness never depends on what else is computed beside it (the rest of its batch,
the number of workers). The derivation is a hash, not a counter: adding a consumer does not
shift anyone else's stream. Nothing here imports torch at module level.
"""

from __future__ import annotations

import hashlib

# Purposes used across the package; any string works, these keep the spelling in one place.
LORA_INIT = "lora_init"
SHUFFLE = "shuffle"
SAMPLE = "sample"
RESAMPLE = "resample"
COLLECT = "collect"

_MASK = (1 << 63) - 1  # non-negative, fits torch.Generator.manual_seed and numpy


def derive_seed(
    run_seed: int, purpose: str, update: int = 0, prompt: int = 0, sample: int = 0
) -> int:
    """A 63-bit seed for one consumer, a pure function of its coordinates.

    run_seed: the seed the run file or request gives; purpose: what the randomness is for;
    update, prompt, sample: where in the run (update number, prompt index, answer index).
    """
    key = f"retrograd|{int(run_seed)}|{purpose}|{int(update)}|{int(prompt)}|{int(sample)}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def torch_generator(seed: int, device="cpu"):
    """A torch.Generator seeded with `seed` on `device` (CPU by default)."""
    import torch

    return torch.Generator(device=device).manual_seed(seed)
