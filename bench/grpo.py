"""GRPO update speed and memory on Gemma 3 270M Q4_K_M: Retrograd against TRL, one run.

  .venv/bin/python bench/grpo.py [--threads 2] [--updates 2] [--warmup 1] [--trl f32,f32+gc]
                                 [--prompts 4] [--group 8] [--new 64] [--rest 20] [--rounds 1]

Both sides run the same update: a LoRA (rank 8, alpha 16, q k v o gate up down, no dropout),
4 prompts of bench/grpo-prompts.jsonl (arithmetic questions) in file order (chat-rendered by
the gemma format; TRL gets the same messages as conversational prompts and renders the same
ids, which the report checks), 8 answers each at temperature 1 (top-p 1, no top-k), exactly 64 new tokens per answer
(end of generation ignored: TRL by `min_new_tokens`, ours by dropping the sampler's stop ids in
the bench's process), rewarded by examples/rewards/arithmetic.py (ours runs it as its reward
program; TRL calls its `score` as a Python reward function), advantages as the reward minus the
group's mean (no division by the standard deviation), one pass (grpo_epochs / num_iterations 1)
of the clipped surrogate (0.2 / 0.28) averaged over the update's tokens (DAPO's token mean), no
KL term and no reference model (beta 0), one AdamW step (lr 2e-4, constant, weight decay 0,
clipping at 1.0). Each side runs in its own process, with the process tuning ours gives itself
(bench/tuning.py), after `--rest` idle seconds; nothing is downloaded (HF_HUB_OFFLINE=1):
  - TRL: GRPOTrainer (bench/grpo_sides.py) on the GGUF as transformers loads it, with PEFT's
    LoRA; the 32 answers generated in one transformers `generate` call (no vLLM) and trained in
    one pass and one optimizer step. Variants as bench/sft.py names them: f32, f32+gc (gradient
    checkpointing), bf16w, autocast; where the CPU has no fast bf16 only the f32 ones run (bf16
    products run on PyTorch's scalar fallback there, and ours computes in float32);
  - ours: `run_grpo`, the loop `retrograd train` runs for algorithm = "grpo", from a run file
    ([training] ctx = micro_batch = --ctx, so that a group's prompt and answers are one pass).
Timing, per side, after `--warmup` untimed updates: an update's time is the wall time between
the ends of consecutive updates; its phases are generation (sampling and decoding the answers),
reward, scoring (old or reference log-probabilities computed before the optimizer pass; with beta
0 neither side computes any: both take the old ones from the optimizer pass's own forward, ratio
1) and optimizer (forward, backward, clipping, AdamW step); bench/grpo_sides.py says how each is
cut out on each side; "other" is the rest (logging, bookkeeping). The goal's denominator is TRL's
fastest variant of the first round; each later round runs it and ours again, back to back. Peak
RSS is each side's own process's ru_maxrss (loading included; "train peak" is the high-water mark
since training began). Results go to docs/performance.md by hand, with this command.
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

from bench.grpo_sides import PHASES, PROMPTS, worker_ours, worker_trl
from bench.sft_sides import gemma, parse_variant
from bench.tuning import tune
from retrograd.model.device import cpu_has_fast_bf16

DEFAULTS = {True: "bf16w,bf16w+gc,autocast,autocast+gc,f32,f32+gc", False: "f32,f32+gc"}


def write_prompts(workdir: Path, n: int) -> None:
    """The first n prompts, their ids as ours renders them, and that rendering as a template
    for transformers' tokenizer (the BOS our tokenizer adds written out)."""
    from retrograd.gguf import GGUFFile
    from retrograd.tokenizer import ChatFormat, Tokenizer, chat_template
    from retrograd.tokenizer.fallbacks import FALLBACKS

    gguf = GGUFFile(gemma())
    tok = Tokenizer.from_gguf(gguf)
    chat = ChatFormat(tok, chat_template(tok, gguf.metadata, {}))
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:n]
    messages = [json.loads(line)["messages"] for line in lines]
    shared = {
        "messages": messages,
        "ids": [chat.prompt_ids(m) for m in messages],
        "template": "{{- bos_token -}}" + FALLBACKS["gemma"],
    }
    (workdir / "prompts.json").write_text(json.dumps(shared))


def run_worker(kind: str, args, variant: str = "", script: str = __file__) -> dict:
    """One side in its own process: `script --worker kind` (bench/ppo.py reuses this)."""
    time.sleep(args.rest)  # each side starts from an idle machine
    load = os.getloadavg()[0]
    cmd = [sys.executable, script, "--worker", kind, "--variant", variant]
    for key in ("workdir", "threads", "warmup", "updates", "prompts", "group", "new", "ctx"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"worker {kind} {variant} failed:\n{out.stderr[-6000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    after = os.getloadavg()[0]
    print(
        f"  {kind} {variant}: {time.perf_counter() - t:.0f} s, load {load:.2f} before, "
        f"{after:.2f} after; {json.dumps(res['updates'])}, peak {res['maxrss_mib']:.0f} MiB",
        flush=True,
    )
    return res | {"load": load, "load_after": after}


def mean(r: dict, key: str) -> float:
    return statistics.mean(u[key] for u in r["updates"])


def row(name: str, r: dict) -> str:
    hwm = f"{r['train_peak_mib']:8.0f}" if r["train_peak_mib"] is not None else "       ?"
    cells = "".join(f" {mean(r, k):9.2f}" for k in (*PHASES, "other", "total"))
    return f"{name:<18}{cells} {r['maxrss_mib']:8.0f} {hwm} {r['load']:5.2f}"


def phase_ratio(theirs: float, ours: float) -> str:
    """TRL's seconds over ours; "-" where both are too small to compare (under 10 ms)."""
    return "-" if max(theirs, ours) < 0.01 else f"{theirs / max(ours, 1e-3):.2f}x"


def report(args, res: dict, rounds: list[tuple[str, dict, dict]], ours_is: str = "GRPO") -> None:
    ours = res["ours"]
    answers = args.prompts * args.group
    print(
        f"\nGemma 3 270M Q4_K_M, {ours_is} LoRA rank 8 on 7 projections, {args.prompts} prompts x "
        f"group {args.group} x {args.new} new tokens ({answers * args.new} answer tokens an "
        f"update), beta 0, DAPO token mean, AdamW lr 2e-4, {args.threads} threads; "
        f"{args.updates} timed updates after {args.warmup}; seconds per update (mean)"
    )
    tunings = sorted({r["tuning"] for r in res.values()})
    print("process tuning, every side: " + " | ".join(tunings))
    head = "".join(f" {k:>9}" for k in (*PHASES, "other", "total"))
    print(f"{'side':<18}{head} peak MiB train MiB  load")
    peers = {k: v for k, v in res.items() if k.startswith("trl ")}
    for key, r in peers.items():
        print(row(f"TRL {key.split()[1]}", r))
    print(row(f"retrograd ({ours['dtype'].replace('torch.', '')})", ours))
    for name, r in [*peers.items(), ("ours", ours)]:
        print(
            f"  {name}: updates {[u['total'] for u in r['updates']]} s; mean reward "
            f"{r['reward_mean']}; answer tokens {r['answer_tokens']}; first update "
            f"{r['first_update_s']:.1f} s; {r['threads']} threads"
        )
    for key, r in peers.items():
        print(
            f"  {key}: prompt ids equal to ours for {r['prompt_ids_equal']} prompts; "
            f"groups with zero reward spread {r['zero_std_groups']}; attention "
            f"{r['attention']}, {r['optimizer_kind']}"
        )
    print(f"  ours: trained fraction {ours.get('trained_fraction')}; {ours['cache']}")
    for name, trl, mine in rounds:
        speed = mean(trl, "total") / mean(mine, "total")
        print(
            f"ours / TRL {name}: {speed:.2f}x its update speed ("
            + ", ".join(f"{k} {phase_ratio(mean(trl, k), mean(mine, k))}" for k in PHASES)
            + f") at {mine['maxrss_mib'] / trl['maxrss_mib']:.2f}x its peak RSS"
        )
    ratios = [mean(t, "total") / mean(o, "total") for _, t, o in rounds]
    memory = ours["maxrss_mib"] / res[f"trl {rounds[0][0]}"]["maxrss_mib"]
    met = statistics.median(ratios) >= 5 and memory <= 1
    print(
        f"goal: >= 5x TRL's fastest update at <= 1x its peak RSS: median {statistics.median(ratios):.2f}x"
        f" at {memory:.2f}x: {'met' if met else 'not met'}"
    )


def main(script: str = __file__, ours_is: str = "GRPO", workers=None, doc=__doc__) -> None:
    """The driver; bench/ppo.py runs it with its own script, label and our worker."""
    workers = workers or {"trl": worker_trl, "ours": worker_ours}
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--updates", type=int, default=2, help="timed updates per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first (at least 1)")
    p.add_argument("--trl", default=DEFAULTS[cpu_has_fast_bf16()], help="TRL variants")
    p.add_argument("--prompts", type=int, default=4, help="prompts per update")
    p.add_argument("--group", type=int, default=8, help="answers per prompt")
    p.add_argument("--new", type=int, default=64, help="new tokens per answer")
    p.add_argument("--ctx", type=int, default=1024, help="ours: [training] ctx = micro_batch")
    p.add_argument("--rest", type=float, default=20.0, help="idle seconds before each side")
    p.add_argument("--rounds", type=int, default=1, help="rounds of TRL's fastest and ours")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        tuning = tune()  # every worker, ours included, before torch: the same process tuning
        fn = workers[args.worker]
        print(json.dumps(fn(args) | {"tuning": tuning}))
        return
    assert args.warmup >= 1, "--warmup must be at least 1: an update's time needs the previous end"
    assert args.updates >= 1 and args.rounds >= 1, "--updates and --rounds must be at least 1"
    variants = [v for v in args.trl.split(",") if v]
    assert variants, "--trl names no variant"
    for v in variants:
        parse_variant(v)  # a typo fails now, not after minutes of measuring
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as workdir:
        args.workdir = workdir
        write_prompts(Path(workdir), (args.warmup + args.updates) * args.prompts)
        res = {f"trl {v}": run_worker("trl", args, v, script) for v in variants}
        res["ours"] = run_worker("ours", args, "", script)
        best = min(variants, key=lambda v: mean(res[f"trl {v}"], "total"))
        rounds = [(best, res[f"trl {best}"], res["ours"])]
        for _ in range(args.rounds - 1):
            rounds.append(
                (best, run_worker("trl", args, best, script), run_worker("ours", args, "", script))
            )
    report(args, res, rounds, ours_is)


if __name__ == "__main__":
    main()
