"""Where a GRPO optimizer pass's time goes: torch.profiler over the pass of bench/scale.py's
update, by share.

  .venv/bin/python bench/profile_grpo.py [--size 1b] [--threads 2] [--updates 2]
                                         [--no-profile] [--trace OUT.json] [--json OUT]

The update bench/scale.py times (4 prompts x 8 answers x 64 new tokens, LoRA r8 alpha 16 on
q k v o gate up down, one pass, one AdamW step; the compute type the CPU runs fastest; the
dense cache on) on its Llama-shaped model of `--size` (built by bench/scale.py --build-only).
The first update is a warm-up; the optimizer passes (forward, loss, backward and the AdamW step:
`policy.train`) of the next `--updates` are profiled, and their operators' own time goes to
bench/profile_sft.py's shares (frozen products, output head, attention, LoRA, element-wise,
dequantization, optimizer, other operators; the rest of the pass's wall time is Python). A
2048^3 product in the compute type is probed after each pass (best of 3), and MFU is the pass's
FLOPs a second over the best probe, as bench/scale.py counts them: 4 x the layers' matrices over
every position the pass runs (each group's prompt once, then its answers) and 4 x the output
product over the answer tokens it scores (also printed: counting the answer tokens alone).
--no-profile: the MFU alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import os
import tempfile
import time
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="1b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--updates", type=int, default=2, help="profiled updates after the warm-up")
    p.add_argument("--no-profile", action="store_true", help="MFU only")
    p.add_argument("--trace", help="write a Chrome trace here")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()

    from bench.tuning import tune

    tune()
    os.environ.setdefault("RETRO_DEQUANT_CACHE", "1")
    import torch

    from bench import profile_sft, scale, scale_sides
    from retrograd.algorithms import policy

    model = scale.model_file(args.size)
    if not model.exists():
        sys.exit(f"{model}: build it first (bench/scale.py --build-only --sizes {args.size})")
    profile_sft.label_forward()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)
    passes: list[dict] = []
    rates: list[float] = []
    train = policy.train

    def timed(run, backend, own, *rest, **kw):
        profiled = len(passes) >= 1 and not args.no_profile
        if profiled:
            prof.start()
        t = time.perf_counter()
        out = train(run, backend, own, *rest, **kw)
        seconds = time.perf_counter() - t
        if profiled:
            prof.stop()
        passes.append({"s": seconds, "answer": sum(r.n_tokens for r in own)})
        rates.append(profile_sft.matmul_rate())
        return out

    policy.train = timed
    with tempfile.TemporaryDirectory(prefix="bench-profile-grpo-") as workdir:
        ns = SimpleNamespace(
            model=str(model), size=args.size, workdir=workdir, threads=args.threads,
            prompts=4, group=8, new=64, ctx=1024, warmup_updates=args.updates,
        )  # fmt: skip
        counted = scale_sides.worker_grpo(ns)["positions"]  # scale.py's count, per pass
    for x, n in zip(passes, counted, strict=True):
        x["all"] = n
    timed_passes = passes[1:]
    wall_us = sum(x["s"] for x in timed_passes) * 1e6
    out = {} if args.no_profile else profile_sft.table(prof, wall_us, len(timed_passes))
    shape = scale.SHAPES[args.size]
    rate = max(rates) * 1e12
    seconds = sum(x["s"] for x in timed_passes)
    answers = sum(x["answer"] for x in timed_passes)
    positions = sum(x["all"] for x in timed_passes)
    flops = 4 * (positions * shape.block_params() + answers * shape.head_params())
    out["mfu"], out["tok_s"] = flops / seconds / rate, answers / seconds
    out["mfu_answers_only"] = answers * scale.flops_per_token(shape) / seconds / rate
    out |= {"passes": passes, "rate_tflops": max(rates), "threads": torch.get_num_threads()}
    print(
        f"{args.size}: optimizer pass {seconds / len(timed_passes):.2f} s "
        f"({len(timed_passes)} timed; {timed_passes[0]['answer']} answer tokens, "
        f"{timed_passes[0]['all']} positions); matmul {max(rates):.3f} TFLOP/s"
    )
    print(
        f"MFU {out['mfu']:.1%} (the layers' products over every position, the head's over the "
        f"answers; {out['mfu_answers_only']:.1%} counting answer tokens alone), "
        f"{out['tok_s']:.1f} answer tok/s"
        + ("" if args.no_profile else "; profiler on, so on the low side")
    )
    profile_sft.finish(out, prof, args)


if __name__ == "__main__":
    main()
