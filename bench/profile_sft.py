"""Where an SFT step's time goes: torch.profiler over a few steps of `run_sft`, by share.

  .venv/bin/python bench/profile_sft.py [--size 1b] [--threads 2] [--warmup 2] [--steps 3]
                                        [--no-profile] [--trace OUT.json] [--json OUT]

The step bench/scale.py times (ctx 512, batch 1, LoRA r8 alpha 16 on q k v o gate up down,
AdamW, the compute type the CPU runs fastest, the dense cache on) on its Llama-shaped model of
`--size` (built by bench/scale.py --build-only), profiled over `--steps` steps after `--warmup`.
Every profiled operator's own time goes to one share, by the first of these that encloses it:
  - frozen products: forward and backward of the frozen weights' products (model/frozen.py;
    with the adapters' products where they run in one function, model/lora_product.py)
  - output head: the tiled cross-entropy's products and softmax (model/logprobs.py)
  - attention: scores, softmax and output products, forward and backward (model/attention.py)
  - LoRA: the adapters' small products and their gradients where autograd runs them
    (model/layers.py `add_lora`)
  - element-wise: the fused kernels (norms, RoPE, activation, residual sums) and eager casts
  - dequantization: dense copies made on use (none once the cache holds every weight)
  - optimizer: AdamW's step and zeroing the gradients
  - other operators: whatever operator none of the above enclosed
and the rest of the steps' wall time, outside any operator, is Python (the loop, autograd's
bookkeeping, the profiler's own cost). The forward passes are labelled by wrapping a few
functions in this process only; backward by autograd's node names. Shares, not absolute
times, are what a contended machine still measures. Between the steps a 2048^3 product in the compute type
is probed (best of 3 each time), and MFU is tokens/s (the median profiled step) x bench/scale.py's
FLOPs per trained token over the best probe. --no-profile: MFU alone (the profiler's events of
a 3B step take gigabytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import collections
import functools
import json
import tempfile
import time

SHARES = (
    "frozen products",
    "output head",
    "attention",
    "LoRA",
    "element-wise",
    "dequantization",
    "optimizer",
    "other operators",
    "Python and overhead",
)
# label or autograd node (substring) -> share; the first enclosing match wins
RULES = (
    ("retro::probe", None),
    ("retro::frozen", "frozen products"),
    ("_FrozenGroupBackward", "frozen products"),
    ("_FrozenLinearBackward", "frozen products"),
    ("_FrozenLoRABackward", "frozen products"),
    ("retro::head", "output head"),
    ("_TiledHeadCEBackward", "output head"),
    ("retro::attention", "attention"),
    ("_AttentionBackward", "attention"),
    ("retro::lora", "LoRA"),
    ("AddmmBackward", "LoRA"),
    ("MmBackward", "LoRA"),
    ("retro::dequant", "dequantization"),
    ("Optimizer.", "optimizer"),
    ("Optimizer.zero_grad", "optimizer"),
    ("CompiledFunction", "element-wise"),
    ("Torch-Compiled Region", "element-wise"),
    ("retro::fused", "element-wise"),
)
ELEMENTWISE_OPS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::add", "aten::mul")


def label(owner, name: str, tag: str) -> None:
    """Wrap owner.name in a profiler label (staticmethods stay static)."""
    import torch

    raw = owner.__dict__[name]
    static = isinstance(raw, staticmethod)
    fn = raw.__func__ if static else raw

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(tag):
            return fn(*args, **kwargs)

    setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def label_forward() -> None:
    from retrograd.model import attention, block, frozen, layers, logprobs

    label(frozen._FrozenGroup, "forward", "retro::frozen")
    label(frozen._FrozenLinear, "forward", "retro::frozen")
    try:  # a tree from before the fused adapters (an A/B against it) has none
        from retrograd.model import lora_product

        label(lora_product._FrozenLoRA, "forward", "retro::frozen")
    except ImportError:
        pass
    label(frozen.FrozenTensor, "dequantize", "retro::dequant")
    label(logprobs._TiledHeadCE, "forward", "retro::head")
    label(attention._Attention, "forward", "retro::attention")
    label(layers, "add_lora", "retro::lora")
    for name in ("_prep_both", "_norm_cast", "_add_norm", "_add_norm_norm", "_act_mul_rows"):
        label(block, name, "retro::fused")


def share_of(event) -> str:
    e = event
    while e is not None:
        for key, share in RULES:
            if key in e.name:
                return share
        e = e.cpu_parent
    name = event.name
    if name.startswith(ELEMENTWISE_OPS):
        return "element-wise"
    return "other operators" if name.startswith("aten::") else "Python and overhead"


def table(prof, wall_us: float, steps: int) -> dict:
    own = collections.Counter()
    ops = collections.defaultdict(collections.Counter)  # share -> operator -> own time
    for e in prof.events():
        if e.device_type.name != "CPU":
            continue
        share = share_of(e)
        if share is None:  # the matmul probe between steps
            continue
        own[share] += e.self_cpu_time_total
        ops[share][e.name] += e.self_cpu_time_total
    inside = sum(v for k, v in own.items() if k != "Python and overhead")
    own["Python and overhead"] = max(0.0, wall_us - inside)
    return {
        "step_s": wall_us / steps / 1e6,
        "shares": {k: own[k] / wall_us for k in SHARES},
        "top_ops": {
            k: {name: t / wall_us for name, t in ops[k].most_common(5)} for k in SHARES if ops[k]
        },
    }


def matmul_rate(n: int = 2048, reps: int = 3) -> float:
    """The best of `reps` n^3 products in the compute type (bf16 where the CPU has fast bf16,
    else float32), TFLOP/s (bench/forward.py's probe, run between the steps so that the rate
    and the steps see the same machine)."""
    import torch

    from retrograd.model.device import cpu_has_fast_bf16

    dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    with torch.profiler.record_function("retro::probe"):
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def mfu(fpt: int, times: list[float], rates: list[float]) -> dict:
    """Tokens/s from the median step, MFU against the best probe."""
    import statistics

    from bench.sft_sides import CTX

    tok_s = CTX / statistics.median(times)
    rate = max(rates)
    return {"tok_s": tok_s, "rate_tflops": rate, "mfu": tok_s * fpt / (rate * 1e12)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="1b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (>= 1)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--no-profile", action="store_true", help="MFU only (3B+: the profiler's events take GBs)"
    )
    p.add_argument("--trace", help="write a Chrome trace here")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()

    from bench.tuning import tune

    tune()
    import torch

    from bench import scale, sft, sft_sides
    from retrograd.algorithms.sft import run_sft
    from retrograd.config import load_run
    from retrograd.observe.sinks import Sinks

    model = scale.model_file(args.size)
    if not model.exists():
        sys.exit(f"{model}: build it first (bench/scale.py --build-only --sizes {args.size})")
    sft.gemma = sft_sides.gemma = lambda: model
    label_forward()
    total = args.warmup + args.steps
    ends: list[float] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    info: dict = {}

    resumes: list[float] = []
    rates: list[float] = []

    class Clock(Sinks):
        def start(self, start):
            super().start(start)
            info.update(dtype=str(start.dtype), cache=start.backend)

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            if tokens == sft_sides.CTX and len(ends) < total:
                ends.append(time.perf_counter())
                if len(ends) == total and not args.no_profile:
                    prof.stop()
                rates.append(matmul_rate())  # between the steps, outside their times
                if len(ends) == args.warmup and not args.no_profile:
                    prof.start()
                resumes.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="bench-profile-") as workdir:
        sft.write_corpus(Path(workdir), total + 1)
        run_file = sft_sides.write_run_file(Path(workdir), args.threads)
        run_sft(load_run(run_file), sinks=Clock(quiet=True))
    times = [b - a for a, b in zip(resumes, ends[1:], strict=False)]
    wall_us = sum(times[args.warmup - 1 :]) * 1e6
    out = {} if args.no_profile else table(prof, wall_us, args.steps)
    out |= info | {"threads": torch.get_num_threads(), "step_s": wall_us / args.steps / 1e6}
    fpt = scale.flops_per_token(scale.SHAPES[args.size])
    out |= mfu(fpt, times[args.warmup - 1 :], rates)
    times = [round(t, 2) for t in times]
    out["step_times"] = times
    print(
        f"MFU {out['mfu']:.1%}: {out['tok_s']:.1f} tok/s x {fpt / 1e9:.2f} GFLOP / matmul "
        f"{out['rate_tflops']:.3f} TFLOP/s (2048^3, best of {len(rates)} probes between steps; "
        f"{'profiler on, so the MFU is on the low side' if not args.no_profile else 'no profiler'})"
    )
    print(
        f"{args.size}: {out['step_s']:.2f} s a step ({args.steps} profiled); steps {times}; {info}"
    )
    finish(out, prof, args)


def finish(out: dict, prof, args) -> None:
    """Print the shares and each one's heaviest operators; write --trace and --json."""
    for k, v in out.get("shares", {}).items():
        print(f"  {k:<22} {v:6.1%}")
    for share, ops in out.get("top_ops", {}).items():
        print(f"  {share}: " + ", ".join(f"{k} {v:.1%}" for k, v in ops.items()))
    if args.trace and not args.no_profile:
        prof.export_chrome_trace(args.trace)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
