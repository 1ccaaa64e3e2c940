"""Build a teacher for the distillation examples: a GGUF model with a LoRA adapter merged in.

  python examples/distill/make_teacher.py BASE.gguf ADAPTER.gguf OUT.gguf [--scale S]

Every tensor the adapter touches becomes W + S (alpha / r) B A in float32 (its base weight
dequantized by gguf-py); every other tensor, and all metadata (tokenizer and chat template
included), is copied as it is. The teacher therefore shares the student's tokenizer, as
[distill].teacher_path requires, and llama.cpp runs it as it runs the base model. --scale
above 1 exaggerates what the adapter learned (a teacher further from the student).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def merge(base: Path, adapter: Path, out: Path, scale: float = 1.0) -> int:
    """Write base + adapter to `out` (through a temporary name); -> tensors merged."""
    b, a = GGUFReader(base), GGUFReader(adapter)
    alpha = float(a.fields["adapter.lora.alpha"].contents())
    pairs = {t.name: t for t in a.tensors}
    arch = b.fields["general.architecture"].contents()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    w = GGUFWriter(str(tmp), arch)
    for name, field in b.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)
    merged = 0
    for t in b.tensors:
        lora_a, lora_b = pairs.get(t.name + ".lora_a"), pairs.get(t.name + ".lora_b")
        if lora_a is None or lora_b is None:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        weight = dequantize(t.data, t.tensor_type).astype(np.float32)  # (n_out, n_in)
        A = dequantize(lora_a.data, lora_a.tensor_type).astype(np.float32)  # (r, n_in)
        B = dequantize(lora_b.data, lora_b.tensor_type).astype(np.float32)  # (n_out, r)
        rank = B.shape[1]
        weight = weight + scale * (alpha / rank if alpha else 1.0) * (B @ A)
        w.add_tensor(t.name, weight, raw_dtype=GGMLQuantizationType.F32)
        merged += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return merged


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("adapter", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the adapter's update")
    args = p.parse_args()
    n = merge(args.base, args.adapter, args.out, args.scale)
    print(f"wrote {args.out}: {n} tensors merged")


if __name__ == "__main__":
    main()
