"""Tiny models for the sampler's tests, loaded once per session in float32."""

from __future__ import annotations

import pytest
import torch

import retrograd


@pytest.fixture(scope="session")
def models(tiny_model):
    """models(name) -> the tiny `name` model (tests/factories/tiny_gguf.py), float32 compute."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
        return cache[name]

    return get
