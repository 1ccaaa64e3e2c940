"""The one seed derivation: stable, distinct per coordinate, usable by torch and numpy."""

from __future__ import annotations

import torch

from retrograd.seeds import SAMPLE, derive_seed, torch_generator


def test_seed_is_a_pure_function_of_its_coordinates():
    assert derive_seed(42, SAMPLE, 1, 2, 3) == derive_seed(42, SAMPLE, 1, 2, 3)
    # a golden value: changing the derivation changes every run's randomness
    assert derive_seed(0, SAMPLE) == derive_seed(0, "sample", 0, 0, 0)
    assert 0 <= derive_seed(2**40, "x", 9, 9, 9) < 2**63


def test_each_coordinate_changes_the_seed():
    base = (7, SAMPLE, 1, 2, 3)
    seen = {derive_seed(*base)}
    for i, other in enumerate((8, "shuffle", 4, 5, 6)):
        coords = list(base)
        coords[i] = other
        seen.add(derive_seed(*coords))
    assert len(seen) == 6
    # neighbouring coordinates do not collide by shifting (update 1, prompt 12 vs 11, 2)
    assert derive_seed(7, SAMPLE, 1, 12) != derive_seed(7, SAMPLE, 11, 2)


def test_generator_streams_repeat():
    s = derive_seed(3, SAMPLE, sample=1)
    a = torch.rand(4, generator=torch_generator(s))
    b = torch.rand(4, generator=torch_generator(s))
    assert torch.equal(a, b)
