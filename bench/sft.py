"""SFT speed and memory on Gemma 3 270M Q4_K_M: Retrograd against its peers, one run.

  .venv/bin/python bench/sft.py [--threads 2] [--steps 6] [--warmup 2]
                                [--trl bf16w,bf16w+gc,autocast+gc,autocast,f32] [--loop bf16w]
                                [--rest 20] [--rounds 3]

Every side trains the same LoRA (rank 8, alpha 16, q k v o gate up down, no dropout), with AdamW
(weight decay 0) at a constant lr 1e-4 and gradient clipping at 1.0, on the same windows of 512
token ids (batch 1, loss on every token after the first), tokenized once by our tokenizer from a
text made of tests/data/varied.txt. Each side runs in its own process, so that its peak memory is
its own, and every process gets the process tuning ours gives itself (bench/tuning.py:
transparent huge pages for PyTorch's buffers, glibc's allocator thresholds), always:
  - TRL: SFTTrainer on the GGUF loaded through transformers, with PEFT's LoRA, one process per
    variant (bench/sft_sides.py): bf16w (bf16 weights, transformers' fastest offer on a CPU
    with fast bf16), autocast (float32 weights under bf16 autocast, SFTConfig's default) or
    f32, with or without gradient checkpointing (+gc; TRL turns it on by default); +eager for
    eager attention. Where the CPU has no fast bf16 (no AVX512-BF16 or AMX) the defaults are
    f32 and f32+gc: bf16 would run on PyTorch's scalar fallback, and ours computes in f32 there;
  - loop: a plain PEFT + torch loop on the same model (forward with labels, backward, clip,
    fused AdamW step; no Trainer), the same variants, by default bf16w (f32 without fast bf16);
  - ours: `run_sft`, the loop `retrograd train` runs, from a run file (defaults otherwise);
  - the machine's matmul rates (best of 10 torch.mm 2048^3, bf16 and f32), the faster of them
    for model FLOPs utilization;
  - whether transformers' GGUF tokenizer gives our token ids for the text.
Nothing is downloaded (HF_HUB_OFFLINE=1). Step time is the median wall time between the ends of
consecutive timed steps (everything the loop does, data and optimizer included; SFTTrainer is
timed by a callback at each step's end). Peak RSS is ru_maxrss at the end of the process (model
loading included); "train peak" is the high-water mark since training began (Linux VmHWM, reset
through /proc/self/clear_refs). The first round runs every variant and ours; each later round
runs the fastest peer (TRL or the loop, the goal's denominator) and ours again, back to back, and
the speed goal reads the median of the rounds' ratios (the machine's speed drifts over minutes).
Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module for scripts run
# from this folder; put the repository root first instead of the script's folder.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

from bench.forward import worker_matmul  # noqa: E402  the machine's matmul rates, one way
from bench.sft_sides import (
    CTX,
    RANK,
    gemma,
    parse_variant,
    worker_loop,
    worker_ours,
    worker_tokenizer,
    worker_trl,
)
from bench.tuning import tune
from retrograd.model.device import cpu_has_fast_bf16

# The peers' variants by default, as the CPU allows: with fast bf16 (AVX512-BF16 or AMX) every
# offer, f32 for reference; without it bf16 products run on PyTorch's scalar fallback (a step
# would take hours), so every side, ours included, computes in float32.
DEFAULTS = {
    True: ("bf16w,bf16w+gc,autocast+gc,autocast,f32", "bf16w"),
    False: ("f32,f32+gc", "f32"),
}


# -- data ------------------------------------------------------------------------------------


def write_corpus(workdir: Path, windows: int, ctx: int = CTX) -> list[list[int]]:
    """A text file that our loader cuts into `windows` full windows of `ctx` ids (plus a short
    tail); returns those full windows, as `retrograd train` will see them."""
    import retrograd
    from retrograd.data.sft import load_sft_data

    tok = retrograd.load_tokenizer(str(gemma()))
    lines = (ROOT / "tests/data/varied.txt").read_text(encoding="utf-8").splitlines(True)
    need = windows * (ctx - 1) + 1  # windows overlap by one token
    text, i = "", 0
    while len(tok.tokenize(text)) < need:
        text += "".join(lines[i % len(lines) : i % len(lines) + 8])
        i += 8
    path = workdir / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    data = load_sft_data(path, tok, ctx, "text")
    full = [list(e.ids) for e in data.examples if len(e.ids) == ctx]
    assert len(full) >= windows, (len(full), windows)
    (workdir / "windows.json").write_text(json.dumps(full[:windows]))
    return full[:windows]


# -- driver ----------------------------------------------------------------------------------

SIDES = {"trl": "TRL", "loop": "loop"}  # peer kinds as the report names them


def run_worker(kind: str, args, variant: str = "") -> dict:
    # NOTE: each side starts from an idle machine: right after a 90-second TRL run our steps
    # measured 10% slower than after a pause (the host's clock and caches settle).
    time.sleep(args.rest)
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--worker", kind, "--variant", variant, "--workdir"]
    cmd += [args.workdir, "--threads", str(args.threads), "--warmup", str(args.warmup)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"worker {kind} {variant} failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"  {kind} {variant}: {time.perf_counter() - t:.0f} s, load before {load:.2f}", flush=True
    )
    return res | {"load": load}


def row(name: str, r: dict, peak: float, flops: float) -> str:
    hwm = f"{r['train_peak_mib']:7.0f}" if r["train_peak_mib"] is not None else "      ?"
    return (
        f"{name:<22} {r['tok_s']:7.1f} {r['step_s']:7.2f} ({r['min_s']:.2f}-{r['max_s']:.2f})"
        f" {r['maxrss_mib']:8.0f} {hwm} {r['tok_s'] * flops / peak:6.1%} {r['first_loss']:7.3f}"
        f" {r['load']:5.2f}"
    )


def against(ours: dict, name: str, r: dict) -> str:
    """Our speed and memory as multiples of one peer's."""
    train = (
        f"{ours['train_peak_mib'] / r['train_peak_mib']:.2f}x"
        if ours["train_peak_mib"] and r["train_peak_mib"]
        else "?"
    )
    return (
        f"ours / {name}: {ours['tok_s'] / r['tok_s']:.2f}x tokens/s "
        f"at {ours['maxrss_mib'] / r['maxrss_mib']:.2f}x its peak RSS (train peak {train})"
    )


def report(args, res: dict) -> None:
    from bench.forward import model_flops_per_token

    _, flops = model_flops_per_token(CTX)
    rates = res["matmul"]["tflops"]
    fastest = max(rates, key=rates.get)  # the physical limit: the fastest product the CPU has
    peak = rates[fastest] * 1e12
    tk = res["tokenizer"]
    print(
        f"\nGemma 3 270M Q4_K_M, SFT LoRA rank {RANK} on 7 projections, AdamW, ctx {CTX}, "
        f"batch 1, {args.threads} threads, {args.steps} timed steps after {args.warmup}"
    )
    print(
        "machine matmul (best of 10 at 2048^3, or one 512^3 probe where slow): "
        + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in rates.items())
        + f"; MFU against {fastest}; model FLOPs per trained token {flops / 1e9:.2f} GFLOP"
    )
    print(
        f"tokenizer: transformers' GGUF tokenizer {'matches' if tk['equal'] else 'DIFFERS from'}"
        f" ours on the corpus ({tk['ours']} / {tk['theirs']} ids, BOS aside"
        + (f", first difference at {tk['first']})" if not tk["equal"] else ")")
    )
    tunings = sorted({r["tuning"] for k, r in res.items() if k not in ("rounds",)})
    print("process tuning, every side: " + " | ".join(tunings))
    print(
        "peers: bf16w = bf16 weights; autocast = float32 weights under bf16 autocast; "
        "f32 = float32; +gc = gradient checkpointing; +eager = eager attention"
    )
    print(
        "side                     tok/s  step s (min-max)  peak MiB train MiB    MFU  loss@1  load"
    )
    peers = {k: v for k, v in res.items() if k.split()[0] in SIDES}
    for key, r in peers.items():
        kind, variant = key.split()
        print(row(f"{SIDES[kind]} {variant}", r, peak, flops))
    ours = res["ours"]
    print(row(f"retrograd ({ours['dtype'].replace('torch.', '')})", ours, peak, flops))
    for kind, side in SIDES.items():
        mine = {k: r for k, r in peers.items() if k.split()[0] == kind}
        if mine:
            key, r = max(mine.items(), key=lambda kv: kv[1]["tok_s"])
            print(against(ours, f"{side} {key.split()[1]} ({side}'s fastest)", r))
    best = res["rounds"]["peer"]
    kind, variant = best.split()
    print(
        against(ours, f"{SIDES[kind]} {variant} (the fastest peer)", peers[best])
        + f"; goal >= 5x tokens/s, <= 1x peak RSS; our MFU {ours['tok_s'] * flops / peak:.1%}"
        " (goal >= 30%)"
    )
    pairs = res["rounds"]["pairs"]
    ratios = [o["tok_s"] / t["tok_s"] for t, o in pairs]
    print(
        f"rounds, {SIDES[kind]} {variant} then ours back to back: "
        + ", ".join(
            f"{t['tok_s']:.1f} vs {o['tok_s']:.1f} = {r:.2f}x"
            for (t, o), r in zip(pairs, ratios, strict=True)
        )
        + f"; median {statistics.median(ratios):.2f}x (goal >= 5x)"
    )
    lean, r = min(peers.items(), key=lambda kv: kv[1]["maxrss_mib"])
    print(against(ours, f"{SIDES[lean.split()[0]]} {lean.split()[1]} (the leanest peer)", r))
    for key, r in peers.items():
        print(f"  {key}: attention {r['attention']}, {r['optimizer']}, {r['threads']} threads")
    print(f"  retrograd: {ours['cache']}, {ours['threads']} threads")


def variants(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps (windows) per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    trl, loop = DEFAULTS[cpu_has_fast_bf16()]
    p.add_argument("--trl", default=trl, help="SFTTrainer variants, comma-separated")
    p.add_argument("--loop", default=loop, help="plain loop variants, comma-separated")
    p.add_argument("--rest", type=float, default=20.0, help="idle seconds before each side")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the fastest peer and ours")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        tuning = tune()  # every worker, ours included, before torch: the same process tuning
        fn = {
            "matmul": worker_matmul,
            "tokenizer": worker_tokenizer,
            "trl": worker_trl,
            "loop": worker_loop,
            "ours": worker_ours,
        }[args.worker]
        print(json.dumps(fn(args) | {"tuning": tuning}))
        return
    assert args.warmup >= 1, "--warmup must be at least 1: a step's time needs the previous end"
    assert args.rounds >= 1, "--rounds must be at least 1"
    peers = [("trl", v) for v in variants(args.trl)] + [("loop", v) for v in variants(args.loop)]
    assert peers, "--trl and --loop name no variant"
    for _, v in peers:
        parse_variant(v)  # a typo fails now, not after minutes of measuring
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as workdir:
        args.workdir = workdir
        write_corpus(Path(workdir), args.warmup + args.steps)
        res = {"matmul": run_worker("matmul", args), "tokenizer": run_worker("tokenizer", args)}
        for kind, v in peers:
            res[f"{kind} {v}"] = run_worker(kind, args, v)
        res["ours"] = run_worker("ours", args)
        # NOTE: the machine's speed drifts by 10-20% over minutes; each later round runs the
        # fastest peer (TRL or the plain loop) and ours back to back, and the goal reads the
        # median of the rounds' ratios, so that a slow spell on one side does not decide it.
        kind, v = max(peers, key=lambda kv: res[f"{kv[0]} {kv[1]}"]["tok_s"])
        rounds = [(res[f"{kind} {v}"], res["ours"])]
        for _ in range(args.rounds - 1):
            rounds.append((run_worker(kind, args, v), run_worker("ours", args)))
        res["rounds"] = {"peer": f"{kind} {v}", "pairs": rounds}
    report(args, res)


if __name__ == "__main__":
    main()
