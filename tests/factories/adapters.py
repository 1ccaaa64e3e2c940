"""LoRA adapters written with gguf-py directly, independent of our own writer (an oracle input)."""

from __future__ import annotations

import gguf
import numpy as np

from retrograd.gguf import GGUFFile


def write_adapter(path, model_path, targets, rank=4, alpha=8.0, seed=0, arch=None):
    g = GGUFFile(model_path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch or g.architecture)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name in targets:
        n_out, n_in = g.tensor(name).shape
        w.add_tensor(name + ".lora_a", (rng.standard_normal((rank, n_in)) * 0.1).astype(np.float32))
        w.add_tensor(
            name + ".lora_b", (rng.standard_normal((n_out, rank)) * 0.1).astype(np.float16)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
