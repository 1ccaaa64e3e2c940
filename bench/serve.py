"""`retrograd serve` under concurrent clients on Gemma 3 270M Q4_K_M, against the sampler's own
batch and llama.cpp's parallel decoding, in one run.

  .venv/bin/python bench/serve.py [--threads 2] [--prompt 128] [--new 128] [--clients 1,8,32]
                                  [--rounds 3] [--stream] [--sampling greedy,api,chat,1:0.95]

Starts `retrograd serve --base-only` (a subprocess; --max-sequences the largest N, so every
client of a run decodes at once) and for each N sends N chat completions at once through the
openai SDK, one thread per client: `max_tokens` = 128 with `ignore_eos` (vLLM's extension,
which serve honours), each client its own user message of about 128 tokens once rendered,
once for each way of choosing tokens (--sampling, as bench/generate.py): `greedy`
(temperature 0); `api`, the OpenAI API's defaults (temperature 1, top_p 1: the request names
neither, so serve's defaults apply); `chat`, `retrograd chat`'s defaults (temperature 0.7,
top_p 0.95); `T:P` any other (1:0.95, a chat client at temperature 1 with a nucleus). Each
client sends its own seed. Aggregate rate: generated tokens over the wall time from the first
request to the last answer, HTTP, queueing and prefill included. In the same run, with the
same threads, process tuning (bench/tuning.py) and settings, on the very same prompt ids (the
chat template's rendering, as serve makes it): the sampler's own batch of N sequences (one
`Sampler.generate` call in this process) and llama.cpp decoding N sequences in parallel
(bench/llamacpp.py, its sampler chain applying the settings as we do). Every side is warmed
up at each N and setting first. The first round measures every N; each later round measures
the three sides at 8 again, back to back; the goals read the medians: 8 clients through
serve at least 90% of the sampler's 8 sequences, and above llama.cpp's 8 parallel sequences.
--stream measures streamed answers instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import os
import statistics
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench.generate import (
    PRESETS,
    TEXT,
    WARM,
    Ours,
    Sampling,
    add_sampling,
    gemma,
    parse_samplings,
    timed,
)
from bench.llamacpp import LlamaBatched
from bench.tuning import tune

RUN = (
    '[run]\nalgorithm = "sft"\n[output]\npath = "unused.gguf"\n[lora]\nrank = 4\n'
    '[sft]\ndata = "data.jsonl"\n'
)


def chat_prompts(path: str, n: int, length: int) -> tuple[list[str], list[list[int]]]:
    """n user messages whose rendered prompts are about `length` ids, and those ids."""
    import retrograd
    from retrograd.gguf import GGUFFile
    from retrograd.tokenizer import ChatFormat, chat_template

    tok = retrograd.load_tokenizer(path)
    chat = ChatFormat(tok, chat_template(tok, GGUFFile(path).metadata))
    overhead = len(chat.prompt_ids([{"role": "user", "content": "x"}])) - 1
    words = tok.tokenize(TEXT * (2 + (n + length) // 40), add_bos=False)
    texts = [tok.detokenize(words[i : i + length - overhead]) for i in range(n)]
    return texts, [chat.prompt_ids([{"role": "user", "content": t}]) for t in texts]


class Server:
    """`retrograd serve` in a subprocess, and an openai client for it."""

    def __init__(self, path: str, threads: int, ctx: int, max_sequences: int):
        from openai import OpenAI

        self.dir = tempfile.TemporaryDirectory()
        run = Path(self.dir.name) / "run.toml"
        run.write_text(RUN)
        (Path(self.dir.name) / "data.jsonl").write_text("")
        cmd = [sys.executable, "-m", "retrograd.cli.main", "serve", str(run), "--base-only"]
        cmd += ["--model", path, "--device", "cpu", "--port", "0", "--ctx", str(ctx)]
        cmd += ["--max-sequences", str(max_sequences), "--model-name", "gemma"]
        env = os.environ | {"RETRO_THREADS": str(threads)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if " at http://" not in line:
            raise RuntimeError(f"retrograd serve did not start: {line!r}")
        url = line.split(" at ")[1].split()[0]
        self.client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
        print(line.strip(), flush=True)

    def ask(self, text: str, new: int, stream: bool, sampling: Sampling, seed: int) -> int:
        """One answer of `new` tokens; -> the tokens the server counted."""
        kw = dict(
            model="gemma",
            messages=[{"role": "user", "content": text}],
            max_tokens=new,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        if sampling != PRESETS["api"]:  # the API's defaults: the request names neither
            kw |= dict(temperature=sampling.temperature, top_p=sampling.top_p)
        if not stream:
            return self.client.chat.completions.create(**kw).usage.completion_tokens
        chunks = self.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        return [c for c in chunks if c.usage][-1].usage.completion_tokens

    def generate(
        self, texts: list[str], new: int, stream: bool, sampling: Sampling
    ) -> list[list[int]]:
        """All texts at once, a client thread each (client s seeded with s); -> placeholder
        ids (counts only)."""
        with ThreadPoolExecutor(len(texts)) as pool:
            counts = list(
                pool.map(lambda s: self.ask(texts[s], new, stream, sampling, s), range(len(texts)))
            )
        return [[0] * c for c in counts]

    def peak_mib(self) -> float:
        """The server process's peak RSS so far (Linux VmHWM)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        [line] = [x for x in status.splitlines() if x.startswith("VmHWM:")]
        return int(line.split()[1]) / 1024

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.dir.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three sides at 8")
    ap.add_argument("--stream", action="store_true", help="streamed answers")
    add_sampling(ap)
    args = ap.parse_args()
    settings = parse_samplings(ap, args.sampling)
    tuning = tune()  # before torch: every side gets our process tuning
    import torch

    torch.set_num_threads(args.threads)
    path = gemma()
    sizes = [int(n) for n in args.clients.split(",")]
    texts, ids = chat_prompts(path, max(sizes) + 1, args.prompt)
    server = Server(path, args.threads, args.prompt + args.new + 64, max(sizes))
    peer = LlamaBatched(path, args.threads, max(map(len, ids)) + args.new + 8)
    try:
        for n in sizes:  # warm-up: the compiled kernels of every batch size, each side
            for sampling in settings:
                server.generate(texts[-n:], WARM, args.stream, sampling)
                peer.generate(ids[-n:], WARM, sampling.temperature, sampling.top_p)
        ours = Ours(path, sizes, args.prompt, settings)
        rounds = {s: [] for s in settings}
        for r in range(args.rounds):
            asked = sizes if r == 0 else [n for n in sizes if n == 8]
            for sampling in settings:
                sides = (server, ours, peer)
                rounds[sampling].append(one_round(sides, texts, ids, asked, sampling, args))
        peak = server.peak_mib()
    finally:
        server.close()
    prompt_len = statistics.mean(len(p) for p in ids)
    for sampling, runs in rounds.items():
        report(runs, args, tuning, prompt_len, sampling)
    print(
        f"serve's peak RSS: {peak:,.0f} MiB (its own process; the sampler's and llama.cpp's "
        "alone: bench/generate.py --side ours|llama.cpp)"
    )


def one_round(sides, texts, ids, sizes, sampling: Sampling, args) -> dict:
    """{side: {N: tokens/s}}: serve, the sampler and llama.cpp at each N in sizes."""
    server, ours, peer = sides
    t, p = sampling.temperature, sampling.top_p
    rates: dict[str, dict[int, float]] = {"serve": {}, "sampler": {}, "llama.cpp": {}}

    def serve(_ids, new):
        return server.generate(texts[: len(_ids)], new, args.stream, sampling)

    for n in sizes:
        name = f"{sampling.name:6s}"
        rates["serve"][n] = timed(f"{name} serve", serve, ids[:n], args.new)
        rates["sampler"][n] = timed(f"{name} sampler", ours.generate, ids[:n], args.new, sampling)
        rates["llama.cpp"][n] = timed(f"{name} llama.cpp", peer.generate, ids[:n], args.new, t, p)
    return rates


def report(rounds, args, tuning: str, prompt_len: float, sampling: Sampling) -> None:
    first = rounds[0]
    mode = "streamed" if args.stream else "whole answers"
    how = f"T {sampling.temperature}, top_p {sampling.top_p}" if sampling.temperature else ""
    print(f"\n{sampling.name} {how}".rstrip())
    print(f"| clients | serve tokens/s ({mode}) | sampler | llama.cpp | serve / sampler |")
    print("| --- | --- | --- | --- | --- |")
    for n, rate in first["serve"].items():
        s, ll = first["sampler"][n], first["llama.cpp"][n]
        print(f"| {n} | {rate:.1f} | {s:.1f} | {ll:.1f} | {rate / s:.2f} |")
    print(
        f"\nprompts of {prompt_len:.0f} ids on average, {args.new} new tokens each, "
        f"{args.threads} threads every side; process tuning: {tuning}"
    )
    eights = [r for r in rounds if 8 in r["serve"]]
    if not eights:
        return
    of_sampler = [r["serve"][8] / r["sampler"][8] for r in eights]
    of_llama = [r["serve"][8] / r["llama.cpp"][8] for r in eights]
    print(
        "8 clients against the sampler's 8 sequences, round by round: "
        + ", ".join(f"{x:.2f}" for x in of_sampler)
        + f"; median {statistics.median(of_sampler):.2f} (goal >= 0.90)"
    )
    print(
        "8 clients against llama.cpp's 8 parallel sequences, round by round: "
        + ", ".join(f"{x:.2f}x" for x in of_llama)
        + f"; median {statistics.median(of_llama):.2f}x (goal > 1x)"
    )


if __name__ == "__main__":
    main()
