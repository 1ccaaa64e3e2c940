"""Before and after: the base model's and the adapter's answers to questions neither saw.

  .venv/bin/python examples/demo/continuations.py --model MODEL.gguf --adapter out/demo/pirate.gguf

Renders each question with the model's chat template (Gemma's family format here), then decodes
greedily with the KV cache, once with the adapter switched off and once with it on: the same
loaded model, the same code path as `retrograd bench`.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import retrograd
from retrograd.algorithms.context import chat_format
from retrograd.model.kv_cache import KVCache
from retrograd.trainable.lora import apply_adapter_file

QUESTIONS = [
    "What is the capital of Australia?",
    "What color is a ripe strawberry?",
    "What sound does a pig make?",
    "What is 12 plus 30?",
]


@torch.no_grad()
def answer(model, prompt_ids: list[int], max_new: int = 40) -> str:
    ids = torch.tensor([prompt_ids], device=model.device)
    cache = KVCache.empty(model.config, 1, len(prompt_ids) + max_new, model.dtype, model.device)
    h = model.decoder(ids, cache=cache)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model.decoder.head(h[:, -1])[0].argmax())
        if model.tokenizer.is_eog(nxt):
            break
        out.append(nxt)
        h = model.decoder(
            torch.tensor([[nxt]], device=model.device), start=cache.length, cache=cache
        )
    return model.detokenize(out).strip()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    args = p.parse_args()
    model = retrograd.load(args.model, device=args.device)
    fmt = chat_format(model)
    adapters = apply_adapter_file(model.decoder, args.adapter)
    table = Table(
        title="greedy answers to held-out questions", title_justify="left", show_lines=True
    )
    for col in ("question", "base model", "with the adapter"):
        table.add_column(col, overflow="fold")
    for q in QUESTIONS:
        prompt = fmt.prompt_ids([{"role": "user", "content": q}])
        row = [q]
        for enabled in (False, True):
            for lo in adapters.values():
                lo.enabled = enabled
            row.append(answer(model, prompt))
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
