"""Dequantization throughput per ggml type, against gguf-py's numpy dequantizer.

    python bench/dequant.py [--device cpu|cuda] [--threads N] [--types Q4_K,Q8_0] [--repeat 20]

For each type, one 2048 x 640 weight matrix (640 x 2048 for 256-element blocks, whose rows
must hold whole blocks) is dequantized to float32 and to bfloat16. Prints the median time,
the rate in GB/s of float32 written (and of file bytes read), and the speed-up over gguf-py.
On a shared machine, `--threads 1` gives the steadiest figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from retrograd.model.dequant import SUPPORTED, dequantize


def make_bytes(qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """Real quantized bytes where gguf-py can quantize the type, random bytes otherwise."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(shape, dtype=np.float32) * 0.02
    try:
        return np.ascontiguousarray(quants.quantize(weights, qtype)).view(np.uint8).reshape(-1)
    except NotImplementedError:
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        n = shape[0] * shape[1] // per_block * block_bytes
        return rng.integers(0, 256, size=n, dtype=np.uint8)


def timed(fn, repeat: int, sync) -> float:
    fn()  # warm-up: builds the per-device tables
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_type(qtype: GGMLQuantizationType, device: torch.device, repeat: int, sync) -> str:
    shape = (640, 2048) if GGML_QUANT_SIZES[qtype][0] == 256 else (2048, 640)
    raw = make_bytes(qtype, shape)
    data = torch.from_numpy(raw).to(device)
    t32 = timed(lambda: dequantize(data, qtype, shape), repeat, sync)
    t16 = timed(lambda: dequantize(data, qtype, shape, torch.bfloat16), repeat, sync)
    rows = raw.reshape(shape[0], -1)
    t_ref = timed(lambda: quants.dequantize(rows, qtype), max(3, repeat // 5), lambda: None)
    n = shape[0] * shape[1]
    return (
        f"{qtype.name:8} {t32 * 1e3:8.3f} {n * 4 / t32 / 1e9:9.2f} {raw.size / t32 / 1e9:8.2f} "
        f"{t16 * 1e3:8.3f} {t_ref / t32:9.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("--types", default="", help="comma-separated ggml type names (default all)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = args.types.split(",") if args.types else [t.name for t in sorted(SUPPORTED)]
    print(f"device {device}, {torch.get_num_threads()} threads, median of {args.repeat}")
    print(
        f"{'type':8} {'f32 ms':>8} {'GB/s out':>9} {'GB/s in':>8} {'bf16 ms':>8} {'x gguf-py':>9}"
    )
    with np.errstate(all="ignore"):  # random bytes make NaN scales in gguf-py's run
        for name in names:
            print(bench_type(GGMLQuantizationType[name], device, args.repeat, sync), flush=True)


if __name__ == "__main__":
    main()
