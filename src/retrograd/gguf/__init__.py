"""GGUF files: reading (a facade over gguf-py), atomic writing, and the export of LoRA adapters
and of trained models or tensors. No torch. (Tensor names are matched by config/selectors.py.)"""

from retrograd.gguf.reader import FLOAT_TYPES, GGUFFile, TensorInfo, block_size

__all__ = ["FLOAT_TYPES", "GGUFFile", "TensorInfo", "block_size"]

from retrograd.gguf.lora_export import write_lora_adapter  # noqa: E402
from retrograd.gguf.writer import RawTensor, Typed, atomic_copy, atomic_path, write_gguf  # noqa: E402

__all__ += ["RawTensor", "Typed", "atomic_copy", "atomic_path", "write_gguf", "write_lora_adapter"]
