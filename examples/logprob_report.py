"""A log-probability report: how likely the model finds each token of a few texts.

  .venv/bin/python examples/logprob_report.py --model MODEL.gguf [--device auto] [--dtype bf16]

Uses only the public Python API (docs/python.md): retrograd.load, tokenize, detokenize,
logits. For each text it prints every token with its log-probability, its rank among the
vocabulary and the model's own top guesses, then the text's perplexity; finally a short
greedy continuation from the sampler.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from rich.console import Console
from rich.table import Table

import retrograd
from retrograd.sampling import Sampler, SampleRequest, SamplingParams

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
]


def report(model, text: str, con: Console) -> float:
    ids = model.tokenize(text, add_bos=True)
    logp = torch.log_softmax(model.logits(ids), dim=-1)  # (T, V) float32
    table = Table(title=repr(text), title_justify="left")
    for col in ("token", "log p", "rank", "model's top 3"):
        table.add_column(col, justify="right" if col in ("log p", "rank") else "left")
    nll = 0.0
    for i in range(1, len(ids)):
        row = logp[i - 1]
        lp = float(row[ids[i]])
        rank = int((row > row[ids[i]]).sum()) + 1
        top = ", ".join(repr(model.detokenize([int(t)])) for t in row.topk(3).indices)
        table.add_row(repr(model.detokenize([ids[i]])), f"{lp:.2f}", str(rank), top)
        nll -= lp
    con.print(table)
    ppl = math.exp(nll / (len(ids) - 1))
    con.print(f"{len(ids) - 1} tokens, mean NLL {nll / (len(ids) - 1):.3f}, perplexity {ppl:.2f}\n")
    return ppl


def continue_greedy(model, prompt: str, n: int) -> str:
    sampler = Sampler(model.decoder, model.tokenizer)
    ids = tuple(model.tokenize(prompt, add_bos=True))
    request = SampleRequest(
        ids, SamplingParams(temperature=0.0, max_new_tokens=n, stop_ids=frozenset())
    )
    [[done]] = sampler.generate([request])
    return done.text


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bf16"), help="default: the device's fast one"
    )
    args = p.parse_args()
    con = Console()
    start = time.perf_counter()
    model = retrograd.load(args.model, device=args.device, dtype=args.dtype)
    con.print(f"[bold]{model.gguf.path.name}[/]: {model.report.describe()}")
    ppls = [report(model, text, con) for text in TEXTS]
    prompt = "The three primary colors are"
    con.print(f"[bold]greedy continuation[/] of {prompt!r}: {continue_greedy(model, prompt, 24)!r}")
    con.print(
        f"mean perplexity {sum(ppls) / len(ppls):.2f}; done in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
