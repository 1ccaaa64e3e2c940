"""Before and after: the base model's and the adapter's answers to questions neither saw.

  .venv/bin/python examples/demo/continuations.py --model MODEL.gguf --adapter out/demo/pirate.gguf

Renders each question with the model's chat template (Gemma's family format here), then decodes
greedily with the sampler `retrograd chat` and `serve` use, once with the adapter switched off
and once with it on: the same loaded model.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

import retrograd
from retrograd.algorithms.context import chat_format
from retrograd.sampling import Sampler, SampleRequest, SamplingParams
from retrograd.trainable.lora import apply_adapter_file

QUESTIONS = [
    "What is the capital of Australia?",
    "What color is a ripe strawberry?",
    "What sound does a pig make?",
    "What is 12 plus 30?",
]


def answer(sampler: Sampler, prompt_ids: list[int], max_new: int = 40) -> str:
    """Greedy answer, ending at the model's end-of-turn token."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    [[done]] = sampler.generate([SampleRequest(tuple(prompt_ids), params)])
    return done.text.strip()


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
    sampler = Sampler(model.decoder, model.tokenizer)
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
            row.append(answer(sampler, prompt))
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
