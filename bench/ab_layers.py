"""Interleaved A/B of a training pass through a model's first layers, in one process.

  .venv/bin/python bench/ab_layers.py [--size 1b] [--layers 4] [--rounds 8] [--threads 2]
                                      [--variant fused_lora]

bench/scale.py's Llama-shaped model of `--size` in the compute type the CPU runs fastest, the
dense cache on, LoRA r8 alpha 16 on q k v o gate up down: forward and backward of 512 tokens
through its first `--layers` layers (loss: the mean square of the output), with the switch
`--variant` off (A: the code as it was) and on (B), alternating A B B A A B ... so that both
see the same minutes of a busy machine. Prints each round's times, the median ratio A / B
(above 1: B is faster) and the ratio of the fastest of each (the least disturbed). Variants:
  fused_lora: frozen products and their adapters as one function (model/lora_product.py)
    against a frozen product plus `add_lora` per linear.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import contextlib
import statistics
import time


@contextlib.contextmanager
def fused_lora(on: bool):
    from retrograd.model import block, layers

    saved = block.fused_lora, layers.fused_lora
    if not on:
        block.fused_lora = layers.fused_lora = lambda x, linears: None
    try:
        yield
    finally:
        block.fused_lora, layers.fused_lora = saved


VARIANTS = {"fused_lora": fused_lora}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", default="fused_lora", choices=sorted(VARIANTS))
    args = p.parse_args()

    from bench.tuning import tune

    tune()
    import torch

    import retrograd
    from bench import scale, sft_sides
    from retrograd.model.decoder import ForwardContext
    from retrograd.model.device import cpu_has_fast_bf16
    from retrograd.trainable.lora import attach_lora

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    m = retrograd.load(str(scale.model_file(args.size)), device="cpu", dtype=dtype, cache="on")
    loras = attach_lora(m.decoder, sft_sides.OURS_TARGETS, sft_sides.RANK, sft_sides.ALPHA, 0)
    with torch.no_grad():
        for lora in loras.values():
            lora.lora_b.normal_(0, 0.01, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, sft_sides.CTX, m.config.n_embd, generator=gen).requires_grad_()
    blocks = m.decoder.blk[: args.layers]

    def run(on: bool) -> float:
        with VARIANTS[args.variant](on):
            t = time.perf_counter()
            ctx = ForwardContext(m.config, x.shape[1], 0, None, dtype, m.device, None, False, None)
            h = x
            for blk in blocks:
                h = blk(h, ctx)
            h.square().mean().backward()
            return time.perf_counter() - t

    run(False), run(True)  # compile the fused kernels, fill the cache
    ratios, times_a, times_b = [], [], []
    for r in range(args.rounds):
        a, b = (run(False), run(True)) if r % 2 == 0 else reversed((run(True), run(False)))
        ratios.append(a / b)
        times_a.append(a)
        times_b.append(b)
        print(f"round {r}: A {a:.3f} s, B {b:.3f} s, A/B {a / b:.3f}", flush=True)
    print(
        f"{args.variant}: median A/B {statistics.median(ratios):.3f} over {args.rounds} rounds "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); fastest A / fastest B "
        f"{min(times_a) / min(times_b):.3f}; {args.layers} layers of {args.size}, {dtype}, "
        f"{torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
