"""The two rollout backends side by side: a GRPO wave of answers through our in-process sampler
and through llama.cpp ([training].rollout_backend), speed and peak memory, on Gemma 3 270M and
the 1B Llama shape of bench/scale.py.

  .venv/bin/python bench/rollout_backends.py [--models gemma,1b] [--prompts 2] [--group 8]
                                             [--prompt-len 64] [--new 64] [--rounds 2]
                                             [--threads 2] [--rank 8] [--cache auto]

Each measurement runs in its own process (its ru_maxrss is its own), the two sides interleaved
round by round (in_process, llama_cpp, in_process, ...) because the machine's speed drifts.
A side: the model, a LoRA of rank --rank on the seven projections (random factors: the cost does
not depend on their values), one warm-up wave of 8 tokens, then two timed waves of --prompts
prompts x --group answers x --new tokens at temperature 1, top_p 1 (GRPO's sampling), end of
generation ignored so every answer has --new tokens; the rate counts generated tokens over
wall time, prefill included, and is the better of the two waves.
  - in_process: `retrograd.load` (the default compute dtype; the dense cache `--cache`: auto
    chooses on where the dense weights fit in 40% of the memory available, off is what a
    model too large for it gets) and the run's backend (sampling/backend.py `in_process`,
    fast sampling context);
  - llama_cpp: the tokenizer alone and `LlamaCppBackend` (f16 KV cache, llama.cpp's flash
    attention choice, n_batch 512) with the adapter written and applied; `sync s` is one
    adapter update (write with our exporter, load, set, free the old one). In a run the
    trainer's model is resident beside it: add the in_process side's `loaded` RSS.
Reported per model and side: tokens/s of each round, peak RSS and the RSS once loaded; then
the median of the rounds' llama_cpp / in_process ratios. Results go to docs/performance.md by
hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: bench/tokenize.py would shadow the standard library's tokenize module.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import json
import statistics
import subprocess
import time

SIDES = ("in_process", "llama_cpp")
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def model_path(name: str) -> str:
    if name == "gemma":
        from bench.generate import gemma

        return gemma()
    path = ROOT / ".cache" / "scale" / f"llama-{name}-r1-q4_k_m.gguf"
    if not path.exists():
        raise SystemExit(f"{path} is missing: python bench/scale.py --sizes {name} --build-only")
    return str(path)


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process, MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def waves(backend, tokenizer, args) -> tuple[float, list[float]]:
    """(warm-up seconds, tokens per second of each timed wave) of `backend.generate`."""
    from bench.generate import prompts
    from retrograd.sampling.params import SampleRequest, SamplingParams

    ids = prompts(tokenizer, args.prompts + 1, args.prompt_len)

    def wave(new: int, first: int) -> float:
        params = SamplingParams(1.0, 1.0, new, stop_ids=frozenset())
        requests = [
            SampleRequest(tuple(p), params, n=args.group, seeds=tuple(range(s, s + args.group)))
            for s, p in enumerate(ids[first : first + args.prompts])
        ]
        t = time.perf_counter()
        out = backend.generate(requests)
        dt = time.perf_counter() - t
        assert all(len(a.ids) == new for answers in out for a in answers)
        return args.prompts * args.group * new / dt

    t = time.perf_counter()
    wave(8, 1)  # other prompts than the timed ones; fused kernels compile here
    warm = time.perf_counter() - t
    return warm, [wave(args.new, 0) for _ in range(2)]


def random_factors(path: str, rank: int) -> dict:
    """{blk.i.<projection>.weight: (A, B)} of rank `rank`, small random values."""
    import numpy as np

    from retrograd.gguf import GGUFFile

    g = GGUFFile(path)
    rng = np.random.default_rng(0)
    out = {}
    for name in g.tensors:
        if name.startswith("blk.") and name.split(".")[-2] in TARGETS:
            n_out, n_in = g.tensor(name).shape
            a = (rng.standard_normal((rank, n_in)) * 0.01).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
            out[name] = (a, b)
    return out


def worker_in_process(args) -> dict:
    import torch

    import retrograd
    from retrograd.config.training import TrainingSection
    from retrograd.sampling.backend import in_process
    from retrograd.trainable.lora import attach_lora

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    model = retrograd.load(args.model, device="cpu", threads=args.threads, cache=args.cache)
    attach_lora(
        model.decoder, ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"], args.rank, 16.0, 0
    )
    load = time.perf_counter() - t
    training = TrainingSection(ctx=args.prompt_len + args.new + 8, threads=args.threads)
    backend = in_process(model, training, args.prompts * args.group)
    loaded = rss_mib()[0]
    warm, rates = waves(backend, model.tokenizer, args)
    return {
        "load_s": load,
        "warm_s": warm,
        "tok_s": max(rates),
        "loaded_mib": loaded,
        "peak_mib": rss_mib()[1],
        "compute": model.report.describe(),
    }


def worker_llama_cpp(args) -> dict:
    import retrograd
    from retrograd.sampling.engine import TokenChooser
    from retrograd.sampling.llamacpp import AdapterSource, LlamaCppBackend, LlamaCppSettings

    t = time.perf_counter()
    tokenizer = retrograd.load_tokenizer(args.model)
    factors = random_factors(args.model, args.rank)
    from retrograd.gguf import GGUFFile

    arch = GGUFFile(args.model).architecture
    ctx = args.prompt_len + args.new + 8
    settings = LlamaCppSettings(args.threads, args.prompts * args.group, ctx, 512)
    backend = LlamaCppBackend(
        args.model,
        TokenChooser(tokenizer, max_len=ctx),
        settings,
        AdapterSource(arch, 16.0, lambda: factors),
    )
    load = time.perf_counter() - t
    loaded = rss_mib()[0]
    backend.policy_changed(1)
    t = time.perf_counter()
    backend.sync()
    sync = time.perf_counter() - t
    warm, rates = waves(backend, tokenizer, args)
    backend.close()
    return {
        "load_s": load,
        "warm_s": warm,
        "sync_s": sync,
        "tok_s": max(rates),
        "loaded_mib": loaded,
        "peak_mib": rss_mib()[1],
    }


WORKERS = {"in_process": worker_in_process, "llama_cpp": worker_llama_cpp}


def run_side(side: str, model: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--model", model]
    for key in ("prompts", "group", "prompt_len", "new", "threads", "rank", "cache"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"failed": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma,1b", help="gemma and/or scale sizes (1b, 3b, 8b)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8, help="answers per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--cache", choices=("auto", "on", "off"), default="auto", help="ours")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    from bench.tuning import tune

    args = parse()
    tuning = tune()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)), flush=True)
        return
    print(
        f"{args.prompts} prompts x {args.group} answers x {args.new} tokens (prompt "
        f"{args.prompt_len}), T 1, LoRA r{args.rank}, {args.threads} threads, our dense cache "
        f"{args.cache}; {tuning}"
    )
    for name in args.models.split(","):
        path = model_path(name)
        rounds = []
        for r in range(args.rounds):
            got = {side: run_side(side, path, args) for side in SIDES}
            rounds.append(got)
            for side, m in got.items():
                if "failed" in m:
                    print(f"{name} round {r + 1} {side}: failed {m['failed']}", flush=True)
                    continue
                extra = f", sync {m['sync_s']:.2f} s" if "sync_s" in m else ""
                print(
                    f"{name} round {r + 1} {side:10s} {m['tok_s']:7.1f} tok/s, peak "
                    f"{m['peak_mib'] / 1024:.2f} GiB (loaded {m['loaded_mib'] / 1024:.2f}), "
                    f"load {m['load_s']:.1f} s, warm-up {m['warm_s']:.1f} s{extra}",
                    flush=True,
                )
        ratios = [
            g["llama_cpp"]["tok_s"] / g["in_process"]["tok_s"]
            for g in rounds
            if all("tok_s" in g[s] for s in SIDES)
        ]
        if ratios:
            print(
                f"{name}: llama_cpp / in_process, median of rounds: {statistics.median(ratios):.2f}x"
            )


if __name__ == "__main__":
    main()
