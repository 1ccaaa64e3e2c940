"""The cost of choosing one token over Gemma 3's 262,144-token vocabulary: a nucleus found by
sorting every row against the default way (the top candidates first), at batch 1 and 8.

  .venv/bin/python bench/nucleus.py [--threads 2] [--batches 1,8] [--repeats 20] [--gemma 16]
                                   [--clock wall|cpu]

One call of `select_device` (retrograd/sampling/select.py) on (B, 262144) logits, the median
of --repeats calls after a warm-up, for: greedy rows, temperature 1 with top_p 1 (the OpenAI
API's defaults: an inverse CDF in id order, no sort), and a nucleus (top_p 0.95) with
`fast_top_p=False` (every row sorted) and True (the default: the 256 most likely tokens, then
the tokens above a power of two, a sort only for the rows neither decides). Logits:
`peaked` (20 tokens hold almost all the mass, as a language model's next token mostly is) and
`zipf` (probability ~ rank^-1.1, a nucleus wider than 256 tokens), float32; with --gemma N
(0: none), the logits of N decode steps of Gemma 3 270M Q4_K_M answering 8 chat prompts at
temperature 0.7, top_p 0.95 (`retrograd chat`'s defaults), in the dtype the sampler keeps
them in, chosen from at temperature 0.7 and at 1. Beside each: the share of nucleus rows each
way decided. Every way chooses the same tokens (tests/unit/sampling/test_sampling_select.py);
this measures time only, with the process tuning every benchmark gets (bench/tuning.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import statistics
import time

from bench.tuning import tune

V = 262144  # Gemma 3's vocabulary
TOP_P = 0.95


def synthetic(kind: str, rows: int, seed: int):
    """(rows, V) float32 logits of one shape, each row its own noise and token order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, V)
    for r in range(rows):
        ids = torch.randperm(V, generator=gen)
        if kind == "peaked":
            out[r] = torch.randn(V, generator=gen) * 2
            out[r, ids[:20]] += 15
        else:  # zipf
            out[r, ids] = -1.1 * torch.log(torch.arange(1, V + 1).float())
    return out


def gemma_logits(steps: int, threads: int) -> list:
    """The (8, V) logits of `steps` decode steps of Gemma 3 270M sampling 8 chat answers."""
    import retrograd
    from bench.generate import gemma
    from bench.serve import chat_prompts
    from retrograd.sampling import Sampler, SampleRequest, SamplingParams

    path = gemma()
    model = retrograd.load(path, device="cpu")
    sampler = Sampler(model.decoder, model.tokenizer, fast=True)
    kept = []
    choose = sampler.choose

    def keep(live, logits):
        kept.append(logits.clone())
        return choose(live, logits)

    sampler.choose = keep
    _texts, ids = chat_prompts(path, 8, 64)
    sampler.generate(
        [
            SampleRequest(tuple(p), SamplingParams(0.7, TOP_P, steps, stop_ids=frozenset(), seed=s))
            for s, p in enumerate(ids)
        ]
    )
    return [k for k in kept if k.shape[0] == 8][:steps]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def median_ms(fn, steps: list, repeats: int) -> float:
    fn(steps[0])  # warm-up: fused kernels compile on first use
    times = []
    for r in range(repeats):
        logits = steps[r % len(steps)]
        t = clock()
        fn(logits)
        times.append(clock() - t)
    return 1e3 * statistics.median(times)


def measure(name: str, steps: list, b: int, repeats: int, temperature: float) -> str:
    """One table row: steps are (>= b, V) logits; the first b rows of each are chosen from."""
    import torch

    from retrograd.sampling.select import nucleus_above, nucleus_from_candidates, select_device

    steps = [s[:b] for s in steps]
    u = torch.rand(b, generator=torch.Generator().manual_seed(b), dtype=torch.float64)
    ones, zeros = torch.ones(b), torch.zeros(b)
    temp = torch.full((b,), temperature)
    top_p = torch.full((b,), TOP_P)

    def nucleus(fast: bool):
        return lambda z: select_device(z, temp, top_p, u, fast_top_p=fast)

    ms = [
        median_ms(lambda z: select_device(z, zeros, ones, u), steps, repeats),
        median_ms(lambda z: select_device(z, ones, ones, u), steps, repeats),
        median_ms(nucleus(False), steps, repeats),
        median_ms(nucleus(True), steps, repeats),
    ]
    tiers = [0, 0, 0]  # rows decided by the candidates, by the tokens above, by a sort
    for z in steps:
        probs = torch.softmax(z.float() / temp[:, None], -1)
        _ids, sure = nucleus_from_candidates(probs, top_p, u)
        tiers[0] += int(sure.sum())
        for r in (~sure).nonzero()[:, 0].tolist():
            tiers[1 if nucleus_above(probs[r], top_p[r], u[r]) is not None else 2] += 1
    shares = " / ".join(f"{n / sum(tiers):.0%}" for n in tiers)
    cells = " | ".join(f"{m:.2f}" for m in ms)
    return f"| {name} | {b} | {cells} | {ms[2] / ms[3]:.1f}x | {shares} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per cell")
    ap.add_argument("--gemma", type=int, default=16, help="decode steps of real logits; 0: none")
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: the process's CPU time (every thread's), steadier than wall time on a busy "
        "machine, for ratios only",
    )
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    tuning = tune()  # before torch
    import torch

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    big = max(batches)
    sets = {kind: [synthetic(kind, big, seed) for seed in range(2)] for kind in ("peaked", "zipf")}
    cases = [(kind, steps, 1.0) for kind, steps in sets.items()]
    if args.gemma:
        steps = gemma_logits(args.gemma, args.threads)
        cases += [(f"gemma, T {t}", steps, t) for t in (0.7, 1.0)]
    print(
        "\n| logits | rows | greedy ms | T 1, top_p 1 ms | nucleus, full sort ms "
        "| nucleus, default ms | full / default | nucleus rows: candidates / above / sorted |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, steps, temperature in cases:
        for b in batches:
            if b <= steps[0].shape[0]:
                print(measure(name, steps, b, args.repeats, temperature), flush=True)
    dtype = cases[-1][1][0].dtype
    print(
        f"\nV {V}, top_p {TOP_P}, T 1 unless said, {args.clock} time, median of {args.repeats} calls, "
        f"{args.threads} threads; {cases[-1][0].split(',')[0]} logits in {dtype}; "
        f"process tuning: {tuning}"
    )


if __name__ == "__main__":
    main()
