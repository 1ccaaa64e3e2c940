"""GGUF files: reading (facade over gguf-py), and later writing and tensor-name grammar. No torch."""

from retrograd.gguf.reader import FLOAT_TYPES, GGUFFile, TensorInfo, block_size

__all__ = ["FLOAT_TYPES", "GGUFFile", "TensorInfo", "block_size"]
