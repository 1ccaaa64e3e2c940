"""Retrograd: fine-tune and reinforcement-train GGUF models as they are.

Public API (docs/python.md): `load` opens a model, `load_tokenizer` a vocabulary alone.
Importing this package imports nothing heavy; torch loads on first use.
"""

__version__ = "0.1.0"


def load(path, device="auto", dtype=None, adapter=None, threads=None, cache="auto"):
    from retrograd.model.model import load as _load

    return _load(path, device=device, dtype=dtype, adapter=adapter, threads=threads, cache=cache)


def load_tokenizer(path):
    from retrograd.tokenizer import load_tokenizer as _load_tokenizer

    return _load_tokenizer(path)


__all__ = ["__version__", "load", "load_tokenizer"]
