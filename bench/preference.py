"""DPO speed and memory on Gemma 3 270M Q4_K_M: Retrograd against TRL's DPOTrainer, one run.

  .venv/bin/python bench/preference.py [--threads 2] [--pairs 8] [--steps 2] [--warmup 1]
                                       [--trl f32,f32+gc] [--trl-batch 1,4] [--prompt-tokens 128]
                                       [--answer-tokens 128] [--ctx 512] [--rest 20] [--rounds 1]

Both sides train the same LoRA (rank 8, alpha 16, q k v o gate up down, no dropout) with DPO
(sigmoid loss, beta 0.1, the reference the base model: the adapter off, no second copy of the
weights) on the same (warmup + steps) x pairs pairs in file order, `--pairs` pairs an optimizer
step (AdamW, lr 5e-5 constant, weight decay 0, clipping at 1.0). The pairs are built here,
deterministically, from the nouns of examples/preference/plurals.jsonl (bench/preference_sides.py
`make_pairs`): a prompt of about --prompt-tokens ids (a list of nouns with their plurals, then
"Plural of <noun>:", rendered by the gemma chat format, BOS and generation prompt included), a
chosen answer (the plural, then more plurals) and a rejected one (the wrong plural, then more
wrong ones) of about --answer-tokens written tokens each: prompt + longest answer about 256
tokens, a pair 384 (the prompt once). The report checks TRL's ids for every pair, rendered by
transformers' GGUF tokenizer with the same template, against ours: the prompts are equal, and
each answer is ours plus the "\n" the template writes after <end_of_turn>, which TRL keeps and
scores (one token in 129) and ours drops (framing after the last written token). Each side
runs in its own process, with the process tuning ours gives itself (bench/tuning.py), after
`--rest` idle seconds; nothing is downloaded (HF_HUB_OFFLINE=1):
  - TRL: DPOTrainer (bench/preference_sides.py) on the GGUF as transformers loads it, with
    PEFT's LoRA, ref_model None, precompute_ref_log_probs (the reference log-probabilities of
    every pair computed once before training, as ours; without it TRL runs the same reference
    forward inside every step instead), --trl-batch pairs a forward (two rows each, prompt +
    chosen and prompt + rejected), accumulated to --pairs pairs a step. Variants as
    bench/sft.py names them: f32, f32+gc (gradient checkpointing), bf16w, autocast; where the
    CPU has no fast bf16 only the f32 ones run (ours computes in float32 there); each runs at
    each --trl-batch (comma-separated: 1 and 4 pairs a forward by default);
  - ours: `run_preference`, the loop `retrograd train` runs for algorithm = "preference", from
    a run file ([preference] loss = "dpo", reference = "base", shuffle = false,
    pairs_per_step = --pairs; [training] ctx = micro_batch = --ctx, so a pair's prompt and both
    answers are one pass, the answers attending to one pass over the prompt).
Timing, per side, model loading and tokenization excluded: "reference" is the phase that
scores every pair once with the adapter off (TRL: its constructor's `_precompute_ref_logps`;
ours: `reference_scores`), before the first step; a step's time is the wall time between the
ends of consecutive optimizer steps, after `--warmup` untimed steps (forward, backward,
clipping, AdamW, logging). Pairs per second: "train" = pairs a step / mean step time,
"reference" = pairs / reference seconds, and "pairs/s" both together (a pair's share of a
step plus its reference scoring: 1 / (step / pairs + reference / all pairs)), the figure the
ratio ours / TRL reads. TRL's fastest variant (by pairs/s) of the first round is the
denominator; each later round runs it and ours again, back to back. Peak RSS is each side's
own process's ru_maxrss (loading included); "since ref" is the high-water mark since the
reference phase began (Linux VmHWM, reset then). Results go to docs/performance.md by hand,
with this command.
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

from bench.preference_sides import make_pairs, token_pairs, worker_ours, worker_trl
from bench.sft_sides import gemma, parse_variant
from bench.tuning import tune
from retrograd.model.device import cpu_has_fast_bf16

DEFAULTS = {True: "bf16w,bf16w+gc,autocast,autocast+gc,f32,f32+gc", False: "f32,f32+gc"}


def write_pairs(workdir: Path, args) -> dict:
    """pairs.jsonl for ours, and for TRL the same messages, our ids of each pair and our
    rendering as a chat template for transformers' tokenizer (the BOS ours adds written out)."""
    from retrograd.algorithms.context import file_chat_format
    from retrograd.tokenizer.fallbacks import FALLBACKS

    n = (args.warmup + args.steps) * args.pairs
    pairs = make_pairs(file_chat_format(gemma()), n, args.prompt_tokens, args.answer_tokens)
    path = workdir / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    ids = token_pairs(path, args.ctx)
    shared = {"messages": pairs, "ids": ids, "template": "{{- bos_token -}}" + FALLBACKS["gemma"]}
    (workdir / "pairs.json").write_text(json.dumps(shared))
    return {
        key: [f(len(p[key]) for p in ids) for f in (statistics.mean, min, max)]
        for key in ("prompt", "chosen", "rejected")
    } | {
        "pair": [
            f(sum(len(p[k]) for k in ("prompt", "chosen", "rejected")) for p in ids)
            for f in (statistics.mean, min, max)
        ]
    }


def run_worker(kind: str, args, variant: str = "", batch: int = 0) -> dict:
    time.sleep(args.rest)  # each side starts from an idle machine
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--worker", kind, "--variant", variant, "--batch", str(batch)]
    for key in ("workdir", "threads", "warmup", "steps", "pairs", "ctx"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"worker {kind} {variant} failed:\n{out.stderr[-6000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    after = os.getloadavg()[0]
    print(
        f"  {kind}{f' {variant} batch {batch}' if batch else ''}: "
        f"{time.perf_counter() - t:.0f} s, load {load:.2f} before, {after:.2f} after; "
        f"reference {res['reference_s']:.1f} s, steps {res['times']} s, "
        f"peak {res['maxrss_mib']:.0f} MiB",
        flush=True,
    )
    return res | {"load": load, "load_after": after}


def row(name: str, r: dict) -> str:
    hwm = f"{r['train_peak_mib']:9.0f}" if r["train_peak_mib"] is not None else "        ?"
    return (
        f"{name:<22} {r['reference_s']:8.1f} {r['reference_pairs_s']:8.3f} {r['step_s']:8.1f}"
        f" {r['train_pairs_s']:8.3f} {r['pairs_s']:8.3f} {r['maxrss_mib']:8.0f} {hwm}"
        f" {r['load']:5.2f}"
    )


def label(key: str) -> str:
    _, variant, batch = key.split()
    return f"TRL {variant} {batch}"


def report(args, res: dict, shape: dict, rounds: list[tuple[str, dict, dict]]) -> None:
    ours = res["ours"]
    n = (args.warmup + args.steps) * args.pairs

    def spread(key: str) -> str:
        mean, lo, hi = shape[key]
        return f"{mean:.0f} ({lo}-{hi})"

    print(
        f"\nGemma 3 270M Q4_K_M, DPO (sigmoid, beta 0.1, reference = base model) LoRA rank 8 on "
        f"7 projections, AdamW lr 5e-5, {args.pairs} pairs a step, {args.threads} threads; "
        f"{n} pairs, ids a pair (mean (min-max)): prompt {spread('prompt')}, chosen "
        f"{spread('chosen')}, rejected {spread('rejected')}, all {spread('pair')}; reference "
        f"over all {n} pairs, then {args.steps} timed steps after {args.warmup}"
    )
    tunings = sorted({r["tuning"] for r in res.values()})
    print("process tuning, every side: " + " | ".join(tunings))
    print(
        f"{'side':<22} {'ref s':>8} {'ref p/s':>8} {'step s':>8} {'train p/s':>8} "
        f"{'pairs/s':>8} {'peak MiB':>8} {'since ref':>9}  load"
    )
    peers = {k: v for k, v in res.items() if k.startswith("trl ")}
    for key, r in peers.items():
        print(row(label(key), r))
    print(row(f"retrograd ({ours['dtype'].replace('torch.', '')})", ours))
    for key, r in [*peers.items(), ("ours", ours)]:
        name = label(key) if key != "ours" else "ours"
        print(
            f"  {name}: steps {r['times']} s; losses {r['losses']}; mean reference logps "
            f"chosen {r['reference_logps'][0]}, rejected {r['reference_logps'][1]}; "
            f"{r['threads']} threads"
        )
    for key, r in peers.items():
        ids = r["ids"]
        framing = ", ".join(
            f"{list(f)} = {t!r}"
            for f, t in zip(ids["framing_ids"], ids["framing_text"], strict=True)
        )
        print(
            f"  {label(key)}: ids against ours: prompts equal {ids['prompts_equal']} of "
            f"{ids['pairs']}; answers equal {ids['answers_equal']} of {2 * ids['pairs']}, equal "
            f"but for template framing after the last written token (TRL keeps and scores it, "
            f"ours drops it) {ids['answers_plus_framing']} ({framing or 'none'}); attention "
            f"{r['attention']}, {r['optimizer_kind']}"
        )
    print(f"  ours: {ours['cache']}")
    for key, trl, mine in rounds:
        print(
            f"ours / {label(key)}: {mine['pairs_s'] / trl['pairs_s']:.2f}x its pairs/s "
            f"(training {mine['train_pairs_s'] / trl['train_pairs_s']:.2f}x, reference "
            f"{mine['reference_pairs_s'] / trl['reference_pairs_s']:.2f}x) at "
            f"{mine['maxrss_mib'] / trl['maxrss_mib']:.2f}x its peak RSS"
        )
    ratios = [o["pairs_s"] / t["pairs_s"] for _, t, o in rounds]
    memory = ours["maxrss_mib"] / res[rounds[0][0]]["maxrss_mib"]
    print(
        f"TRL's fastest, {label(rounds[0][0])}: ours at median {statistics.median(ratios):.2f}x "
        f"its pairs/s, {memory:.2f}x its peak RSS"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1)")
    p.add_argument("--trl", default=DEFAULTS[cpu_has_fast_bf16()], help="TRL variants")
    p.add_argument("--trl-batch", default="1,4", help="TRL pairs per forward, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=128, help="about this many prompt ids")
    p.add_argument("--answer-tokens", type=int, default=128, help="about this many an answer")
    p.add_argument("--ctx", type=int, default=512, help="ours: [training] ctx = micro_batch")
    p.add_argument("--rest", type=float, default=20.0, help="idle seconds before each side")
    p.add_argument("--rounds", type=int, default=1, help="rounds of TRL's fastest and ours")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        tuning = tune()  # every worker, ours included, before torch: the same process tuning
        fn = {"trl": worker_trl, "ours": worker_ours}[args.worker]
        print(json.dumps(fn(args) | {"tuning": tuning}))
        return
    assert args.warmup >= 1, "--warmup must be at least 1: a step's time needs the previous end"
    assert args.steps >= 1 and args.rounds >= 1, "--steps and --rounds must be at least 1"
    variants = [v for v in args.trl.split(",") if v]
    batches = [int(b) for b in args.trl_batch.split(",") if b]
    assert variants and batches, "--trl and --trl-batch name no variant"
    for v in variants:
        parse_variant(v)  # a typo fails now, not after minutes of measuring
    for b in batches:
        assert b >= 1 and args.pairs % b == 0, f"--trl-batch {b} must divide --pairs {args.pairs}"
    with tempfile.TemporaryDirectory(prefix="bench-preference-") as workdir:
        args.workdir = workdir
        shape = write_pairs(Path(workdir), args)
        res = {f"trl {v} b{b}": run_worker("trl", args, v, b) for v in variants for b in batches}
        res["ours"] = run_worker("ours", args)
        best = max((k for k in res if k != "ours"), key=lambda k: res[k]["pairs_s"])
        rounds = [(best, res[best], res["ours"])]
        _, v, b = best.split()
        for _ in range(args.rounds - 1):
            trl = run_worker("trl", args, v, int(b[1:]))
            rounds.append((best, trl, run_worker("ours", args)))
    report(args, res, shape, rounds)


if __name__ == "__main__":
    main()
